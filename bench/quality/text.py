"""The texts the quality study measures on, and the token blocks cut from it.

Two texts (`--text`), each fetched into an ignored cache folder; nothing here downloads:
- `python-doc` (the default): the reStructuredText source of the Python 3.11 documentation (tutorial,
  howto, faq, reference: 57 files) from Debian's `python3.11-doc`, by `scripts/fetch_quality_text.sh`.
- `austen`: Jane Austen's six novels from Debian's `r-cran-janeaustenr`, extracted and joined by
  `assets.py` (`bash scripts/fetch_quality_models.sh --text`) into one `austen.txt`: real
  prose, closer to the paper's WikiText than documentation.

Note [Pinning the text]
The Debian revision of the package changes over time and the mirror only keeps the newest, so the text is
pinned by the SHA-256 of the joined text, not by the package version. A different hash means the numbers
are not comparable with earlier results: `load_text` refuses it unless the caller allows it explicitly, and
the results always carry the hash, the package revision and the file list.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from bench.quality import assets

DEFAULT_TEXT_DIR = Path(__file__).resolve().parents[2] / ".cache" / "quality_text"
# SHA-256 of the joined text of python3.11-doc 3.11.2-6+deb12u8 (see Note [Pinning the text]).
PINNED_TEXT_SHA256 = "8b10d7781bae2c1b161d423a28696bc2c02d4bc131899c12cb95a2eb5eed579c"
FETCH_HINT = "bash scripts/fetch_quality_text.sh"

TEXTS = ("python-doc", "austen")
DEFAULT_TEXT = "python-doc"
AUSTEN_TEXT_DIR = assets.DEFAULT_CACHE / assets.AUSTEN_DIR
AUSTEN_FETCH_HINT = "bash scripts/fetch_quality_models.sh --text"


def default_text_dir(name: str) -> Path:
    return {"python-doc": DEFAULT_TEXT_DIR, "austen": AUSTEN_TEXT_DIR}[name]


@dataclass(frozen=True)
class QualityText:
    text: str
    sha256: str
    source: str  # package and revision, as written by the fetch script
    files: tuple[str, ...]  # paths relative to the text folder, in join order


def load_text(
    text_dir: Path | str | None = None, *, allow_text_change: bool = False, name: str = DEFAULT_TEXT
) -> QualityText:
    """The text `name` from `text_dir` (default: its cache folder), its SHA-256 checked against the pin.

    python-doc: the documentation files joined (sorted by path, separated by a blank line); austen: the one
    `austen.txt` that `assets.py` wrote (already joined)."""
    if name not in TEXTS:
        raise ValueError(f"text must be one of {TEXTS}, got {name!r}")
    text_dir = Path(text_dir) if text_dir is not None else default_text_dir(name)
    if name == "austen":
        return _load_austen(text_dir, allow_text_change)
    source_file = text_dir / "SOURCE"
    if not source_file.is_file():
        raise assets.MissingAsset(f"text_dir={str(text_dir)!r} holds no fetched text; run `{FETCH_HINT}` first")
    paths = sorted(text_dir.rglob("*.rst.txt"))
    if not paths:
        raise assets.MissingAsset(f"text_dir={str(text_dir)!r} has no *.rst.txt files; run `{FETCH_HINT}` again")
    text = "\n\n".join(p.read_text(encoding="utf-8") for p in paths)
    sha256 = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if sha256 != PINNED_TEXT_SHA256 and not allow_text_change:
        raise assets.AssetMismatch(
            f"text_dir={str(text_dir)!r}: the joined text has SHA-256 {sha256}, not the pinned "
            f"{PINNED_TEXT_SHA256} (source: {source_file.read_text().strip()}); results would not be comparable. "
            "Pass allow_text_change=True (--allow-text-change) to measure it anyway; the hash is recorded."
        )
    return QualityText(
        text=text,
        sha256=sha256,
        source=source_file.read_text().strip(),
        files=tuple(str(p.relative_to(text_dir)) for p in paths),
    )


def _load_austen(text_dir: Path, allow_text_change: bool) -> QualityText:
    path, source_file = text_dir / assets.AUSTEN_FILE, text_dir / "SOURCE"
    if not (path.is_file() and source_file.is_file()):
        raise assets.MissingAsset(
            f"text_dir={str(text_dir)!r} holds no extracted Austen text; run `{AUSTEN_FETCH_HINT}`"
        )
    text = path.read_text(encoding="utf-8")
    sha256 = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if sha256 != assets.AUSTEN_TEXT_SHA256 and not allow_text_change:
        raise assets.AssetMismatch(
            f"text_dir={str(text_dir)!r}: {path.name} has SHA-256 {sha256}, not the pinned "
            f"{assets.AUSTEN_TEXT_SHA256}; results would not be comparable. Pass allow_text_change=True "
            "(--allow-text-change) to measure it anyway; the hash is recorded."
        )
    return QualityText(text=text, sha256=sha256, source=source_file.read_text().strip(), files=(path.name,))


def cut_blocks(token_ids: torch.Tensor, block_size: int, num_blocks: int) -> tuple[torch.Tensor, list[int]]:
    """Cut `num_blocks` non-overlapping blocks of `block_size` tokens, spread evenly over the whole text.

    Even spacing (rather than the first N blocks) makes a short run sample every part of the documentation.
    Returns the blocks (num_blocks, block_size) and the index of each block among all full blocks.
    """
    if token_ids.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
    if block_size < 2:
        raise ValueError(f"block_size must be >= 2, got {block_size}")
    available = token_ids.numel() // block_size
    if not 1 <= num_blocks <= available:
        raise ValueError(f"num_blocks must be in [1, {available}] for block_size={block_size}, got {num_blocks}")
    if num_blocks == 1:
        indices = [0]
    else:
        indices = [round(i * (available - 1) / (num_blocks - 1)) for i in range(num_blocks)]
    blocks = torch.stack([token_ids[i * block_size : (i + 1) * block_size] for i in indices])
    return blocks, indices
