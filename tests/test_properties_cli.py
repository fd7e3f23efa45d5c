"""Properties of the command lines' usage errors: `python -m fa4_rowmax` (the gates), `python -m bench.quality`,
`python -m fa4_rowmax.patching`, run in-process through their `main` / `parse_args` (a usage error is decided
before any work, so no gate or model runs here).

Exit codes mean what each tool's docs say: 2 for a usage error (a bad option value, an unknown option, an output
path that cannot be written), decided before any work, with a message that names the option; 0 for --help.
Budgets: Note [Hypothesis profiles] in tests/conftest.py.
"""

import contextlib
import io
import os
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from property_helpers import examples

from bench.quality import cli as quality_cli
from fa4_rowmax import __main__ as gates_cli
from fa4_rowmax import patching as fa4_patch


def _exit_code(call):
    """(exit code, stderr) of `call()`, which returns an int or raises SystemExit."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = call()
        except SystemExit as stop:
            code = stop.code
    return code, err.getvalue()


def _unwritable_json_paths():
    """Paths the gates' --json cannot be written to: under a missing folder, a folder itself, under a file."""
    scratch = Path(tempfile.mkdtemp(prefix="cli_props_"))
    a_file = scratch / "file.json"
    a_file.write_text("{}")
    return [str(scratch / "missing" / "g.json"), str(scratch), str(a_file / "g.json")]


JSON_PATHS = _unwritable_json_paths()
GATES_USAGE_ERRORS = (
    [["--json", path] for path in JSON_PATHS]
    + [["--device", device] for device in ("gpu", "CUDA", "", "cuda:0")]
    + [["--seeds", seed] for seed in ("one", "1.5", "")]
    + [["--bogus"], ["--verbose=yes"]]
    + ([["--device", "cuda"]] if not torch.cuda.is_available() else [])
)


@examples(12)
@given(argv=st.sampled_from(GATES_USAGE_ERRORS), extra=st.sampled_from(([], ["--verbose"], ["--reference-only"])))
def test_gates_cli_usage_errors_exit_2_before_any_gate(argv, extra):
    code, err = _exit_code(lambda: gates_cli.main(extra + argv))
    assert code == 2, (code, err)
    option = argv[0].split("=")[0]
    assert option in err, err


def test_gates_cli_help_exits_0_and_documents_the_exit_codes():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        with pytest.raises(SystemExit) as stop:
            gates_cli.main(["--help"])
    assert stop.value.code == 0
    assert all(f"  {code}  " in out.getvalue() for code in "0123")


bad_counts = st.one_of(
    st.integers(-(10**6), 0).map(str),
    st.sampled_from(("", "x", "1.5", "1e3", "0x10", "--", "nan")),
)


@examples(30)
@given(option=st.sampled_from(("--blocks", "--block-size")), value=bad_counts)
def test_quality_cli_refuses_a_bad_count_in_one_line(option, value):
    """--blocks >= 1, --block-size >= 2 (its docs); 0 is not "the default"."""
    if option == "--block-size" and value == "1":
        return
    code, err = _exit_code(lambda: quality_cli.parse_args([f"{option}={value}"]))
    assert code == 2 and err.count("\n") == 1 and option in err, (code, err)


@pytest.mark.parametrize("option", ["--blocks", "--block-size", "--time-budget-s", "--baps-lengths", "--out"])
def test_quality_cli_refuses_a_double_dash_value_in_one_line(option):
    """argparse drops a '--' given as `--option=--` and stores [] without calling the option's type."""
    code, err = _exit_code(lambda: quality_cli.parse_args([f"{option}=--"]))
    assert code == 2 and err.count("\n") == 1 and option in err, (code, err)


def test_quality_cli_without_cuda_refuses_device_cuda_in_one_line(monkeypatch):
    """Decided before any loading: exit 2 with one line naming --device and what this machine accepts."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, err = _exit_code(lambda: quality_cli.main(["--device", "cuda", "--blocks", "1"]))
    assert code == 2 and err.count("\n") == 1 and "--device" in err and "cpu" in err.split("accepted")[-1], (code, err)


@examples(20)
@given(option=st.sampled_from(("--blocks", "--block-size")), value=st.integers(2, 10**6))
def test_quality_cli_takes_a_good_count_as_given(option, value):
    args = quality_cli.parse_args([option, str(value)])
    assert getattr(args, option.lstrip("-").replace("-", "_")) == value


@examples(10)
@given(command=st.sampled_from(("status", "apply", "revert", "check")), missing=st.text("abc", min_size=1, max_size=5))
def test_patch_tool_on_a_missing_site_exits_2_in_one_line(command, missing):
    site = Path(tempfile.gettempdir()) / f"no_such_site_{missing}_{os.getpid()}"
    code, err = _exit_code(lambda: fa4_patch.main([command, "--site", str(site)]))
    assert code == 2 and err.startswith("fa4_patch: error: ") and err.count("\n") == 1, (code, err)


@pytest.mark.parametrize("argv", [["frobnicate"], [], ["apply", "--state", "half"], ["copy"]], ids=str)
def test_patch_tool_bad_usage_exits_2(argv):
    code, err = _exit_code(lambda: fa4_patch.main(argv))
    assert code == 2 and "error" in err, (code, err)
