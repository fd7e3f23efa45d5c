"""Fork drift: the stage subclasses override methods of FA4's `Softmax` / `SoftmaxSm100` (the SM90 stages fork
`online_softmax`, `finalize` and `rescale_O` whole, the SM90 FP8 stage too). When the pinned wheel's stock source
of an overridden method changes, this test fails, so the change is ported into the fork (then the pin below is
updated).

The stock source is read from the installed FA4 file with `ast` (the methods are DSL-wrapped, so `inspect`
cannot see them), one method at a time: the hash covers exactly the method's text. A method counts as
overridden by a stage when any class of the stage's MRO above FA4's class defines it (the shared SM90 mixin's
`online_softmax` included).
"""

import ast
import hashlib
from pathlib import Path

import pytest

from fa4_rowmax import patching
from fa4_rowmax.stage.softmax_sm90 import RowmaxSoftmaxSm90
from fa4_rowmax.stage.softmax_sm90_fp8 import Fp8SoftmaxSm90
from fa4_rowmax.stage.softmax_sm100 import RowmaxSoftmaxSm100

_ONLINE_SOFTMAX = "0cd03a2e24eefad1baf64fb405eae562938cc89027a7178a59cf38ff78970ff8"
_FINALIZE = "21a4dc2c2cffe96af243bffd23d036add8cff1b7d71261af80b29277da2e9751"
_RESCALE_O = "64df490814fd794f35e628ee871f8d0e80f8e8527d95c488a22795225a1685b6"
# (stage, stock class, method) -> sha256 of the method's source in flash-attn-4 4.0.0b36 (flash_attn/cute/softmax.py).
STOCK_METHOD_SHA256 = {
    ("RowmaxSoftmaxSm90", "Softmax", "online_softmax"): _ONLINE_SOFTMAX,
    ("RowmaxSoftmaxSm90", "Softmax", "finalize"): _FINALIZE,
    ("RowmaxSoftmaxSm90", "Softmax", "rescale_O"): _RESCALE_O,
    ("Fp8SoftmaxSm90", "Softmax", "online_softmax"): _ONLINE_SOFTMAX,
    ("Fp8SoftmaxSm90", "Softmax", "finalize"): _FINALIZE,
    ("Fp8SoftmaxSm90", "Softmax", "rescale_O"): _RESCALE_O,
    ("RowmaxSoftmaxSm100", "SoftmaxSm100", "update_row_max_precomputed"): (
        "ce1cad4703a33173d50f81920063bc121713ab61ceb91a5cc81718640a790014"
    ),
    ("RowmaxSoftmaxSm100", "SoftmaxSm100", "apply_exp2_convert"): (
        "7cad5bea81fdccd0367f0ae439a0b99a00684af28967772364172fe809f6d722"
    ),
}
STAGES = ((RowmaxSoftmaxSm90, "Softmax"), (Fp8SoftmaxSm90, "Softmax"), (RowmaxSoftmaxSm100, "SoftmaxSm100"))


def _stock_methods(class_name: str) -> dict[str, str]:
    path = Path(patching.default_site()) / "flash_attn/cute/softmax.py"
    source = path.read_text()
    (node,) = [n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == class_name]
    return {
        f.name: ast.get_source_segment(source, f)
        for f in node.body
        if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
    }


def _overridden() -> list[tuple[str, str, str, str]]:
    rows = []
    for ours, stock_name in STAGES:
        stock = _stock_methods(stock_name)
        ancestors = ours.__mro__[: [c.__name__ for c in ours.__mro__].index(stock_name)]
        names = sorted({name for cls in ancestors for name in vars(cls) if name in stock})
        rows += [(ours.__name__, stock_name, name, stock[name]) for name in names]
    return rows


def test_the_pin_lists_exactly_the_overridden_methods():
    assert {(s, c, m) for s, c, m, _ in _overridden()} == set(STOCK_METHOD_SHA256)


@pytest.mark.parametrize("stage, class_name, method, source", _overridden(), ids=lambda x: x if len(x) < 40 else "")
def test_stock_source_of_every_overridden_method_is_unchanged(stage, class_name, method, source):
    digest = hashlib.sha256(source.encode()).hexdigest()
    assert digest == STOCK_METHOD_SHA256[(stage, class_name, method)], (
        f"FA4's {class_name}.{method} (overridden by {stage}) changed in the installed wheel: port the change into "
        f"the fa4_rowmax stage, then pin {digest}"
    )
