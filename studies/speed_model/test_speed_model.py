"""The SASS speed model's arithmetic (studies/speed_model/speed_model.py, Note [Per-tile pipe model]) on hand-written
SASS snippets, and its committed H200 validation (results/, README.md here). CPU only, no
compile: the validation reads the committed SASS."""

from pathlib import Path

import pytest

from studies.speed_model import speed_model as sm

RESULTS = Path(__file__).resolve().parent / "results"
RATES = sm.Rates("test", gemm_tflops=132 * 1e-3 * 4096, sms=132, clock_mhz=1000.0, source="test: 4096 FLOP/clk/SM")


def _cuobjdump(lines: list[str]) -> str:
    """cuobjdump-style text: `/*addr*/  INSTR ;  /* encoding */`, 16 bytes per instruction."""
    return "\n".join(f"        /*{16 * i:04x}*/                   {ins} ;   /* 0x000 */" for i, ins in enumerate(lines))


def _loop(body: list[str], prologue: int = 2) -> list[str]:
    """prologue NOPs, the body, a backward `@P1 BRA` to the body's start, an EXIT, and a retry stub that jumps back."""
    head = ["NOP"] * prologue
    start = 16 * len(head)
    stub_target = 16 * (len(head) + 1)
    return (
        head
        + body
        + [
            f"@P1 BRA 0x{start:x}",
            "EXIT",
            "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R6",
            "HGMMA.64x128x16.F32.BF16 R24, gdesc[UR4], R24",
            f"@!P0 BRA 0x{stub_target:x}",
        ]
    )


QK = ["HGMMA.64x128x16.F32.BF16 R24, gdesc[UR48], R24"]


def test_reads_cuobjdump_text_and_plain_lines_alike():
    lines = ["FFMA R1, R2, R3, R4", "MUFU.EX2 R5, R1", "@P0 BRA 0x0"]
    assert sm.read_sass(_cuobjdump(lines)) == lines
    assert sm.read_sass("\n".join(lines)) == lines
    broken = _cuobjdump(lines).replace("/*0010*/", "/*0040*/")
    with pytest.raises(ValueError):
        sm.read_sass(broken)


def test_the_main_loop_is_the_last_backward_branch_with_mma_and_no_exit():
    body = QK * 2 + ["FFMA R1, R2, R3, R4"] * 5
    sass = _loop(body)
    assert sm.main_loop(sass) == (2, 2 + len(body))  # the retry stub's backward branch (body with EXIT) is skipped
    with pytest.raises(ValueError):
        sm.main_loop(["FFMA R1, R2, R3, R4", "@P1 BRA 0x0"])  # a loop without MMA is no main loop


def test_pipe_classes():
    assert [
        sm.pipe_of(m)
        for m in (
            "MUFU.EX2",
            "FFMA.FTZ",
            "IMAD.U32",
            "FMNMX.NAN",
            "LEA",
            "F2FP.BF16.F32.PACK_AB",
            "UIADD3",
            "BAR.SYNC",
            "HGMMA.64x128x16.F32.BF16",
            "QGMMA.64x192x32.F32.E4M3.E4M3",
        )
    ] == ["mufu", "fma", "fma", "alu", "alu", "alu", "uniform", "other", "mma", "mma"]


def test_mma_flops_come_from_the_shapes():
    counts = sm.tile_counts(_loop(QK * 8 + ["QGMMA.64x192x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24"]))
    assert counts.mma_flops == 8 * 2 * 64 * 128 * 16 + 2 * 64 * 192 * 32


def test_a_mufu_bound_snippet_predicts_mufu_bound():
    counts = sm.tile_counts(_loop(QK * 2 + ["MUFU.EX2 R5, R1"] * 64 + ["FFMA R1, R2, R3, R4"] * 64))
    p = sm.predict(counts, RATES)
    assert p.bound == "mufu" and p.cycles == 2 * 64 * 8
    assert p.terms["tensor"] == 2 * 2 * (2 * 64 * 128 * 16) / 4096  # 2 warpgroups x 2 HGMMA / 4096 FLOP per clock


