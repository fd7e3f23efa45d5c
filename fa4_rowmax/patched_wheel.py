"""Build flash_attn_4-4.0.0b36+rowmax-*.whl: the pinned FA4 wheel with this project's patches.

    python scripts/build_fa4_wheel.py --out dist/                       # downloads the pinned wheel with pip
    python scripts/build_fa4_wheel.py --wheel flash_attn_4-4.0.0b36-py3-none-any.whl --out dist/

The `wheel` package does the packaging (`wheel unpack`, `wheel pack`, which rewrites RECORD with fresh
hashes and sizes); this module only applies the patches (fa4_rowmax/patching.py, version-checked) and sets
the local version label `+rowmax` in the dist-info directory and METADATA. The patched FA4 imports
`fa4_rowmax` (this project) only when a non-stock softmax_mode or knob is passed.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from fa4_rowmax import patching as fa4_patch

LOCAL_LABEL = "rowmax"


def download_pinned(dest: Path) -> Path:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            str(dest),
            f"flash-attn-4=={fa4_patch.PINNED_VERSION}",
        ],
        check=True,
    )
    wheels = sorted(dest.glob(f"{fa4_patch.DIST_NAME}-{fa4_patch.PINNED_VERSION}-*.whl"))
    if not wheels:
        raise fa4_patch.PatchError(
            f"pip download left no {fa4_patch.DIST_NAME}-{fa4_patch.PINNED_VERSION} wheel in {dest}"
        )
    return wheels[0]


def build(wheel: Path, out: Path) -> Path:
    """Unpack `wheel`, patch it, relabel it `+rowmax`, pack it into `out`; returns the new wheel."""
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "wheel", "unpack", "--dest", tmp, str(wheel)], check=True)
        (root,) = Path(tmp).iterdir()
        fa4_patch.apply(root, dry_run=True)
        fa4_patch.apply(root)
        if fa4_patch.status(root) != "patched":
            raise fa4_patch.PatchError(f"{root} is not fully patched")
        (info,) = root.glob(f"{fa4_patch.DIST_NAME}-*.dist-info")
        version = f"{fa4_patch.PINNED_VERSION}+{LOCAL_LABEL}"
        metadata = info / "METADATA"
        metadata.write_text(
            metadata.read_text().replace(f"Version: {fa4_patch.PINNED_VERSION}\n", f"Version: {version}\n", 1)
        )
        info.rename(root / f"{fa4_patch.DIST_NAME}-{version}.dist-info")
        (info.parent / f"{fa4_patch.DIST_NAME}-{version}.dist-info" / "RECORD").unlink()  # `wheel pack` rewrites it
        before = set(out.glob("*.whl"))
        subprocess.run([sys.executable, "-m", "wheel", "pack", "--dest-dir", str(out), str(root)], check=True)
    built = sorted(
        set(out.glob(f"{fa4_patch.DIST_NAME}-{fa4_patch.PINNED_VERSION}+{LOCAL_LABEL}-*.whl")) - before
    ) or sorted(out.glob(f"{fa4_patch.DIST_NAME}-{fa4_patch.PINNED_VERSION}+{LOCAL_LABEL}-*.whl"))
    return built[-1]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheel", type=Path, help="the pinned flash_attn_4-4.0.0b36 wheel (default: pip download)")
    parser.add_argument("--out", type=Path, default=Path("dist"))
    args = parser.parse_args(argv)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            wheel = args.wheel or download_pinned(Path(tmp))
            print(build(wheel, args.out))
    except (fa4_patch.PatchError, subprocess.CalledProcessError) as err:
        print(f"build_fa4_wheel: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
