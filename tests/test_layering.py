"""The import graph has three floors, arrows only downward: fa4_rowmax (base) <- aiter_fused <- bench.
scripts/ holds entry points only: no package imports from it and nothing puts it on sys.path."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FORBIDDEN = {
    "fa4_rowmax": ("aiter_fused", "bench", "scripts"),
    "aiter_fused": ("bench", "scripts"),
    "bench": ("scripts",),
}


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" and node.args:
            if isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                names.add(node.args[0].value.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_points_up(package):
    offenders = {
        str(p.relative_to(ROOT)): sorted(_imports(p) & set(FORBIDDEN[package])) for p in (ROOT / package).rglob("*.py")
    }
    assert {f: names for f, names in offenders.items() if names} == {}


SCRIPTS_ON_PATH = ('ROOT / "scripts"', 'parent / "scripts"', "sys.path.insert(0, str(Path(__file__).resolve().parent))")


def test_nothing_puts_scripts_on_the_path():
    for path in [
        *ROOT.glob("fa4_rowmax/**/*.py"),
        *ROOT.glob("aiter_fused/**/*.py"),
        *ROOT.glob("bench/**/*.py"),
        *ROOT.glob("tests/**/*.py"),
        *ROOT.glob("scripts/*.py"),
    ]:
        if path == Path(__file__).resolve():
            continue
        text = path.read_text()
        assert not any(pattern in text for pattern in SCRIPTS_ON_PATH), path


def test_the_walker_sees_an_upward_import(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text(
        "import os\nfrom bench.kernels import KERNELS\nimport importlib\nimportlib.import_module('aiter_fused.ops')\n"
    )
    assert _imports(bad) >= {"bench", "aiter_fused"}
