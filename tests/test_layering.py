"""Every import arrow points down (Note [Floors]); scripts/ and studies/ sit outside the packages; tests share
helpers through helper modules, never through another test module.

Note [Floors]
The packages: fa4_rowmax (base) <- aiter_fused <- bench. Beside them, studies/ (investigations, one folder each)
may import any package, and nothing in a package or in scripts/ imports a study. scripts/ holds entry points
only: nothing imports it or puts it on sys.path. Nothing outside tests/ imports a test module, puts tests/ on
sys.path or runs another file with runpy (what is shared lives in a package module, e.g. fa4_rowmax.testing).
Inside fa4_rowmax (`FA4_ROWMAX_FLOORS`): config, reference, process_mode (and the import-free patching,
aux_data, source_digest) at the bottom; the CuTe-DSL stages above; interface, gates, fp8_sm90 and patched_wheel
above those; the entry points hf, hf_paged, the vLLM backend (vllm_plugin, vllm_routing, vllm_backend) and __main__
above; testing at the top, free to import all of fa4_rowmax and imported by none of it. A module may import its own
floor and the floors below; a module the table does not name fails until it is given a floor.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("fa4_rowmax", "aiter_fused", "bench")
FORBIDDEN = {
    "fa4_rowmax": ("aiter_fused", "bench", "scripts", "studies", "tests"),
    "aiter_fused": ("bench", "scripts", "studies", "tests"),
    "bench": ("scripts", "studies", "tests"),
    "studies": ("scripts", "tests"),
}
# The first name under fa4_rowmax -> its floor (Note [Floors]).
FA4_ROWMAX_FLOORS = {
    "config": 0,
    "reference": 0,
    "patching": 0,
    "aux_data": 0,
    "source_digest": 0,
    "process_mode": 0,
    "stage": 1,
    "interface": 2,
    "gates": 2,
    "fp8_sm90": 2,
    "patched_wheel": 2,
    "hf": 3,
    "vllm_plugin": 3,
    "vllm_routing": 3,
    "vllm_backend": 3,
    "hf_paged": 3,
    "__main__": 3,
    "testing": 4,
}


def _module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported_modules(path: Path, root: Path = ROOT) -> set[str]:
    """Every module `path` (under `root`) imports, fully qualified: `import a.b`, `from a.b import c` (a.b and
    a.b.c: c may be a module), relative imports resolved against `path`'s package, `importlib.import_module("a.b")`."""
    package = _module_name(path, root).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join(base + ([node.module] if node.module else []))
            names.add(module)
            names |= {f"{module}.{alias.name}" for alias in node.names if alias.name != "*"}
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" and node.args:
            if isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                names.add(node.args[0].value)
    return {name for name in names if name}


def _top_names(path: Path) -> set[str]:
    return {name.split(".")[0] for name in _imported_modules(path)}


def _python_files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_no_import_points_up(package):
    offenders = {
        str(p.relative_to(ROOT)): sorted(_top_names(p) & set(FORBIDDEN[package])) for p in _python_files(package)
    }
    assert {f: names for f, names in offenders.items() if names} == {}


def test_scripts_import_no_study_and_no_test():
    offenders = {
        str(p.relative_to(ROOT)): sorted(_top_names(p) & {"studies", "tests"}) for p in _python_files("scripts")
    }
    assert {f: names for f, names in offenders.items() if names} == {}


def _fa4_rowmax_floor(module: str) -> int:
    name = module.split(".")[1]
    assert name in FA4_ROWMAX_FLOORS, f"fa4_rowmax.{name} has no floor in FA4_ROWMAX_FLOORS (Note [Floors])"
    return FA4_ROWMAX_FLOORS[name]


def test_no_import_points_up_inside_fa4_rowmax():
    offenders = {}
    for path in _python_files("fa4_rowmax"):
        module = _module_name(path)
        if module == "fa4_rowmax":
            continue
        floor = _fa4_rowmax_floor(module)
        above = sorted(
            name
            for name in _imported_modules(path)
            if name.startswith("fa4_rowmax.")
            and name.split(".")[1] in FA4_ROWMAX_FLOORS
            and FA4_ROWMAX_FLOORS[name.split(".")[1]] > floor
        )
        if above:
            offenders[module] = above
    assert offenders == {}


