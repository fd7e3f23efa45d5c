"""What the numbers were measured on: GPU, clocks, driver, library versions, date, settings."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shutil
import subprocess

import torch

from fa4_rowmax.source_digest import source_digest

PACKAGES = ("torch", "triton", "flash-attn-4", "nvidia-cutlass-dsl", "quack-kernels", "numpy")
# Fields every nvidia-smi of the last years knows (one unknown field fails the whole query).
SMI_FIELDS = (
    "name",
    "driver_version",
    "clocks.sm",
    "clocks.max.sm",
    "clocks.mem",
    "clocks.max.mem",
    "power.draw",
    "power.limit",
    "temperature.gpu",
    "pstate",
)
ENV_PREFIXES = ("FLASH_ATTENTION_", "CUTE_DSL_", "CUDA_VISIBLE_DEVICES", "TRITON_", "AITER_", "TORCH_CUDNN")
# Note [Code digest]
# ~~~~~~~~~~~~~~~~~~
# A device run gets a copy of the working tree whose git metadata can lag the files it holds (the H200's copies
# have named a commit several commits older than the tree that ran), so `git rev-parse HEAD` there does not say
# which code produced a figure. The digest does: SHA-256 over the code the measurements run (every .py, .diff and .sh
# under CODE_DIRS, by relative path in sorted order, each path and its bytes), read from the files themselves.
# `python -m bench.env_info` prints it for a checkout, so a results folder's digest can be matched to a commit
# (`git worktree add /tmp/c COMMIT && python -m bench.env_info /tmp/c`). Caches and results are not code.
CODE_DIRS = ("fa4_rowmax", "aiter_fused", "bench", "patches", "studies", "scripts")
CODE_SUFFIXES = (".py", ".diff", ".sh")


def package_versions() -> dict[str, str | None]:
    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def nvidia_smi(index: int = 0) -> dict[str, str] | str:
    """`nvidia-smi --query-gpu` fields for one GPU, or a sentence saying why there are none."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return "nvidia-smi not found"
    try:
        proc = subprocess.run(
            [exe, f"--id={index}", f"--query-gpu={','.join(SMI_FIELDS)}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"nvidia-smi failed: {exc}"
    if proc.returncode != 0:
        return f"nvidia-smi exit {proc.returncode}: {proc.stderr.strip()[:200]}"
    values = [v.strip() for v in proc.stdout.strip().split(",")]
    return dict(zip(SMI_FIELDS, values))


def gpu_properties() -> dict | str:
    if not torch.cuda.is_available():
        return "no CUDA device"
    device = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(device)
    return {
        "name": props.name,
        "capability": f"{props.major}.{props.minor}",
        "sm_count": props.multi_processor_count,
        "memory_bytes": props.total_memory,
        "l2_cache_bytes": getattr(props, "L2_cache_size", None),
        "device_index": device,
    }


def git_commit() -> str | None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        proc = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def code_digest(root: str | None = None) -> str:
    """Note [Code digest]: SHA-256 (hex) of the code under `root` (default: this checkout)."""
    root = root or os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return source_digest(root, CODE_DIRS, CODE_SUFFIXES)


def collect(settings: dict) -> dict:
    """Everything that identifies a run, JSON-serializable; `settings` are the benchmark's own."""
    return {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "gpu": gpu_properties(),
        "nvidia_smi": nvidia_smi(torch.cuda.current_device() if torch.cuda.is_available() else 0),
        "cuda_runtime": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "packages": package_versions(),
        "git_commit": git_commit(),
        "code_digest": code_digest(),
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)},
        "settings": settings,
    }


if __name__ == "__main__":
    import sys

    print(code_digest(sys.argv[1] if len(sys.argv) > 1 else None))
