"""SHA-256 over source files, read from the files themselves (not from git, which can lag the files on a device copy).

`bench.env_info` names the code behind a measurement with it (Note [Code digest] there); `fa4_rowmax.fp8_sm90` keys
its compiled kernels by the package's digest, so that a kernel compiled from other sources is never reused (Note
[Compiled kernels on disk] there).
"""

import hashlib
import os


def source_digest(root: str, dirs: tuple[str, ...], suffixes: tuple[str, ...]) -> str:
    """SHA-256 (hex) of every file under `root`/`dirs` whose name ends in one of `suffixes` (caches and dot-folders
    left out): each file's path relative to `root` and its bytes, by path in sorted order."""
    paths = []
    for top in dirs:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
            dirnames[:] = [d for d in dirnames if d != "__pycache__" and not d.startswith(".")]
            paths += [os.path.join(dirpath, f) for f in filenames if f.endswith(suffixes)]
    digest = hashlib.sha256()
    for rel in sorted(os.path.relpath(p, root).replace(os.sep, "/") for p in paths):
        with open(os.path.join(root, rel), "rb") as f:
            data = f.read()
        digest.update(f"{rel}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()
