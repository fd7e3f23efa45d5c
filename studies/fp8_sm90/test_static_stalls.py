"""The static-stall study's reading of cuobjdump text (Note [Static stall cycles]) on a hand-built listing whose
stall bits are known, and that every variant it compiles is one the SM90 FP8 forward accepts."""

import pytest

from fa4_rowmax.fp8_sm90 import resolve_stage
from studies.fp8_sm90.static_stalls import STALL_SHIFT, VARIANTS, main_loop, parse, softmax_stretch, summarize


def _listing(rows):
    """cuobjdump -sass lines: (address, instruction, stall) -> the instruction line and its high-word line, with
    other control bits set around the stall field so a wrong shift or mask reads a different number."""
    lines = ["        Function : kernel", '        .headerflags    @"EF_CUDA_SM90"']
    for address, text, stall in rows:
        high = (stall << STALL_SHIFT) | (1 << 45) | (0b111 << 46) | 0x1234
        lines.append(f"        /*{address:04x}*/                   {text} ;   /* 0x000000000000794d */")
        lines.append(f"                                                          /* 0x{high:016x} */")
    return "\n".join(lines)


LISTING = _listing(
    [
        (0x00, "MOV R1, c[0x0][0x28]", 1),
        (0x10, "QGMMA.64x160x32.F32.E4M3.E4M3 R24, gdesc[UR4], RZ, !UPT, gsb0", 2),
        (0x20, "WARPGROUP.DEPBAR.LE gsb0, 0x0", 3),
        (0x30, "FFMA.SAT R2, R3, R4, R5", 4),
        (0x40, "@P0 PRMT R6, R2, 0x6540, R7", 5),
        (0x50, "FMNMX.NAN R8, R8, R2, !PT", 2),
        (0x60, "QGMMA.64x136x32.F32.E4M3.E4M3 R88, R6, gdesc[UR8], R88, gsb0", 1),
        (0x70, "@!P1 BRA 0x10", 6),
        (0x80, "BRA 0x80", 1),
        (0x90, "EXIT", 15),
        (0xA0, "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R0", 1),
        (0xB0, "@!P0 BRA 0xa0", 1),
        (0xC0, "BRA 0x10", 1),  # a barrier-wait retry's way back: a longer body around the same GEMMs
    ]
)


def test_parse_reads_the_stall_field_of_the_high_word():
    instructions = parse(LISTING)
    assert [i.address for i in instructions] == list(range(0, 0xD0, 0x10))
    assert [i.stall for i in instructions] == [1, 2, 3, 4, 5, 2, 1, 6, 1, 15, 1, 1, 1]
    assert instructions[4].opcode == "PRMT" and instructions[7].opcode == "BRA"


def test_the_main_loop_is_the_shortest_backward_branch_around_both_gemms_and_the_softmax_its_middle():
    loop = main_loop(parse(LISTING))
    assert [i.address for i in loop] == list(range(0x10, 0x80, 0x10))  # neither the self-branch nor the retry
    assert [i.opcode for i in softmax_stretch(loop)] == ["FFMA.SAT", "PRMT", "FMNMX.NAN"]
    row = summarize("toy", 6, loop)  # 3 scores a thread
    assert (row["softmax instructions"], row["softmax stall cycles"]) == (3, 11)
    assert row["per score: stall cycles"] == pytest.approx(11 / 3) and row["loop stall cycles"] == 23


def test_a_listing_without_its_high_words_is_refused():
    with pytest.raises(ValueError, match="no high encoding word"):
        parse("\n".join(line for line in LISTING.splitlines() if not line.strip().startswith("/* 0x")))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_each_variant_resolves_on_the_fp8_forward(name):
    knobs = {k: v for k, v in VARIANTS[name].items() if k != "causal"}
    stage = resolve_stage(rescale_threshold=None, beta=None, **knobs)
    assert stage.kernel == "sm90_fp8"
    for knob, value in knobs.items():
        if knob != "softmax_mode":
            assert getattr(stage, knob) == value, knob
