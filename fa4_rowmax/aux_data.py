"""`NO_AUX_DATA`: FA4's empty `AuxData` in a form CuTe DSL accepts as a compile argument without a warning.

Note [An empty AuxData as a JIT argument]
FA4's kernels take `aux_data: AuxData`, a NamedTuple of tensors and scalars. CuTe DSL converts a tuple by
its leaves; `AuxData()` has none (both fields None), so the argument yields no MLIR type and `cute.compile`
warns "Argument aux_data ... cannot be converted to a JitArgument" (a UserWarning) on every compile that
passes no aux tensors, such as the SM90 FP8 forward without descales. `NO_AUX_DATA` is the same value
(equal to `AuxData()`, so tvm-ffi's argument spec is the same tuple of two Nones) and implements the
JitArgument protocol (host) and the DynamicExpression protocol (kernel) the way the DSL treats an empty
tuple: no C pointers, no MLIR types or values, and itself when rebuilt from no values. The FP8 forward's
SASS is the same with either. An `AuxData` that holds a tensor has leaves and converts as it is. FA4's own
interface passes `AuxData(None, None)` on its compiles too and warns the same way there (its code, not ours).
"""

from __future__ import annotations

from flash_attn.cute.utils import AuxData


class _EmptyAuxData(AuxData):
    """An `AuxData()` that tells CuTe DSL it carries no runtime values (Note [An empty AuxData as a JIT argument])."""

    __slots__ = ()

    def __c_pointers__(self) -> list:
        return []

    def __get_mlir_types__(self) -> list:
        return []

    def __extract_mlir_values__(self) -> list:
        return []

    def __new_from_mlir_values__(self, values) -> _EmptyAuxData:
        return self


NO_AUX_DATA = _EmptyAuxData()
