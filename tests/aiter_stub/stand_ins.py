"""Import the real, installed AITER package on a machine without ROCm, through the stand-ins next to
this file (documented in README.md). Tests only.

`python tests/aiter_stub/stand_ins.py` imports AITER this way in a fresh JIT folder and prints what it
found: the check `scripts/install_aiter_ci.sh` runs after installing amd-aiter.
"""

import os
import pathlib
import shutil
import sys
import tempfile

STUB_DIR = pathlib.Path(__file__).resolve().parent
HIPCONFIG_DIR = STUB_DIR / "bin"
ENUM_MODULE = STUB_DIR / "module_aiter_enum.py"
# Any architecture AITER accepts; it only selects kernel tables, and no kernel of AITER's runs here.
GPU_ARCH = "gfx950"


def import_real_aiter(jit_dir: pathlib.Path):
    """Import `aiter` with the stand-ins in place and return it (once per process).

    `jit_dir` becomes AITER_JIT_DIR and must be fresh for each process: AITER keeps build locks there,
    and one left behind by a killed run blocks the next. AITER_JIT_DIR and GPU_ARCHS stay set for the
    rest of the process (AITER reads them after import); the stand-in `hipconfig` is on PATH only while
    importing (AITER asks it for the ROCm version at import).
    """
    if "aiter" in sys.modules:
        return sys.modules["aiter"]
    jit_dir = pathlib.Path(jit_dir)
    jit_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy(ENUM_MODULE, jit_dir / ENUM_MODULE.name)
    os.environ["AITER_JIT_DIR"] = str(jit_dir)
    os.environ["GPU_ARCHS"] = GPU_ARCH
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = f"{HIPCONFIG_DIR}{os.pathsep}{path}"
    try:
        import aiter
    finally:
        os.environ["PATH"] = path
    return aiter


def _check() -> None:
    from importlib.metadata import version

    import torch

    with tempfile.TemporaryDirectory(prefix="aiter_jit_") as jit_dir:
        aiter = import_real_aiter(pathlib.Path(jit_dir))
        import aiter.ops.mha as mha

    ops = [name for name in ("mha_fwd", "fmha_v3_fwd", "mha_varlen_fwd", "fmha_v3_varlen_fwd")
           if hasattr(torch.ops.aiter, name)]
    print(f"amd-aiter {version('amd-aiter')} imports through the stand-ins: "
          f"flash_attn_func={aiter.flash_attn_func.__module__}, "
          f"_flash_attn_forward={callable(getattr(mha, '_flash_attn_forward', None))}, torch.ops.aiter: {ops}")


if __name__ == "__main__":
    _check()
