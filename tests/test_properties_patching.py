"""Properties of the FA4 patch tool (`fa4_rowmax.patching`) on scratch copies of the installed FA4 (never the
venv's), with one filesystem fault injected at a drawn point of an apply or a revert:

- no partial state: the command either succeeds (exit 0, every patched file in the target state, no temporary
  left) or fails with exit 2 and one line on stderr, every file byte-identical to before and the directory listing
  unchanged; the documented exit codes (module docstring) are the only ones;
- `check` exits 0 exactly when `status` says "patched", 1 otherwise.
Budgets: Note [Hypothesis profiles] in tests/conftest.py.
"""

import contextlib
import errno
import hashlib
import io
import os
import shutil
import tempfile
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import given
from hypothesis import strategies as st
from property_helpers import examples

from fa4_rowmax import patching as fa4_patch

PATCHED_FILES = sorted({p.path for p in fa4_patch.load_patches()})
# The filesystem operations the tool's writes go through, each a (target, attribute) to wrap.
OPERATIONS = {
    "write_text": (Path, "write_text"),
    "copymode": (shutil, "copymode"),
    "replace": (os, "replace"),
    "unlink": (Path, "unlink"),
}
ERRNOS = (errno.ENOSPC, errno.EIO, errno.EACCES)


def _digest(site: Path) -> dict:
    return {f: hashlib.sha256((site / f).read_bytes()).hexdigest() for f in PATCHED_FILES}


def _listing(site: Path) -> list:
    return sorted(str(p.relative_to(site)) for p in (site / "flash_attn").rglob("*"))


@pytest.fixture(scope="module")
def copies(tmp_path_factory):
    """A stock and a patched copy, and each state's digests."""
    stock = fa4_patch.copy_package(fa4_patch.default_site(), tmp_path_factory.mktemp("stock"), state="stock")
    patched = fa4_patch.copy_package(stock, tmp_path_factory.mktemp("patched"), state="patched")
    return dict(stock=stock, patched=patched, digests=dict(stock=_digest(stock), patched=_digest(patched)))


@contextlib.contextmanager
def _fault_at(operation: str, nth: int, code: int):
    """Raise OSError(code) at the nth call (0-based) of `operation`; returns a dict counting the calls."""
    owner, name = OPERATIONS[operation]
    real = getattr(owner, name)
    calls = {"n": 0, "hit": False}

    def faulty(*args, **kwargs):
        index = calls["n"]
        calls["n"] += 1
        if index == nth:
            calls["hit"] = True
            if operation == "write_text":  # the disk fills mid-file: half the text lands
                real(args[0], args[1][: len(args[1]) // 2])
            raise OSError(code, os.strerror(code))
        return real(*args, **kwargs)

    with mock.patch.object(owner, name, faulty):
        yield calls


def _run(command: str, site: Path):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = fa4_patch.main([command, "--site", str(site)])
    return code, err.getvalue()


@examples(30)
@given(
    command=st.sampled_from(("apply", "revert")),
    operation=st.sampled_from(sorted(OPERATIONS)),
    nth=st.integers(0, 6),
    code=st.sampled_from(ERRNOS),
)
def test_a_fault_leaves_the_old_state_or_the_new_one_never_a_mix(copies, command, operation, nth, code):
    start, target = ("stock", "patched") if command == "apply" else ("patched", "stock")
    with tempfile.TemporaryDirectory() as scratch:
        site = Path(scratch) / "site"
        shutil.copytree(copies[start], site)
        before, listing = _digest(site), _listing(site)
        with _fault_at(operation, nth, code) as calls:
            exit_code, err = _run(command, site)
        if exit_code == 0:
            assert not calls["hit"], f"a fault in {operation} was swallowed: exit 0"
            assert _digest(site) == copies["digests"][target]
            assert _listing(site) == listing, "a temporary file was left behind"
        else:
            assert exit_code == 2, exit_code
            assert err.startswith("fa4_patch: error: ") and err.count("\n") == 1, err
            assert _digest(site) == before, "a failed command changed files"
            assert _listing(site) == listing, "a failed command left files behind"
        assert fa4_patch.status(site) == (target if exit_code == 0 else start)


@examples(10)
@given(files=st.sets(st.sampled_from(PATCHED_FILES)))
def test_check_exits_0_exactly_when_every_file_is_patched(copies, files):
    """Any mix of stock and patched files (what a torn apply of an older tool left): `check` is 0 only when
    `status` is "patched"; `status` says "mixed" for a mix."""
    with tempfile.TemporaryDirectory() as scratch:
        site = Path(scratch) / "site"
        shutil.copytree(copies["stock"], site)
        for f in files:
            shutil.copyfile(copies["patched"] / f, site / f)
        state = fa4_patch.status(site)
        assert state == ("stock" if not files else "patched" if len(files) == len(PATCHED_FILES) else "mixed")
        code, _ = _run("check", site)
        assert code == (0 if state == "patched" else 1)
