"""python -m fa4_rowmax on the CPU: the reference passes, the exact control fails only the single-tile gate,
and a wrong backend turns the exit status non-zero. No time is asserted (its CPU seconds grew from ~11 to 63 when
CI shared the machine: speed lives in bench/); the subprocess timeout only stops a hang."""

import json
import os
import subprocess
import sys

import pytest
import torch

import fa4_rowmax.__main__ as main_job

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_main_job_on_cpu(tmp_path):
    json_path = tmp_path / "gates.json"
    completed = subprocess.run(
        [sys.executable, "-m", "fa4_rowmax", "--device", "cpu", "--json", str(json_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 0, completed.stdout[-4000:] + completed.stderr[-4000:]

    summary = json.loads(json_path.read_text())
    assert summary["device"] == "cpu"
    results = summary["results"]
    subjects = {r["subject"] for r in results}
    assert subjects == {
        "reference rowmax_h15 threshold 0",
        "reference rowmax_h15 threshold 8",
        "reference exact (control)",
    }
    assert all(r["as_expected"] for r in results)
    control_single = [r for r in results if r["subject"].startswith("reference exact") and r["gate"] == "single-tile"]
    assert control_single and all(not r["passed"] and not r["must_pass"] for r in control_single)
    control_multi = [r for r in results if r["subject"].startswith("reference exact") and r["gate"] == "multi-tile"]
    assert control_multi and all(r["passed"] for r in control_multi)
    h15 = [r for r in results if "rowmax_h15" in r["subject"]]
    assert h15 and all(r["passed"] and r["must_pass"] for r in h15)
    paper_gate = [r for r in results if "causal 512x512 b1 h1/1" in r["setup"] and r["gate"] == "multi-tile"]
    assert paper_gate and all(r["checks"][0]["n_elements"] == 131_328 for r in paper_gate)
    assert {r["setup"].split()[1] for r in results if r["gate"] == "multi-tile"} == {"causal", "non-causal"}

    # The short default: a header, one line per subject, the summary; the tables only with --verbose.
    lines = [line for line in completed.stdout.splitlines() if line.strip()]
    assert len(lines) == 2 + len(subjects), completed.stdout
    assert "FAIL (expected)" not in completed.stdout
    assert any(
        line.startswith("ok  reference exact (control), bfloat16 on cpu") and "as a control must" in line
        for line in lines
    )
    assert f"all {len(results)} gates gave what they must" in lines[-1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_cuda_without_a_gpu_is_refused():
    completed = subprocess.run(
        [sys.executable, "-m", "fa4_rowmax", "--device", "cuda"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert completed.returncode == 2
    assert "--device cuda" in completed.stderr


def test_wrong_backend_gives_exit_status_1(monkeypatch, tmp_path, capsys):
    # The exact reference labelled as Rowmax-H15: the single-tile gate fails where it must pass.
    exact_as_h15 = main_job.Subject("exact labelled as rowmax_h15", main_job._reference_backend("exact"), is_h15=True)
    monkeypatch.setattr(main_job, "_reference_subjects", lambda: [exact_as_h15])
    status = main_job.main(["--device", "cpu", "--seeds", "0", "--json", str(tmp_path / "g.json")])
    assert status == 1
    out = capsys.readouterr().out
    assert "UNEXPECTED: exact labelled as rowmax_h15 single-tile" in out
    assert "FAIL (UNEXPECTED)" in out  # a subject that went wrong shows its table without --verbose


def test_control_that_passes_single_tile_gives_exit_status_1(monkeypatch, capsys):
    # An H15 backend presented as the exact control: it passes the single-tile gate it must fail, which
    # would mean the gate cannot tell exact from H15.
    h15_as_control = main_job.Subject(
        "h15 labelled as the exact control", main_job._reference_backend("rowmax_h15"), is_h15=False
    )
    monkeypatch.setattr(main_job, "_reference_subjects", lambda: [h15_as_control])
    assert main_job.main(["--device", "cpu", "--seeds", "0"]) == 1
    assert "PASSED (must fail)" in capsys.readouterr().out


@pytest.mark.parametrize("reference_only, status", [(False, 3), (True, 0)])
def test_a_gpu_run_without_kernels_fails_unless_reference_only(monkeypatch, reference_only, status, capsys):
    # What a GPU machine without the patched FA4 sees (the device and the kernel loader are the stand-ins here;
    # the real GPU path runs on the H200).
    monkeypatch.setattr(main_job, "_resolve_device", lambda parser, device: "cuda")
    monkeypatch.setattr(main_job, "_reference_subjects", lambda: [])
    monkeypatch.setattr(main_job, "_kernel_subjects", lambda: ([], "RuntimeError: FA4 is not patched"))
    argv = ["--device", "cuda"] + (["--reference-only"] if reference_only else [])
    assert main_job.main(argv) == status
    out = capsys.readouterr().out
    assert ("--reference-only" in out) != reference_only


def test_the_main_job_runs_gates_then_no_benchmark_on_a_cpu(capsys):
    from bench import main_job as job

    assert job.main(["--device", "cpu", "--seeds", "0"]) == 0
    assert "benchmark: not run (no GPU in use)" in capsys.readouterr().out


def _one_control(monkeypatch):
    control = main_job.Subject("reference exact (control)", main_job._reference_backend("exact"), is_h15=False)
    monkeypatch.setattr(main_job, "_reference_subjects", lambda: [control])


@pytest.mark.parametrize("verbose", [False, True])
def test_verbose_prints_every_table(monkeypatch, capsys, verbose):
    _one_control(monkeypatch)
    assert main_job.main(["--device", "cpu", "--seeds", "0"] + (["--verbose"] if verbose else [])) == 0
    out = capsys.readouterr().out
    assert ("FAIL (expected)" in out) == verbose
    assert ("ok  reference exact (control)" in out) != verbose


# --- usage errors: exit 2 with one line, before any gate runs (issue 25 defect 6) --------------------------


def test_json_into_a_missing_directory_is_refused_before_any_gate(tmp_path):
    path = tmp_path / "missing" / "g.json"
    completed = subprocess.run(
        [sys.executable, "-m", "fa4_rowmax", "--device", "cpu", "--json", str(path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert completed.returncode == 2, completed.stderr[-2000:]
    assert completed.stdout == ""  # no gate ran: the header comes first when they do
    last = completed.stderr.strip().splitlines()[-1]
    assert last == f"python -m fa4_rowmax: error: --json {path}: directory {path.parent} does not exist"
    assert not path.parent.exists()


@pytest.mark.parametrize("where, why", [("dir", "is a directory"), ("under_a_file", "is not a directory")])
def test_json_paths_that_cannot_be_files_are_refused(tmp_path, capsys, where, why):
    (tmp_path / "a_file").write_text("")
    path = tmp_path if where == "dir" else tmp_path / "a_file" / "g.json"
    with pytest.raises(SystemExit) as exit_info:
        main_job.main(["--device", "cpu", "--json", str(path)])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == "" and why in captured.err.strip().splitlines()[-1]


def test_a_json_write_that_fails_at_the_end_leaves_nothing_and_exits_2(monkeypatch, tmp_path, capsys):
    _one_control(monkeypatch)

    def disk_full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(main_job.os, "replace", disk_full)
    status = main_job.main(["--device", "cpu", "--seeds", "0", "--json", str(tmp_path / "g.json")])
    assert status == 2
    assert list(tmp_path.iterdir()) == []  # neither the file nor its temporary
    assert "error: --json" in capsys.readouterr().err


def test_help_states_the_exit_codes(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main_job.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "exit status:" in out and all(f"\n  {code}  " in out for code in range(4))


# --- bench.main_job ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "option, path, prog",
    [
        ("--bench-out", "a_file/results", "python -m bench.main_job"),
        ("--json", "missing/g.json", "python -m fa4_rowmax"),
    ],
)
def test_the_main_job_checks_its_outputs_before_the_gates(tmp_path, capsys, option, path, prog):
    from bench import main_job as job

    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        job.main(["--device", "cpu", option, str(tmp_path / path)])
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # no gate ran
    assert captured.err.strip().splitlines()[-1].startswith(f"{prog}: error: {option} {tmp_path / path}: ")


def test_the_main_job_help_states_the_exit_codes(capsys):
    from bench import main_job as job

    with pytest.raises(SystemExit):
        job.main(["--help"])
    out = capsys.readouterr().out
    assert "exit status:" in out and all(f"\n  {code}  " in out for code in range(4))


def test_the_fp8_rows_are_a_plan_bench_accepts(capsys, tmp_path):
    """The FP8 rows' arguments through `python -m bench`'s own parser and planner (its dry run)."""
    from bench import __main__ as bench_cli
    from bench import main_job as job
    from bench.kernels import BASELINE

    assert bench_cli.main(job.fp8_quick_bench_argv(str(tmp_path), "x_quick_fp8") + ["--dry-run"]) == 0
    out = capsys.readouterr().out
    groups = [line for line in out.splitlines() if line.startswith("[")]
    assert groups and all(" 8K " in line and " fp8 " in line for line in groups)
    assert all(f"kernels: {', '.join((BASELINE, *job.FP8_QUICK_KERNELS))}" in line for line in groups)
    assert not any(tmp_path.iterdir())  # a dry run writes nothing


class _Gpu:
    """What bench.main_job asks of the GPU, for a run on this CPU machine: an H200 (SM90) or a B200."""

    def __init__(self, monkeypatch, name: str, sm90: bool):
        from bench import main_job as job

        monkeypatch.setattr(job.gates_job, "main", lambda argv: 0)  # the gates are tested above
        monkeypatch.setattr(job.torch.cuda, "get_device_name", lambda *a: name)
        monkeypatch.setattr(job, "_is_sm90", lambda: sm90)
        self.calls = []
        monkeypatch.setattr(job.bench_job, "main", self.bench)
        self.status = 0

    def bench(self, argv):
        """`python -m bench` with its real parser and planner; every planned row 'timed' at 1 TFLOPS."""
        from bench import __main__ as bench_cli
        from bench.kernels import KERNELS
        from bench.report import new_row, write_json
        from bench.sweep import build_plan

        self.calls.append(argv)
        print("a progress line")
        args = bench_cli.parse_args(argv)
        plan = build_plan(quick=args.quick, kernel_patterns=args.kernels, seqlens=args.seqlens, fp8=args.fp8)
        rows = [dict(new_row(g.shape, KERNELS[k]), status="ok", tflops=1.0) for g in plan for k in g.kernels]
        write_json(os.path.join(args.out, f"{args.name}.json"), {"schema": 1, "env": {}, "rows": rows})
        return self.status


@pytest.mark.parametrize(
    "gpu, sm90, stems",
    [("NVIDIA H200", True, ["h200_quick", "h200_quick_fp8"]), ("NVIDIA B200", False, ["b200_quick"])],
)
def test_on_a_gpu_the_short_benchmark_and_on_sm90_its_fp8_rows(monkeypatch, tmp_path, capsys, gpu, sm90, stems):
    from bench import main_job as job

    fake = _Gpu(monkeypatch, gpu, sm90)
    assert job.main(["--device", "cuda", "--bench-out", str(tmp_path)]) == 0
    assert [argv[argv.index("--name") + 1] for argv in fake.calls] == stems
    out = capsys.readouterr().out
    assert "a progress line" not in out  # the benchmark's progress went to its log
    assert all((tmp_path / f"{stem}.log").read_text() == "a progress line\n" for stem in stems)
    assert "| fa4_h15 |" in out  # the bf16 quick table
    assert ("| fa4_fp8_func_h15 |" in out) == sm90 and ("fp8 head dim 128" in out) == sm90
    assert ("benchmark fp8: not run" in out) != sm90


def test_a_failed_benchmark_is_exit_3(monkeypatch, tmp_path, capsys):
    from bench import main_job as job

    fake = _Gpu(monkeypatch, "NVIDIA H200", True)
    fake.status = 1
    assert job.main(["--device", "cuda", "--bench-out", str(tmp_path)]) == 3
    assert "benchmark fp8: exit status 1" in capsys.readouterr().out