def test_every_fa4_rowmax_module_has_a_floor():
    for path in _python_files("fa4_rowmax"):
        if _module_name(path) != "fa4_rowmax":
            _fa4_rowmax_floor(_module_name(path))


def _sys_path_edits(path: Path) -> list[str]:
    """The source of every statement of `path` that changes sys.path (insert/append/extend, an assignment)."""
    text = path.read_text()
    edits = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") in ("insert", "append", "extend"):
            target = node.func.value
        elif isinstance(node, (ast.Assign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            target = next((t.value if isinstance(t, ast.Subscript) else t for t in targets), None)
        else:
            continue
        if ast.unparse(target) == "sys.path":
            edits.append(ast.get_source_segment(text, node) or ast.unparse(node))
    return edits


def _outside_tests() -> list[Path]:
    return _python_files(*PACKAGES, "scripts", "studies")


def _puts_scripts_on_the_path(path: Path, edit: str) -> bool:
    """A sys.path edit naming scripts/, or, in a file of scripts/, adding that file's own folder."""
    own_folder = path.parent == ROOT / "scripts" and "Path(__file__).resolve().parent)" in edit
    return "scripts" in edit or own_folder


def test_nothing_puts_scripts_on_the_path():
    offenders = {}
    for path in [*_outside_tests(), *_python_files("tests")]:
        found = [edit for edit in _sys_path_edits(path) if _puts_scripts_on_the_path(path, edit)]
        if found:
            offenders[str(path.relative_to(ROOT))] = found
    assert offenders == {}


def test_nothing_outside_tests_puts_tests_on_the_path_or_uses_runpy():
    offenders = {}
    for path in _outside_tests():
        found = [edit for edit in _sys_path_edits(path) if "tests" in edit]
        found += sorted(name for name in _imported_modules(path) if name == "runpy" or name.startswith("runpy."))
        if found:
            offenders[str(path.relative_to(ROOT))] = found
    assert offenders == {}


def test_no_test_module_imports_another():
    test_modules = {p.stem for p in (ROOT / "tests").glob("test_*.py")} | {
        p.stem for p in (ROOT / "studies").rglob("test_*.py")
    }
    offenders = {}
    for path in [*_python_files("tests"), *_outside_tests()]:
        imported = {
            name.split(".")[-1] for name in _imported_modules(path) if name.split(".")[0] in ("tests", "studies")
        }
        imported |= {name.split(".")[0] for name in _imported_modules(path)}
        if imported & test_modules:
            offenders[str(path.relative_to(ROOT))] = sorted(imported & test_modules)
    assert offenders == {}


# --- the walkers see what they look for ---------------------------------------------------------------------------


def test_the_walker_sees_an_upward_import(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text(
        "import os\nfrom bench.kernels import KERNELS\nimport importlib\nimportlib.import_module('aiter_fused.ops')\n"
    )
    assert {"bench", "aiter_fused"} <= {name.split(".")[0] for name in _imported_modules(bad, tmp_path)}


def test_the_walker_resolves_relative_and_from_imports(tmp_path):
    """`from ..interface import x` in fa4_rowmax/stage/m.py is fa4_rowmax.interface, a floor above the stage's."""
    stage = tmp_path / "fa4_rowmax" / "stage"
    stage.mkdir(parents=True)
    bad = stage / "m.py"
    bad.write_text("from ..interface import rowmax_attn_func\nfrom fa4_rowmax import testing\n")
    assert {"fa4_rowmax.interface", "fa4_rowmax.testing"} <= _imported_modules(bad, tmp_path)
    assert FA4_ROWMAX_FLOORS["interface"] > FA4_ROWMAX_FLOORS["stage"] < FA4_ROWMAX_FLOORS["testing"]


def test_the_walker_sees_tests_on_the_path_and_runpy(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text(
        "import runpy, sys\nfrom pathlib import Path\nROOT = Path(__file__).parent\n"
        "sys.path.insert(0, str(ROOT / 'tests'))\nsys.path[:0] = [str(ROOT / 'tests')]\n"
        "runpy.run_path('x.py')\n"
    )
    assert len([edit for edit in _sys_path_edits(bad) if "tests" in edit]) == 2
    assert "runpy" in _imported_modules(bad, tmp_path)
    script = tmp_path / "s.py"
    script.write_text("import sys\nsys.path.append(str(ROOT / 'scripts'))\n")
    assert [_puts_scripts_on_the_path(script, edit) for edit in _sys_path_edits(script)] == [True]