def test_a_tensor_bound_snippet_predicts_tensor_bound_and_ratio_one():
    light = sm.predict(sm.tile_counts(_loop(QK * 16 + ["FFMA R1, R2, R3, R4"] * 100)), RATES)
    heavier = sm.predict(sm.tile_counts(_loop(QK * 16 + ["FFMA R1, R2, R3, R4"] * 300)), RATES)
    assert light.bound == heavier.bound == "tensor" and light.cycles == 2048
    assert sm.ratio_to_stock(light, heavier) == 1.0  # hidden work is free: the model can say "no effect"


def test_alu_and_issue_bound_snippets_and_their_ratios():
    alu = sm.predict(sm.tile_counts(_loop(QK * 2 + ["FMNMX R1, R2, R3, !PT"] * 600)), RATES)
    assert alu.bound == "alu" and alu.cycles == 2 * 600 * 2
    issue = sm.predict(sm.tile_counts(_loop(QK * 2 + ["UIADD3 UR4, UR4, 0x1, URZ"] * 1500)), RATES)
    twice = sm.predict(sm.tile_counts(_loop(QK * 2 + ["UIADD3 UR4, UR4, 0x1, URZ"] * 3001)), RATES)
    assert issue.bound == "issue" and issue.cycles == 2 * 1503  # every instruction of the body takes a slot
    assert sm.ratio_to_stock(issue, twice) == pytest.approx(1503 / 3004)


def test_the_pingpong_term_binds_when_one_warp_alone_is_too_slow():
    # one warpgroup's softmax (W = 8 * 200 MUFU cycles) does not fit in the other's GEMM time: tensor/4 + W binds
    counts = sm.tile_counts(_loop(QK * 8 + ["MUFU.EX2 R5, R1"] * 200))
    p = sm.predict(counts, RATES)
    assert p.terms["pingpong"] == p.terms["tensor"] / 4 + 8 * 200
    assert p.bound == "mufu" and p.terms["mufu"] > p.terms["pingpong"]  # both warps' MUFU demand is larger still


def test_the_vote_branch_is_weighted_by_its_skip_fraction():
    body = (
        QK * 2
        + ["VOTE.ANY R0, PT, P0", "@!P0 BRA 0x{:x}".format(16 * (2 + 2 + 2 + 64))]
        + ["FMUL R1, R1, R2"] * 64
        + ["FADD R3, R3, R4"]
    )
    sass = _loop(body)
    never = sm.tile_counts(sass, skip=0.0)
    always = sm.tile_counts(sass, skip=1.0)
    half = sm.tile_counts(sass, skip=0.5)
    assert never.conditional == always.conditional == 64
    assert never.fma - always.fma == 64 and half.fma == pytest.approx(always.fma + 32)
    assert never.issue - always.issue == 64


def test_the_committed_h200_validation_fails_as_documented():
    """studies/speed_model/README.md: the model predicts every SM90 BF16 and FP8 variant tensor-bound (ratio 1.00), the
    ratio-1 null model; it gets none of the points that moved by more than 3 points, so it fails its validation
    and no B200 prediction is published. A model change that alters this must update the document."""
    result = sm.validate(RESULTS)
    summary = result["summary"]
    assert summary["points"] == 40 and summary["passes"] is False
    assert summary["moved_points_within_3"] == 0
    assert all(p["predicted"] == 1.0 and p["model"]["bound"] == "tensor" for p in result["points"])
    assert summary["within_3_points"] == summary["null_model_within_3_points"] == 16
    worst = max(result["points"], key=lambda p: abs(p["error_points"]))
    assert worst["variant"] == "fa4fp8_exact_noexp2_n192" and worst["mask"] == "non-causal"
