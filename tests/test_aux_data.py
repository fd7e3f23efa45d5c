"""`NO_AUX_DATA` (fa4_rowmax/aux_data.py): the empty AuxData that CuTe DSL compiles without a warning.

Note [An empty AuxData as a JIT argument]: `cute.compile` warns on FA4's `AuxData()` (a tuple with no
leaves). The real compiler runs here, on the CPU, on a host function and kernel with FA4's `aux_data:
AuxData` parameter, with and without tvm-ffi (the SM90 FP8 forward compiles with `--enable-tvm-ffi`).
"""

import warnings

import pytest
from flash_attn.cute.utils import AuxData

from fa4_rowmax.aux_data import NO_AUX_DATA


def test_it_is_the_empty_aux_data():
    assert isinstance(NO_AUX_DATA, AuxData)
    assert NO_AUX_DATA == AuxData() and tuple(NO_AUX_DATA) == (None, None)
    assert NO_AUX_DATA.tensors is None and NO_AUX_DATA.scalars is None


def test_the_dsl_derives_for_it_what_it_derives_for_an_empty_tuple():
    from cutlass.base_dsl.typing import get_c_pointers, get_mlir_types, implements_jit_argument
    from cutlass.base_dsl.utils.mlir_value_tree import new_from_mlir_values

    assert implements_jit_argument(NO_AUX_DATA) and not implements_jit_argument(AuxData())
    assert get_mlir_types(NO_AUX_DATA) == get_mlir_types(AuxData()) == []
    assert get_c_pointers(NO_AUX_DATA) == get_c_pointers(AuxData()) == []
    assert new_from_mlir_values(NO_AUX_DATA, []) == new_from_mlir_values(AuxData(), []) == AuxData()


def _compile_warnings(aux_data, options: str) -> list[str]:
    import cutlass
    import cutlass.cute as cute

    class Kernel:
        """FA4's shape: the host function takes `aux_data: AuxData` and hands it to the kernel."""

        @cute.jit
        def __call__(self, x: cutlass.Int32, aux_data: AuxData = AuxData()):
            assert aux_data == AuxData()  # rebuilt on the host side as the empty AuxData
            self.kernel(x, aux_data).launch(grid=[1, 1, 1], block=[32, 1, 1])

        @cute.kernel
        def kernel(self, x: cutlass.Int32, aux_data: AuxData):
            assert aux_data == AuxData()  # and on the kernel side
            cute.printf("%d", x)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled = cute.compile(Kernel(), cutlass.Int32(3), aux_data, options=options)
    assert compiled is not None
    return [str(w.message) for w in caught if issubclass(w.category, UserWarning) and "aux_data" in str(w.message)]


@pytest.mark.parametrize("options", ["", "--enable-tvm-ffi"])
def test_cute_compile_warns_on_the_plain_one_and_not_on_this_one(options):
    plain = _compile_warnings(AuxData(), options)
    assert len(plain) == 1 and "cannot be converted to a JitArgument" in plain[0]  # the warning this removes
    assert _compile_warnings(NO_AUX_DATA, options) == []
