#!/usr/bin/env python3
"""Apply, revert or check this project's patches (patches/*.diff) on an installed FlashAttention-4.

    python -m fa4_rowmax.patching status            # stock / patched, and the FA4 version
    python -m fa4_rowmax.patching apply [--dry-run] # idempotent: patches that are already in are skipped
    python -m fa4_rowmax.patching revert [--dry-run]
    python -m fa4_rowmax.patching check             # exit 0 only if every patch is applied
    python -m fa4_rowmax.patching copy DEST [--state stock|patched]   # a private copy to put on sys.path

`--site DIR` picks the directory that holds `flash_attn/` (default: where `import flash_attn` finds it,
located without importing it). The patches are unified diffs against the pinned flash-attn-4 4.0.0b36;
another version is refused, and so is a site with two flash-attn-4 dist-info directories (which one is
installed is then undefined). Every file is checked before any is written (a dry run of the whole set),
and the new files are all written beside the old ones before any is renamed into place, so a failed apply
or revert (an edited file, a full disk) leaves the install untouched. Pure Python: no `patch` binary needed.

Exit status: 0 done (`check`: every patch applied); 1 `check` only: not every patch applied; 2 error (a
wrong version, an unrecognised or missing file, a failed write; the install is unchanged) or bad usage.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

PINNED_VERSION = "4.0.0b36"
DIST_NAME = "flash_attn_4"
PATCH_DIR = Path(__file__).resolve().parent.parent / "patches"

_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")


class PatchError(RuntimeError):
    """A patch does not fit the installed files (wrong version, or edited by hand)."""


@dataclass
class Hunk:
    old_start: int  # 1-based, in the stock file
    new_start: int  # 1-based, in the patched file
    old_lines: list[str]
    new_lines: list[str]


@dataclass
class FilePatch:
    path: str  # relative to the site directory, e.g. flash_attn/cute/interface.py
    hunks: list[Hunk]
    source: str  # the .diff it came from


def parse_patch(text: str, source: str = "<patch>") -> list[FilePatch]:
    """Parse a unified diff (text before the first `---` line is a description and is skipped)."""
    files: list[FilePatch] = []
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        if lines[i].startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            path = lines[i + 1][4:].strip().split("\t")[0]
            path = path[2:] if path.startswith("b/") else path
            current = FilePatch(path, [], source)
            files.append(current)
            i += 2
            continue
        match = _HUNK_HEADER.match(lines[i])
        if match:
            if not files:
                raise PatchError(f"{source}: hunk before any file header")
            n_old = int(match.group(2) or 1)
            n_new = int(match.group(4) or 1)
            hunk = Hunk(int(match.group(1)), int(match.group(3)), [], [])
            i += 1
            while (n_old > 0 or n_new > 0) and i < len(lines):
                line = lines[i]
                tag, body = line[:1], line[1:]
                if tag == "\\":  # "\ No newline at end of file"
                    i += 1
                    continue
                if tag in (" ", "\n"):
                    body = body if tag == " " else "\n"
                    hunk.old_lines.append(body)
                    hunk.new_lines.append(body)
                    n_old, n_new = n_old - 1, n_new - 1
                elif tag == "-":
                    hunk.old_lines.append(body)
                    n_old -= 1
                elif tag == "+":
                    hunk.new_lines.append(body)
                    n_new -= 1
                else:
                    raise PatchError(f"{source}: bad hunk line {line!r}")
                i += 1
            if n_old or n_new:
                raise PatchError(f"{source}: truncated hunk at line {match.group(0)}")
            files[-1].hunks.append(hunk)
            continue
        i += 1
    if not files:
        raise PatchError(f"{source}: no file patches found")
    return files


def _apply_hunks(text: str, hunks: list[Hunk], *, reverse: bool, where: str) -> str:
    """Apply hunks exactly at their stated lines (no fuzz, no search); raise PatchError on a mismatch."""
    lines = text.splitlines(keepends=True)
    offset = 0
    for hunk in hunks:
        old, new = (hunk.new_lines, hunk.old_lines) if reverse else (hunk.old_lines, hunk.new_lines)
        # Hunks come in file order; `offset` is the net line count the earlier ones already changed.
        start = (hunk.new_start if reverse else hunk.old_start) - 1 + offset
        if lines[start : start + len(old)] != old:
            raise PatchError(f"{where}: hunk at line {hunk.old_start} does not match")
        lines[start : start + len(old)] = new
        offset += len(new) - len(old)
    return "".join(lines)


def load_patches(patch_dir: Path = PATCH_DIR) -> list[FilePatch]:
    patches: list[FilePatch] = []
    for diff in sorted(patch_dir.glob("*.diff")):
        patches += parse_patch(diff.read_text(), diff.name)
    if not patches:
        raise PatchError(f"no patches in {patch_dir}")
    return patches


def default_site() -> Path:
    """The directory holding the importable `flash_attn` package (found without importing it)."""
    spec = importlib.util.find_spec("flash_attn")
    if spec is None or not spec.submodule_search_locations:
        raise PatchError("flash_attn is not installed: pip install 'flash-attn-4==4.0.0b36'")
    return Path(list(spec.submodule_search_locations)[0]).parent


def installed_version(site: Path) -> str:
    """Version of flash-attn-4 from its dist-info in `site` (local label such as +rowmax dropped)."""
    dists = [
        d
        for d in importlib.metadata.distributions(path=[str(site)])
        if re.sub(r"[-_.]+", "_", d.metadata["Name"] or "").lower() == DIST_NAME
    ]
    if not dists:
        raise PatchError(f"no {DIST_NAME}-*.dist-info in {site}: is flash-attn-4 installed there?")
    if len(dists) > 1:
        # pip would report whichever it finds first: neither version can be trusted to be the installed one.
        found = ", ".join(sorted(f"{d.metadata['Name']} {d.version}" for d in dists))
        raise PatchError(
            f"{len(dists)} flash-attn-4 dist-info directories in {site} ({found}); remove the stale one or "
            f"reinstall: pip install --force-reinstall --no-deps 'flash-attn-4=={PINNED_VERSION}'"
        )
    return dists[0].version.split("+")[0]


def check_version(site: Path) -> None:
    version = installed_version(site)
    if version != PINNED_VERSION:
        raise PatchError(
            f"flash-attn-4 {version} is installed in {site}; the patches are for {PINNED_VERSION} only. "
            f"Install it with: pip install 'flash-attn-4=={PINNED_VERSION}'"
        )


def file_states(site: Path, patches: list[FilePatch]) -> dict[str, str]:
    """'stock', 'patched' or 'unknown' for every patched file."""
    states = {}
    for fp in patches:
        if not (site / fp.path).is_file():
            raise PatchError(
                f"{fp.path} is missing from {site}; "
                f"reinstall: pip install --force-reinstall --no-deps 'flash-attn-4=={PINNED_VERSION}'"
            )
        text = (site / fp.path).read_text()
        try:
            _apply_hunks(text, fp.hunks, reverse=False, where=fp.path)
            states[fp.path] = "stock"
            continue
        except PatchError:
            pass
        try:
            _apply_hunks(text, fp.hunks, reverse=True, where=fp.path)
            states[fp.path] = "patched"
        except PatchError:
            states[fp.path] = "unknown"
    return states


def status(site: Path, patches: list[FilePatch] | None = None) -> str:
    """'stock', 'patched' or 'mixed'; raises PatchError on a wrong version or an unrecognised file."""
    patches = patches if patches is not None else load_patches()
    check_version(site)
    states = file_states(site, patches)
    unknown = [p for p, s in states.items() if s == "unknown"]
    if unknown:
        raise PatchError(
            f"{', '.join(unknown)} in {site} match neither stock {PINNED_VERSION} nor the patched form; "
            f"reinstall: pip install --force-reinstall --no-deps 'flash-attn-4=={PINNED_VERSION}'"
        )
    values = set(states.values())
    return values.pop() if len(values) == 1 else "mixed"


def _transform(site: Path, patches: list[FilePatch], *, reverse: bool, dry_run: bool) -> list[str]:
    """Apply (or revert) every patch not yet in the wanted state. Returns the files changed."""
    check_version(site)
    states = file_states(site, patches)
    todo_state = "patched" if reverse else "stock"
    new_texts: dict[Path, str] = {}
    for fp in patches:
        state = states[fp.path]
        if state == "unknown":
            raise PatchError(f"{fp.path} in {site} matches neither stock nor patched ({fp.source})")
        if state != todo_state:
            continue
        target = site / fp.path
        base = new_texts.get(target, target.read_text())
        new_texts[target] = _apply_hunks(base, fp.hunks, reverse=reverse, where=f"{fp.source}: {fp.path}")
    if not dry_run:
        _replace_all(new_texts)
    return [str(t.relative_to(site)) for t in new_texts]


def _replace_all(new_texts: dict[Path, str]) -> None:
    """Give every file its new text, or (on any failure) leave every file as it was and no temporary behind.

    Writing needs disk space, renaming does not: first every new text is written beside its file, then each
    is renamed over its file, atomically, so no file is ever missing or half written. Nothing is left to do
    after the last rename (no backup to remove), so a success is complete. A failure renames the files
    already replaced back to their old text, written and renamed the same way: on a full disk the failure
    comes in the first phase, before any file was replaced, so the way back needs no space.
    """
    old_texts = {target: target.read_text() for target in new_texts}
    staged = {target: target.with_name(target.name + ".fa4_patch.new") for target in new_texts}
    replaced: list[Path] = []
    try:
        for target, text in new_texts.items():
            staged[target].write_text(text)
            shutil.copymode(target, staged[target])
        for target in new_texts:
            os.replace(staged[target], target)
            replaced.append(target)
    except BaseException:
        for target in reversed(replaced):
            staged[target].write_text(old_texts[target])
            shutil.copymode(target, staged[target])
            os.replace(staged[target], target)
        for path in staged.values():
            path.unlink(missing_ok=True)
        raise


def apply(site: Path, *, dry_run: bool = False, patches: list[FilePatch] | None = None) -> list[str]:
    return _transform(site, patches if patches is not None else load_patches(), reverse=False, dry_run=dry_run)


def revert(site: Path, *, dry_run: bool = False, patches: list[FilePatch] | None = None) -> list[str]:
    return _transform(site, patches if patches is not None else load_patches(), reverse=True, dry_run=dry_run)


def copy_package(site: Path, dest: Path, *, state: str = "patched") -> Path:
    """Copy `flash_attn/` and its dist-info from `site` to `dest`, then bring the copy to `state`.

    Put `dest` first on sys.path (PYTHONPATH) to import the copy instead of the installed package.
    """
    if state not in ("stock", "patched"):
        raise ValueError(f"state must be 'stock' or 'patched'; got {state!r}")
    dest.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(site / "flash_attn", dest / "flash_attn", ignore=ignore, dirs_exist_ok=True)
    for info in site.glob(f"{DIST_NAME}-*.dist-info"):
        shutil.copytree(info, dest / info.name, dirs_exist_ok=True)
    (apply if state == "patched" else revert)(dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["status", "apply", "revert", "check", "copy"])
    parser.add_argument("dest", nargs="?", type=Path, help="copy: destination directory")
    parser.add_argument("--site", type=Path, default=None, help="directory holding flash_attn/")
    parser.add_argument("--dry-run", action="store_true", help="check that every hunk fits; write nothing")
    parser.add_argument("--state", default="patched", choices=["stock", "patched"], help="copy: state of the copy")
    args = parser.parse_args(argv)
    try:
        site = args.site if args.site is not None else default_site()
        if args.command == "status":
            print(f"flash-attn-4 {installed_version(site)} in {site}: {status(site)}")
        elif args.command == "check":
            state = status(site)
            print(f"flash-attn-4 in {site}: {state}")
            return 0 if state == "patched" else 1
        elif args.command in ("apply", "revert"):
            fn = apply if args.command == "apply" else revert
            fn(site, dry_run=True)  # every hunk must fit before anything is written
            changed = fn(site, dry_run=args.dry_run)
            verb = "would change" if args.dry_run else "changed"
            print(
                f"{args.command}: {verb} {len(changed)} file(s) in {site}"
                + "".join(f"\n  {c}" for c in changed)
                + ("" if changed else f" (already {'patched' if args.command == 'apply' else 'stock'})")
            )
        else:
            if args.dest is None:
                parser.error("copy needs DEST")
            copy_package(site, args.dest, state=args.state)
            print(f"{args.state} copy of flash_attn in {args.dest} (put it first on PYTHONPATH)")
    except (PatchError, OSError) as err:
        print(f"fa4_patch: error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
