"""Note [Compiled kernels on disk] (fa4_rowmax/fp8_sm90.py) without a GPU: the SM90 FP8 forward compiled for sm_90a
in FakeTensorMode, kept on disk by one process and loaded by the next, and never reused for other sources."""

import os
import subprocess
import sys
from pathlib import Path

from fa4_rowmax.source_digest import source_digest
from fa4_rowmax.testing import compile_check

ROOT = Path(__file__).resolve().parents[1]

# argv[1]: "compile" (compile what is missing), "load" (a compile fails the call), or "other-sources" (the package
# digest differs and a compile fails the call). Prints the objects on disk after the call.
_WORKER = r"""
import sys
from pathlib import Path
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
import fa4_rowmax.fp8_sm90 as fp8_sm90
if sys.argv[1] != "compile":
    def refuse(*args):
        raise RuntimeError("compiled")
    fp8_sm90._compile = refuse
if sys.argv[1] == "other-sources":
    fp8_sm90.package_digest = lambda: "0" * 64
with FakeTensorMode():
    q = torch.empty(1, 256, 2, 128, dtype=torch.float8_e4m3fn, device="cuda")
    try:
        fp8_sm90.flash_attn_fp8_sm90(q, q, q, causal=True)
        print("call: ok")
    except RuntimeError as e:
        print(f"call: {e}")
print("objects:", len(list(Path(sys.argv[2]).rglob("*.o"))))
"""


def _run(mode: str, cache: Path) -> list[str]:
    env = dict(os.environ, **compile_check.ARCH_ENV["sm90"], LOWPREC_FP8_COMPILE_CACHE=str(cache))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", _WORKER, mode, str(cache)], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-2:]


def test_a_compiled_kernel_is_loaded_by_the_next_process_and_only_for_the_same_sources(tmp_path):
    """The first process compiles and exports one object; the second loads it (its compile would fail the call);
    with another package digest the same config is a miss (the compile is asked for, and fails the call)."""
    cache = tmp_path / "kernels"
    assert _run("compile", cache) == ["call: ok", "objects: 1"]
    assert _run("load", cache) == ["call: ok", "objects: 1"]
    assert _run("other-sources", cache) == ["call: compiled", "objects: 1"]


def test_the_source_digest_follows_every_file_and_its_path(tmp_path):
    """fa4_rowmax.source_digest: a byte changed, a file renamed or added changes the digest; files of other suffixes
    and caches do not."""
    (tmp_path / "pkg" / "__pycache__").mkdir(parents=True)
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    digest = lambda: source_digest(str(tmp_path), ("pkg",), (".py",))  # noqa: E731
    first = digest()
    (tmp_path / "pkg" / "notes.md").write_text("not code")
    (tmp_path / "pkg" / "__pycache__" / "a.py").write_text("cached")
    assert digest() == first
    (tmp_path / "pkg" / "a.py").write_text("x = 2\n")
    assert digest() != first
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    assert digest() == first
    (tmp_path / "pkg" / "a.py").rename(tmp_path / "pkg" / "b.py")
    assert digest() != first
