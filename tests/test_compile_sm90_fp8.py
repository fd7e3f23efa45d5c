"""The SM90 FP8 forward (fa4_rowmax/stage/flash_fwd_sm90_fp8.py) compiles to sm_90a cubin on the CPU; its SASS.

Each configuration compiles in its own subprocess (FakeTensorMode, FLASH_ATTENTION_ARCH=sm_90,
CUTE_DSL_ARCH=sm_90a, CUTE_DSL_KEEP=cubin) against a private patched copy of the installed FA4 (the
kernel uses patch 0001's `softmax_stage` hook in FA4's SM90 `mma`), as fa4_rowmax/testing/compile_check.py
does for the BF16 kernels. Configurations: causal, head dim 128 (64 where named), 256 keys (so all three softmax
sites of FA4's causal main loop are unrolled: first block, masked blocks, unmasked blocks).

What the SASS must show (E = elements per thread per tile = tile_n / 2, S = 3 softmax sites, 2 rows per
thread): QGMMA with e4m3 operands and no HGMMA; `exact`: S * E MUFU.EX2 for the weights + 2 (S - 1) for the
row rescale factors, S * E / 2 e4m3 converts (F2FP...E4M3, two weights each); `rowmax_h15`: only the 2 (S - 1)
rescale MUFU.EX2 and no e4m3 convert (the bytes come from PRMT); `row_sum="mma"`: the PV GEMM is N = head_dim
+ 8 and no per-element FADD is left; `clamp="sat"`: one FFMA.SAT per element and no clamp FMNMX (every max
left is the NaN-propagating row max); exact with `beta`: the emulated elements (B per thread and site, picked by
`softmax_base.off_mufu` on each row) leave the MUFU: S * (E - B) + 2 (S - 1) MUFU.EX2, 3 S B more FFMA (the
cubic's Horner steps), the same converts, and the row max NaN-propagating (Note [beta on the FP8 exact twin]).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from fa4_rowmax.config import STAGE_KNOBS
from fa4_rowmax.fp8_sm90 import SMEM_ALIGN, call_stage, shared_memory_bytes
from fa4_rowmax.stage.softmax_base import off_mufu
from fa4_rowmax.testing import compile_check
from fa4_rowmax.testing.sass import count, split_instruction

SITES = 3
ROWS = 2

# A pseudo-opcode in the counts: local-memory loads and stores between the first and the last GMMA (the main loop;
# FA4's epilogue may stage O through local memory once per work tile).
MAIN_LOOP_LOCAL = "STL/LDL in the main loop"
# Another: P.V GEMMs (QGMMA N = head_dim + row-sum columns) whose next GEMM-or-arrive is a BAR.ARV, i.e. the warpgroup
# hands the tensor cores over before issuing its next S (Note [Scheduler window after the P.V GEMM]).
PV_THEN_ARRIVE = "P.V GEMMs followed by the scheduler arrive"
SINGLE = dict(pv_accumulation="single")
# Every structural knob explicit, so that Note [Tuned defaults] (fp8_sm90.py) leaves them as named here.
_EXPLICIT = dict(
    tile_m=128,
    tile_n=128,
    intra_wg_overlap=True,
    row_sum="fadd",
    clamp="max",
    scheduler_barrier=False,
    o_store="pv_columns",
    persistent=False,
    masked_half="compute",
    warpgroup_epilogue="shared",
)
# Three consumer warpgroups (Note [Three consumer warpgroups]) with H15's tuned knobs, the base of several configs.
_H15_M192 = dict(softmax_mode="rowmax_h15", clamp="sat", row_sum="mma", tile_m=192, intra_wg_overlap=False)
_H15_N256 = dict(softmax_mode="rowmax_h15", clamp="sat", row_sum="mma", tile_n=256, intra_wg_overlap=False)
_EXACT_N256 = dict(softmax_mode="exact", row_sum="mma", tile_n=256, intra_wg_overlap=False)
_EXACT_M192 = dict(softmax_mode="exact", row_sum="mma", tile_m=192, tile_n=160, intra_wg_overlap=False)
CONFIGS = {
    "exact": dict(softmax_mode="exact", **SINGLE),
    "exact_n192_mma": dict(softmax_mode="exact", tile_n=192, row_sum="mma", rescale_vote=True, **SINGLE),
    "h15": dict(softmax_mode="rowmax_h15", **SINGLE),
    "h15_fold_n192_mma": dict(
        softmax_mode="rowmax_h15", anchor_rounding="half_octave", tile_n=192, row_sum="mma", **SINGLE
    ),
    "h15_sat_n192_mma": dict(softmax_mode="rowmax_h15", clamp="sat", tile_n=192, row_sum="mma", **SINGLE),
    "exact_n192_beta0.25_mma": dict(softmax_mode="exact", tile_n=192, beta=0.25, row_sum="mma", **SINGLE),
    # Two-level accumulation (the default; Note [Two-level P.V accumulation]) beside its single-level twins.
    "exact_two_level": dict(softmax_mode="exact"),
    "h15_two_level": dict(softmax_mode="rowmax_h15"),
    "h15_sat_two_level_mma": dict(softmax_mode="rowmax_h15", clamp="sat", row_sum="mma"),
    # No intra-warpgroup overlap at the largest tile, with FA4's scheduler hand-over and right after the P.V GEMM
    # (Note [Scheduler window after the P.V GEMM]).
    "h15_sat_mma_n256_nooverlap": _H15_N256,
    "h15_sat_mma_n256_nooverlap_arrive": dict(_H15_N256, arrive_after_pv=True),
    # Three consumer warpgroups (Note [Three consumer warpgroups]), both row sums, beside two at the same tile.
    "h15_sat_mma_m192": _H15_M192,
    "h15_sat_m192": dict(softmax_mode="rowmax_h15", clamp="sat", tile_m=192, intra_wg_overlap=False),
    # More K/V tiles in flight (Note [KV stages in shared memory]).
    "h15_sat_mma_m192_s4": dict(_H15_M192, kv_stages=4),
    # FA4's round-robin scheduler barrier between the three (Note [Three consumer warpgroups]).
    "h15_sat_mma_m192_sb": dict(_H15_M192, scheduler_barrier=True),
    "h15_sat_mma_m192_sb_arrive": dict(_H15_M192, scheduler_barrier=True, arrive_after_pv=True),
    "h15_sat_nooverlap": dict(softmax_mode="rowmax_h15", clamp="sat", intra_wg_overlap=False),
    # O's tile without the row-sum columns (Note [O's tile without the row-sum columns]) beside its twin, and the
    # head-dim-128 defaults (Note [Tuned defaults], every one with it): each mask's, and causal GQA's three warpgroups
    # (Note [Causal tiles that pack GQA]); the non-causal ones compiled non-causal, as the call runs them (first
    # block and loop, two softmax sites, so the site-counting tests, which take three, do not select them by name).
    "noncausal_h15_sat_mma_m192_n160": dict(_H15_M192, causal=False, tile_n=160),
    "noncausal_h15_sat_mma_m192_n160_single": dict(_H15_M192, causal=False, tile_n=160, pv_accumulation="single"),
    "noncausal_h15_sat_mma_m192_n160_o_head_dim": dict(_H15_M192, causal=False, tile_n=160, o_store="head_dim"),
    "noncausal_exact_mma_m192_n160_o_head_dim": dict(_EXACT_M192, causal=False, o_store="head_dim"),
    "h15_sat_mma_n256_nooverlap_o_head_dim": dict(_H15_N256, o_store="head_dim"),
    "exact_mma_n256_nooverlap_o_head_dim": dict(_EXACT_N256, o_store="head_dim"),
    "h15_sat_mma_m192_n160_o_head_dim": dict(_H15_M192, tile_n=160, o_store="head_dim"),
    "exact_mma_m192_n160_o_head_dim": dict(_EXACT_M192, o_store="head_dim"),
    # The head-dim-64 causal defaults with one head per tile (PV N = 64 + 8); named by head dim first, so the tests
    # that select by a mode prefix keep to head dim 128.
    "d64_h15_sat_mma_n192_o_head_dim": dict(
        head_dim=64, softmax_mode="rowmax_h15", clamp="sat", row_sum="mma", tile_n=192, o_store="head_dim"
    ),
    "d64_exact_mma_m192_n160_sb_o_head_dim": dict(_EXACT_M192, head_dim=64, scheduler_barrier=True, o_store="head_dim"),
    # The persistent grid (Note [Persistent work tiles]) in the defaults that take it.
    "h15_sat_mma_n256_nooverlap_o_head_dim_persistent": dict(_H15_N256, o_store="head_dim", persistent=True),
    "exact_mma_m192_n160_o_head_dim_persistent": dict(_EXACT_M192, o_store="head_dim", persistent=True),
    "exact_mma_n256_nooverlap_o_head_dim_persistent": dict(_EXACT_N256, o_store="head_dim", persistent=True),
    "noncausal_h15_sat_mma_m192_n160_o_head_dim_persistent": dict(
        _H15_M192, causal=False, tile_n=160, o_store="head_dim", persistent=True
    ),
    "noncausal_exact_mma_m192_n160_o_head_dim_persistent": dict(
        _EXACT_M192, causal=False, o_store="head_dim", persistent=True
    ),
    "d64_h15_sat_mma_n192_o_head_dim_persistent": dict(
        head_dim=64,
        softmax_mode="rowmax_h15",
        clamp="sat",
        row_sum="mma",
        tile_n=192,
        o_store="head_dim",
        persistent=True,
    ),
    "d64_exact_mma_m192_n160_sb_o_head_dim_persistent": dict(
        _EXACT_M192, head_dim=64, scheduler_barrier=True, o_store="head_dim", persistent=True
    ),
    # The first KV tile's masked half skipped (Note [The masked half of the first KV tile]) in the head-dim-128
    # causal MHA defaults of both modes.
    "h15_sat_mma_n256_nooverlap_o_head_dim_persistent_masked_half": dict(
        _H15_N256, o_store="head_dim", persistent=True, masked_half="skip"
    ),
    "exact_mma_n256_nooverlap_o_head_dim_persistent_masked_half": dict(
        _EXACT_N256, o_store="head_dim", persistent=True, masked_half="skip"
    ),
    # Each warpgroup's own tile boundary (Note [Each warpgroup's own tile boundary]) at the persistent defaults of two
    # and three warpgroups; the causal three-warpgroup one holds the most code live at 160 registers.
    "h15_sat_mma_n256_nooverlap_o_head_dim_persistent_own": dict(
        _H15_N256, o_store="head_dim", persistent=True, warpgroup_epilogue="own"
    ),
    "noncausal_h15_sat_mma_n256_nooverlap_o_head_dim_persistent": dict(
        _H15_N256, causal=False, o_store="head_dim", persistent=True
    ),
    "noncausal_h15_sat_mma_n256_nooverlap_o_head_dim_persistent_own": dict(
        _H15_N256, causal=False, o_store="head_dim", persistent=True, warpgroup_epilogue="own"
    ),
    "exact_mma_n256_nooverlap_o_head_dim_persistent_own": dict(
        _EXACT_N256, o_store="head_dim", persistent=True, warpgroup_epilogue="own"
    ),
    "exact_mma_m192_n160_o_head_dim_persistent_own": dict(
        _EXACT_M192, o_store="head_dim", persistent=True, warpgroup_epilogue="own"
    ),
    # Both (branch fp8-next): the masked half skipped under each warpgroup's own boundary.
    "both_h15_sat_mma_n256_nooverlap_o_head_dim_persistent": dict(
        _H15_N256, o_store="head_dim", persistent=True, warpgroup_epilogue="own", masked_half="skip"
    ),
    # O's tile at head_dim + 8 columns on the persistent grid: its region holds the epilogue's overrun.
    "d64_exact_mma_n192_persistent": dict(
        head_dim=64, softmax_mode="exact", tile_n=192, row_sum="mma", intra_wg_overlap=False, persistent=True
    ),
}
CONFIGS = {name: {**_EXPLICIT, **kwargs} for name, kwargs in CONFIGS.items()}
STAGE_KNOBS_DEFAULTS = {
    knob: STAGE_KNOBS[knob].default for knob in ("tile_m", "tile_n", "kv_stages", "row_sum", "o_store")
}
# Twins that differ only in pv_accumulation.
TWO_LEVEL_TWINS = {"exact_two_level": "exact", "h15_two_level": "h15"}


# A pseudo-opcode: the register count the consumer warpgroups raise themselves to (USETMAXREG.TRY_ALLOC's operand).
CONSUMER_REGISTERS = "consumer registers"
# Another: the bytes of the shared-storage struct the kernel allocated, as traced (compile_check).
SHARED_STORAGE = "shared storage bytes"
# And two of the waits for O's TMA store to read O's tile (cp.async.bulk.wait_group.read 0: DEPBAR.LE SB0): all of
# them, and those right after the store's flush (Note [O store wait on the persistent grid]).
O_STORE_WAITS = "O store waits"
O_STORE_WAITS_AT_STORE = "O store waits right after the store"
# And the named barriers by their thread count: "BAR.SYNC 0x80" counts BAR.SYNC instructions for 128 threads.
BAR_THREADS = "BAR.{} {:#x}"
# And the PRMTs that move bytes between registers (H15's pack, the P operand's order), not those that sign- or
# zero-extend one byte or half (selectors 0x7710, 0x8880, 0x9910: integer index arithmetic).
PRMT_MOVES = "PRMT moving bytes"
_PRMT_EXTENDS = {"0x7710", "0x8880", "0x9910"}


def _compile(name: str, kwargs: dict, workdir: Path, site: Path) -> Counter:
    """Mnemonic counts of the kernel `kwargs` compile to (`compile_check.compile_fp8_sm90`: causal, head dim 128,
    256 keys), plus MAIN_LOOP_LOCAL."""
    cubin = compile_check.compile_fp8_sm90(kwargs, workdir / name, site)
    instructions = compile_check.disassemble(cubin)
    opcodes = [split_instruction(ins)[0] for ins in instructions]
    ops = Counter(opcodes)
    gmma = [i for i, op in enumerate(opcodes) if op.startswith("QGMMA")]
    ops[MAIN_LOOP_LOCAL] = sum(op.startswith(("STL", "LDL")) for op in opcodes[gmma[0] : gmma[-1]])
    (alloc,) = [ins for ins in instructions if split_instruction(ins)[0].startswith("USETMAXREG.TRY_ALLOC")]
    ops[CONSUMER_REGISTERS] = int(alloc.rsplit(",", 1)[1], 16)
    ops[SHARED_STORAGE] = compile_check.traced_shared_storage_bytes(cubin)
    waits = ["DEPBAR.LE SB0" in ins for ins in instructions]
    ops[O_STORE_WAITS] = sum(waits)
    ops[O_STORE_WAITS_AT_STORE] = sum(waits[i + 1] for i, op in enumerate(opcodes) if op == "UTMACMDFLUSH")
    for ins in instructions:
        op, operands = split_instruction(ins)
        ops[PRMT_MOVES] += op == "PRMT" and operands[2] not in _PRMT_EXTENDS
        if op.startswith(("BAR.SYNC", "BAR.ARV")) and len(operands) == 2:
            ops[BAR_THREADS.format(op.split(".")[1], int(operands[1], 16))] += 1
    pv_gemm = f"QGMMA.64x{_o_per_thread(kwargs) * 2}x32."
    events = [op for op in opcodes if op.startswith("QGMMA") or op == "BAR.ARV"]
    ops[PV_THEN_ARRIVE] = sum(
        op.startswith(pv_gemm) and not following.startswith(pv_gemm) and following == "BAR.ARV"
        for op, following in zip(events, events[1:])
    )
    return ops


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("fp8_sm90")
    site = compile_check.prepare_fa4_copies(workdir)["patched"]
    return {name: (kwargs, _compile(name, kwargs, workdir, site)) for name, kwargs in CONFIGS.items()}


def _per_thread(kwargs) -> int:
    return kwargs.get("tile_n", 128) // 2


def _emulated_per_thread(kwargs) -> int:
    """Elements per thread and site off the MUFU: the stage's rule on each of the ROWS rows of tile_n / 4."""
    per_row = _per_thread(kwargs) // ROWS
    return ROWS * sum(off_mufu(i, per_row, kwargs.get("beta") or 0.0) for i in range(per_row))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fp8_wgmma_only(compiled, name):
    kwargs, ops = compiled[name]
    qgmma = {op: n for op, n in ops.items() if op.startswith("QGMMA")}
    assert qgmma and all(op.endswith(".E4M3.E4M3") for op in qgmma), qgmma
    assert count(ops, "HGMMA") == 0
    assert any(op.startswith(f"QGMMA.64x{_pv_n(kwargs)}x32.") for op in qgmma), qgmma
    assert any(op.startswith(f"QGMMA.64x{kwargs.get('tile_n', 128)}x32.") for op in qgmma), qgmma


@pytest.mark.parametrize("name", [n for n in CONFIGS if n.startswith("exact")])
def test_exact_twin_mufu_and_convert_counts(compiled, name):
    kwargs, ops = compiled[name]
    e = _per_thread(kwargs)
    assert count(ops, "MUFU.EX2") == SITES * (e - _emulated_per_thread(kwargs)) + ROWS * (SITES - 1)
    e4m3_converts = sum(n for op, n in ops.items() if op.startswith("F2FP") and "E4M3" in op)
    assert e4m3_converts == SITES * e // 2


def test_beta_moves_exp2_onto_the_fma_pipe(compiled):
    """Note [beta on the FP8 exact twin]: beta 0.25 at tile_n 192 emulates 24 of 96 elements per thread and site,
    three FFMA each more than beta 0 (same skeleton, `exact_n192_mma`, whose vote adds no FFMA), and its row max
    propagates NaN (FMNMX.NAN) where beta 0 keeps FA4's NaN-quiet one."""
    kwargs, ops = compiled["exact_n192_beta0.25_mma"]
    _, base = compiled["exact_n192_mma"]
    emulated = _emulated_per_thread(kwargs)
    assert emulated == 24
    assert count(ops, "FFMA") - count(base, "FFMA") == 3 * SITES * emulated
    assert count(base, "FMNMX.NAN") == 0 and count(ops, "FMNMX.NAN") >= SITES * _per_thread(kwargs)


@pytest.mark.parametrize("name", [n for n in CONFIGS if n.startswith("h15")])
def test_h15_has_no_weight_mufu_and_no_convert(compiled, name):
    kwargs, ops = compiled[name]
    e = _per_thread(kwargs)
    assert count(ops, "MUFU.EX2") == ROWS * (SITES - 1)
    assert not any(op.startswith("F2FP") and "E4M3" in op for op in ops)
    # Three PRMT per four bytes (Note [H15 e4m3 bytes by integer ops]), beyond the few FA4 itself emits.
    assert count(ops, "PRMT") >= SITES * e * 3 // 4


def test_row_sum_by_mma_leaves_no_per_element_fadd(compiled):
    fadd = {name: count(ops, "FADD") for name, (_, ops) in compiled.items()}
    e = {name: _per_thread(kwargs) for name, (kwargs, _) in compiled.items()}
    assert fadd["exact"] >= SITES * e["exact"] and fadd["h15"] >= 2 * SITES * e["h15"]  # sum (+ round-add)
    assert fadd["exact_n192_mma"] < SITES * e["exact_n192_mma"] // 8
    assert fadd["h15_fold_n192_mma"] < SITES * e["h15_fold_n192_mma"] // 8


def test_clamp_by_saturation_drops_the_clamp(compiled):
    """Note [Clamp by saturation]: one FFMA.SAT per element, no NaN-quiet FMNMX left (the row max is FMNMX.NAN)."""
    kwargs, ops = compiled["h15_sat_n192_mma"]
    assert ops["FFMA.SAT"] == SITES * _per_thread(kwargs)
    assert not any(op == "FMNMX" or (op.startswith("FMNMX.") and ".NAN" not in op) for op in ops), ops
    _, fold_ops = compiled["h15_fold_n192_mma"]
    assert count(fold_ops, "FMNMX") - count(ops, "FMNMX") == SITES * _per_thread(kwargs)


def _pv_n(kwargs) -> int:
    """The P.V GEMM's N: head_dim, plus Note [Row sum by the MMA]'s 8 columns."""
    return kwargs.get("head_dim", 128) + (8 if kwargs.get("row_sum") == "mma" else 0)


def _o_per_thread(kwargs) -> int:
    """O accumulator elements per thread: 64 rows x (head_dim + row-sum columns) over a warpgroup's 128 threads."""
    return _pv_n(kwargs) // 2


@pytest.mark.parametrize("name", sorted(TWO_LEVEL_TWINS))
def test_two_level_promotes_by_one_ffma_per_o_element(compiled, name):
    """Note [Two-level P.V accumulation]: each of the SITES P V GEMMs (two overlapped steps and the last block) is
    promoted by one FFMA per O element; the rescale FMUL of the overlapped steps is gone (finalize keeps its own)."""
    kwargs, ops = compiled[name]
    _, single = compiled[TWO_LEVEL_TWINS[name]]
    o = _o_per_thread(kwargs)
    assert count(ops, "FFMA") - count(single, "FFMA") == SITES * o
    assert count(single, "FMUL") - count(ops, "FMUL") == (SITES - 1) * o
    assert count(ops, "QGMMA") == count(single, "QGMMA")


def test_arrive_after_pv_hands_over_after_every_p_v_gemm(compiled):
    """Note [Scheduler window after the P.V GEMM]: with FA4's hand-over only the last P.V GEMM (block 0, FA4's arrive
    after the loop) is followed by the arrive, the others by the next S; with arrive_after_pv every one of the SITES
    is, and the barrier instructions are FA4's plus the one conditional arrive per P.V GEMM site but the last."""
    _, fa4 = compiled["h15_sat_mma_n256_nooverlap"]
    _, arrive = compiled["h15_sat_mma_n256_nooverlap_arrive"]
    assert (fa4[PV_THEN_ARRIVE], arrive[PV_THEN_ARRIVE]) == (1, SITES)
    assert count(arrive, "BAR.SYNC") == count(fa4, "BAR.SYNC")
    assert count(arrive, "QGMMA") == count(fa4, "QGMMA")


@pytest.mark.parametrize(
    "name", sorted(n for n, kw in CONFIGS.items() if kw.get("tile_n", 128) == 128 and kw.get("tile_m", 128) == 128)
)
def test_no_spill_in_the_main_loop_at_tile_128(compiled, name):
    """With two warpgroups (240 registers) tile 128 keeps every accumulator in registers, two-level's second O
    included: no local-memory load or store between the first and the last GMMA (three warpgroups:
    test_three_warpgroups)."""
    _, ops = compiled[name]
    assert ops[MAIN_LOOP_LOCAL] == 0, {op: n for op, n in ops.items() if op.startswith(("STL", "LDL"))}


@pytest.mark.parametrize(
    "name",
    [
        "h15_sat_mma_n256_nooverlap",
        "h15_sat_mma_n256_nooverlap_arrive",
        "h15_sat_mma_n256_nooverlap_o_head_dim_persistent",
    ],
)
def test_no_spill_in_the_main_loop_at_tile_256_without_overlap(compiled, name):
    """Without intra-warpgroup overlap S and the second accumulator are never live together (Note [Two-level P.V
    accumulation]), so the largest wgmma N fits: no local-memory traffic between the first and the last GMMA."""
    _, ops = compiled[name]
    assert ops[MAIN_LOOP_LOCAL] == 0, {op: n for op, n in ops.items() if op.startswith(("STL", "LDL"))}
    assert count(ops, "QGMMA.64x256x32") > 0


@pytest.mark.parametrize("name", ["h15_sat_mma_m192", "h15_sat_m192"])
def test_three_warpgroups(compiled, name):
    """Note [Three consumer warpgroups]: tile_m=192 takes FA4's three-warpgroup register split (160 a consumer thread,
    240 with two), the same per-element code as two warpgroups at the same tile (the softmax is per warpgroup), and
    with the FADD row sum no local-memory traffic in the main loop."""
    _, ops = compiled[name]
    _, two = compiled["h15_sat_nooverlap"]
    assert (ops[CONSUMER_REGISTERS], two[CONSUMER_REGISTERS]) == (160, 240)
    for op in ("FFMA.SAT", "PRMT", "FMNMX.NAN"):
        assert abs(count(ops, op) - count(two, op)) <= 4, (op, count(ops, op), count(two, op))
    if name == "h15_sat_m192":
        assert ops[MAIN_LOOP_LOCAL] == 0, {op: n for op, n in ops.items() if op.startswith(("STL", "LDL"))}


def test_kv_stages_change_no_arithmetic(compiled):
    """Note [KV stages in shared memory]: four K/V stages instead of two change the buffers the producer fills, not the
    consumers' code: the same wgmma, per-element operations and local-memory traffic, at the same register split."""
    _, ops = compiled["h15_sat_mma_m192_s4"]
    _, two = compiled["h15_sat_mma_m192"]
    for op in ("QGMMA.64x128x32", "QGMMA.64x136x32", "FFMA.SAT", "PRMT", "FMNMX.NAN", CONSUMER_REGISTERS):
        assert count(ops, op) == count(two, op) > 0, (op, count(ops, op), count(two, op))
    assert abs(ops[MAIN_LOOP_LOCAL] - two[MAIN_LOOP_LOCAL]) <= 2, (ops[MAIN_LOOP_LOCAL], two[MAIN_LOOP_LOCAL])


DEFAULTS_COMPILED = {  # (mode, head dim, causal, GQA ratio) -> the configuration above that the call compiles
    ("rowmax_h15", 128, True, 1): "h15_sat_mma_n256_nooverlap_o_head_dim_persistent_own",
    ("rowmax_h15", 128, True, 4): "h15_sat_mma_n256_nooverlap_o_head_dim_persistent",
    ("rowmax_h15", 128, False, 1): "noncausal_h15_sat_mma_n256_nooverlap_o_head_dim_persistent_own",
    ("rowmax_h15", 128, False, 4): "noncausal_h15_sat_mma_m192_n160_o_head_dim_persistent",
    ("exact", 128, True, 1): "exact_mma_n256_nooverlap_o_head_dim_persistent_own",
    ("exact", 128, True, 4): "exact_mma_m192_n160_o_head_dim_persistent",
    ("exact", 128, False, 1): "noncausal_exact_mma_m192_n160_o_head_dim_persistent",
    ("rowmax_h15", 64, True, 1): "d64_h15_sat_mma_n192_o_head_dim_persistent",
    ("exact", 64, True, 1): "d64_exact_mma_m192_n160_sb_o_head_dim_persistent",
}
# Local-memory accesses between the first and the last GMMA of today's compile of the three-warpgroup defaults: at
# 160 registers a thread the MMA row sum's 8 accumulator columns push a few registers out around the P.V GEMM
# (L1-resident, and measured fastest anyway: bench/results/h200_2026-12-03_s12/, _s14/); the exact twin's causal
# kernel, whose three softmax sites (masked first block, masked and unmasked loop) hold more code live, 49. A bound,
# so that more spilling fails here; two warpgroups spill nothing.
MAIN_LOOP_LOCAL_BOUND = {
    "noncausal_h15_sat_mma_m192_n160_o_head_dim": 10,
    "noncausal_exact_mma_m192_n160_o_head_dim": 24,
    "h15_sat_mma_m192_n160_o_head_dim": 10,
    "exact_mma_m192_n160_o_head_dim": 49,
}
# The persistent grid's loop (Note [Persistent work tiles]) holds the same main loop: the same bound.
MAIN_LOOP_LOCAL_BOUND.update({f"{name}_persistent": bound for name, bound in MAIN_LOOP_LOCAL_BOUND.items()})


@pytest.mark.parametrize("key", sorted(DEFAULTS_COMPILED))
def test_the_defaults_are_compiled_here(compiled, key):
    """Every head-dim-128 default of Note [Tuned defaults], and the causal head-dim-64 ones with one head per tile,
    compiles in this file with the knobs the call resolves: e4m3 wgmma at the tuned tile and PV N, the register
    split of its warpgroup count, and no more local-memory traffic in the main loop than the bound."""
    mode, head_dim, causal, ratio = key
    name = DEFAULTS_COMPILED[key]
    kwargs, ops = compiled[name]
    assert kwargs.get("head_dim", 128) == head_dim
    stage = call_stage(mode, head_dim, causal, qhead_per_kvhead=ratio)
    knobs = (
        "tile_m",
        "tile_n",
        "intra_wg_overlap",
        "row_sum",
        "clamp",
        "arrive_after_pv",
        "kv_stages",
        "scheduler_barrier",
        "o_store",
        "persistent",
        "masked_half",
        "warpgroup_epilogue",
    )
    for knob in knobs:
        assert getattr(stage, knob) == kwargs.get(knob, STAGE_KNOBS[knob].default), knob
    assert kwargs.get("causal", True) == causal and kwargs.get("pv_accumulation", "two_level") == "two_level"
    assert count(ops, f"QGMMA.64x{stage.tile_n}x32") > 0 and count(ops, f"QGMMA.64x{_pv_n(kwargs)}x32") > 0
    assert ops[CONSUMER_REGISTERS] == {128: 240, 192: 160}[stage.tile_m]
    assert ops[MAIN_LOOP_LOCAL] <= MAIN_LOOP_LOCAL_BOUND.get(name, 0), (name, ops[MAIN_LOOP_LOCAL])


def test_the_round_robin_barrier_orders_the_three_warpgroups(compiled):
    """Note [Three consumer warpgroups]: scheduler_barrier=True adds FA4's scheduler barrier to three warpgroups (a
    sync before each P.V GEMM and the first block, an arrive after each S GEMM issue and after the loop: BAR.SYNC and
    BAR.ARV that the kernel without it lacks) and changes nothing else: the same wgmma and per-element operations
    at the same register split."""
    _, ops = compiled["h15_sat_mma_m192_sb"]
    _, free = compiled["h15_sat_mma_m192"]
    assert count(ops, "BAR.SYNC") > count(free, "BAR.SYNC") and count(ops, "BAR.ARV") > count(free, "BAR.ARV")
    for op in ("QGMMA.64x128x32", "QGMMA.64x136x32", "FFMA.SAT", "PRMT", "FMNMX.NAN", CONSUMER_REGISTERS):
        assert count(ops, op) == count(free, op) > 0, (op, count(ops, op), count(free, op))


def test_the_round_robin_hands_over_after_every_p_v_gemm_with_arrive_after_pv(compiled):
    """Note [Scheduler window after the P.V GEMM] on three warpgroups: as with two, FA4's hand-over follows only the
    last P.V GEMM, arrive_after_pv every one of the SITES, with the same barrier syncs."""
    _, fa4 = compiled["h15_sat_mma_m192_sb"]
    _, arrive = compiled["h15_sat_mma_m192_sb_arrive"]
    assert (fa4[PV_THEN_ARRIVE], arrive[PV_THEN_ARRIVE]) == (1, SITES)
    assert count(arrive, "BAR.SYNC") == count(fa4, "BAR.SYNC")


def test_the_three_warpgroup_default_promotes_by_one_ffma_per_o_element(compiled):
    """Note [Two-level P.V accumulation] in the non-causal default at three warpgroups: against its single-level twin,
    one promoting FFMA per O element at each of the two softmax sites (first block, loop) and the loop's rescale
    FMUL gone (the first block has none to remove), the same wgmma."""
    kwargs, ops = compiled["noncausal_h15_sat_mma_m192_n160"]
    _, single = compiled["noncausal_h15_sat_mma_m192_n160_single"]
    sites, o = 2, _o_per_thread(kwargs)
    assert count(ops, "FFMA") - count(single, "FFMA") == sites * o
    assert count(single, "FMUL") - count(ops, "FMUL") == (sites - 1) * o
    assert count(ops, "QGMMA") == count(single, "QGMMA")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_shared_memory_estimate_holds_the_traced_storage(compiled, name):
    """Note [KV stages in shared memory]: the host refuses kv_stages by `shared_memory_bytes`, so it must never be
    below what the kernel allocates (a launch past 227 KiB would fail on the GPU) and no more than one alignment
    period above it (or it refuses stages that fit)."""
    kwargs, ops = compiled[name]
    knobs = {**STAGE_KNOBS_DEFAULTS, **kwargs}
    estimate = shared_memory_bytes(
        kwargs.get("head_dim", 128),
        knobs["tile_m"],
        knobs["tile_n"],
        knobs["kv_stages"],
        knobs["row_sum"],
        knobs["o_store"],
        knobs.get("persistent", False),
    )
    assert ops[SHARED_STORAGE] <= estimate <= ops[SHARED_STORAGE] + SMEM_ALIGN, (ops[SHARED_STORAGE], estimate)


def test_o_without_the_row_sum_columns_is_stored_in_two_tma_boxes(compiled):
    """Note [O's tile without the row-sum columns]: with the P.V GEMM's head_dim + 8 columns O's shared tile has no
    128-byte swizzle and FA4's epilogue stores it in (head_dim + 8) / 8 TMA boxes; o_store="head_dim" stores the
    head_dim columns in head_dim / 64 (FA4's stock count at head dim 128). The main loop is the same code; the
    epilogue no longer scales the row-sum columns' chunk (4 values a thread: 4 FFMA) nor converts it (2 F2FP)."""
    _, wide = compiled["noncausal_h15_sat_mma_m192_n160"]
    _, narrow = compiled["noncausal_h15_sat_mma_m192_n160_o_head_dim"]
    assert (count(wide, "UTMASTG"), count(narrow, "UTMASTG")) == ((128 + 8) // 8, 128 // 64)
    for op in ("QGMMA", "FFMA.SAT", "FMNMX", "PRMT", "MUFU.EX2", "SHFL"):
        assert count(narrow, op) == count(wide, op), op
    assert (count(wide, "FFMA") - count(narrow, "FFMA"), count(wide, "F2FP") - count(narrow, "F2FP")) == (4, 2)
    assert narrow[SHARED_STORAGE] < wide[SHARED_STORAGE]


@pytest.mark.parametrize(
    "name, base",
    [
        ("h15_sat_mma_n256_nooverlap_o_head_dim_persistent", "h15_sat_mma_n256_nooverlap_o_head_dim"),
        ("exact_mma_m192_n160_o_head_dim_persistent", "exact_mma_m192_n160_o_head_dim"),
    ],
)
def test_persistent_grid_gives_o_its_own_tile_and_takes_tiles_by_one_atomic(compiled, name, base):
    """Note [Persistent work tiles]: O's shared tile is a region of its own (the storage grows by Q's tile, which O
    no longer overlays: tile_m x head_dim e4m3 bytes, O being tile_m x head_dim BF16, twice that); Note [Dynamic
    persistent order]: one global atomic per work tile, in the producer warp, and the same main loop (QGMMA,
    register split, per-element work as the one-CTA-per-tile kernel)."""
    kwargs, ops = compiled[name]
    _, base_ops = compiled[base]
    tile_m, head_dim = kwargs.get("tile_m", 128), kwargs.get("head_dim", 128)
    assert ops[SHARED_STORAGE] - base_ops[SHARED_STORAGE] == tile_m * head_dim
    atomics = {op: n for op, n in ops.items() if op.startswith(("ATOM", "RED"))}
    assert atomics == {"ATOMG.E.ADD.STRONG.GPU": 1}, atomics
    assert not any(op.startswith(("ATOM", "RED")) for op in base_ops)
    assert ops[CONSUMER_REGISTERS] == base_ops[CONSUMER_REGISTERS]
    for op in ("FFMA", "FFMA.SAT", "MUFU.EX2"):
        assert count(ops, op) == count(base_ops, op), op
    assert abs(count(ops, "PRMT") - count(base_ops, "PRMT")) <= 4  # the H15 pack's 3 a word, beside a few of FA4's
    assert {op: n for op, n in ops.items() if op.startswith("QGMMA")} == {
        op: n for op, n in base_ops.items() if op.startswith("QGMMA")
    }
    # Note [O store wait on the persistent grid]: FA4's grid waits for O's store right after it (then exits); the
    # persistent grid waits before the next tile's epilogue and before the CTA exits, not after the store.
    assert (base_ops[O_STORE_WAITS], base_ops[O_STORE_WAITS_AT_STORE]) == (1, 1)
    assert (ops[O_STORE_WAITS], ops[O_STORE_WAITS_AT_STORE]) == (2, 0)


# The columns and shared-memory offsets FA4's epilogue store (its StMatrix copy of the P.V accumulator, `epilogue` in
# flash_fwd.py) touches for O tiles of each width, traced for sm_90a without a GPU; prints JSON {columns: [largest
# column, largest offset in BF16 elements, the tile's cosize]}.
_EPILOGUE_EXTENT_WORKER = """
import json
import cutlass, cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils_basic
from cutlass.cute.nvgpu import warpgroup
from cutlass.utils import LayoutEnum
from quack import sm90_utils
from flash_attn.cute import utils

TILE_M = 128
extents = {}

@cute.jit
def extent(columns: cutlass.Constexpr[int]):
    tiled_mma = sm90_utils_basic.make_trivial_tiled_mma(
        cutlass.Float8E4M3FN, cutlass.Float8E4M3FN, warpgroup.OperandMajorMode.K, warpgroup.OperandMajorMode.K,
        cutlass.Float32, atom_layout_mnk=(TILE_M // 64, 1, 1), tiler_mn=(64, columns),
        a_source=warpgroup.OperandSource.RMEM)
    sO_layout = sm90_utils.make_smem_layout(cutlass.BFloat16, LayoutEnum.ROW_MAJOR, (TILE_M, columns), None)
    tiled_copy = cute.make_tiled_copy_C(utils.get_smem_store_atom(90, cutlass.BFloat16), tiled_mma)
    coord = cute.make_identity_tensor((TILE_M, columns))
    max_col, max_offset = 0, 0
    for t in cutlass.range_constexpr(TILE_M * 2):
        part = tiled_copy.get_slice(t).partition_D(coord)
        for i in cutlass.range_constexpr(cute.size(part)):
            row, col = part[i]
            max_col = max(max_col, col)
            max_offset = max(max_offset, cute.crd2idx((row, col), sO_layout.outer))
    extents[columns] = [int(max_col), int(max_offset), int(cute.cosize(sO_layout))]

for n in (64, 72, 128, 136):
    extent(n)
print(json.dumps(extents))
"""


def test_fa4_epilogue_stores_past_an_o_tile_of_an_odd_count_of_8_column_atoms(tmp_path):
    """Note [Persistent work tiles]: FA4's epilogue stores O's tile through StMatrix, 16 columns per pair of
    8-column chunks, so an O tile of head_dim + 8 columns (row_sum="mma", o_store="pv_columns": 72 or 136) is cut
    into ceil(N / 16) chunks and the upper half-warp's last chunk lands at columns N..N+7: tile_m x 8 BF16 past the
    tile's shared layout. That is why the persistent grid, whose O tile ends the allocation, refuses that store, and
    why o_store="head_dim" (64 or 128 columns) is safe on it."""
    env = dict(os.environ, **compile_check.ARCH_ENV["sm90"], PYTHONWARNINGS="ignore")
    worker = tmp_path / "epilogue_extent.py"  # the DSL compiles from a function's source file
    worker.write_text(_EPILOGUE_EXTENT_WORKER)
    proc = subprocess.run([sys.executable, str(worker)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    extents = {int(n): v for n, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}
    tile_m = 128
    for columns, (max_col, max_offset, cosize) in extents.items():
        assert cosize == tile_m * columns
        if columns % 16 == 0:
            assert (max_col, max_offset) == (columns - 1, cosize - 1), columns
        else:
            assert (max_col, max_offset) == (columns + 7, cosize + tile_m * 8 - 1), columns


@pytest.mark.parametrize(
    "name, base",
    [
        (
            "h15_sat_mma_n256_nooverlap_o_head_dim_persistent_masked_half",
            "h15_sat_mma_n256_nooverlap_o_head_dim_persistent",
        ),
        (
            "exact_mma_n256_nooverlap_o_head_dim_persistent_masked_half",
            "exact_mma_n256_nooverlap_o_head_dim_persistent",
        ),
    ],
)
def test_the_masked_half_is_skipped_by_half_gemms_on_the_first_tile_alone(compiled, name, base):
    """Note [The masked half of the first KV tile]: the first KV tile's S GEMM runs as two at N = tile_n/2
    (head_dim/32 k32 steps each; the second only where the tile does not qualify), its P.V GEMM gains a copy over
    tile_n/64 k32 steps; the other tiles' GEMMs are the base's, the softmax is not duplicated (its per-element
    instructions are the base's), nothing spills, the register split is the same, and the wgmmas stay pipelined
    (ptxas's C7511 serialization puts a WARPGROUP.ARRIVE before every QGMMA)."""
    kwargs, ops = compiled[name]
    _, base_ops = compiled[base]
    tile_n, head_dim = kwargs["tile_n"], kwargs.get("head_dim", 128)
    s_half, s_full, pv = (f"QGMMA.64x{n}x32.F32.E4M3.E4M3" for n in (tile_n // 2, tile_n, _pv_n(kwargs)))
    assert ops[s_half] == 2 * (head_dim // 32) and base_ops[s_half] == 0
    assert base_ops[s_full] - ops[s_full] == head_dim // 32
    assert ops[pv] - base_ops[pv] == tile_n // 64
    assert ops[MAIN_LOOP_LOCAL] == 0 and ops[CONSUMER_REGISTERS] == base_ops[CONSUMER_REGISTERS]
    assert count(ops, "WARPGROUP.ARRIVE") <= count(ops, "QGMMA") // 4
    for op in ("MUFU.EX2", "FFMA.SAT", "PRMT", "FMNMX.NAN", "F2FP"):
        assert count(ops, op) == count(base_ops, op), op


@pytest.mark.parametrize(
    "name", sorted(n for n in CONFIGS if n.endswith("_persistent_own")), ids=lambda n: n.removesuffix("_own")
)
def test_each_warpgroup_ends_its_tiles_alone(compiled, name):
    """Note [Each warpgroup's own tile boundary] beside the same configuration with FA4's shared boundary: the same
    GEMMs and per-element code; no TMA store and no barrier of every consumer thread (FA4's epilogue barrier, the
    shared slot barrier: 32 + 128 x warpgroups threads); instead each warpgroup's two epilogue barriers and its slot
    barrier (128 and 160 threads), the producer arriving at each warpgroup's; O's 64 rows x 128 columns of BF16 stored
    by 128 threads in 16-byte pieces (8 a thread); Q released in each of the tile's block steps (one, causal: the
    first, the masked and the unmasked loop) in place of FA4's one release after the loop; no more local memory in
    the main loop than the shared boundary's bound."""
    kwargs, ops = compiled[name]
    _, base = compiled[name.removesuffix("_own")]
    warpgroups = kwargs["tile_m"] // 64
    shared_threads = 32 + 128 * warpgroups
    for op in ("QGMMA", "FFMA", "FFMA.SAT", "MUFU.EX2", "ATOMG"):
        assert count(ops, op) == count(base, op), (op, count(ops, op), count(base, op))
    assert ops[PRMT_MOVES] == base[PRMT_MOVES]
    assert count(base, "UTMASTG") > 0 and count(ops, "UTMASTG") == 0
    assert base[BAR_THREADS.format("SYNC", shared_threads)] > 0 and base[BAR_THREADS.format("ARV", shared_threads)] > 0
    assert ops[BAR_THREADS.format("SYNC", shared_threads)] == ops[BAR_THREADS.format("ARV", shared_threads)] == 0
    # FA4's epilogue barrier counts every consumer thread, as two warpgroups' scheduler barriers do
    consumers = 128 * warpgroups
    assert ops[BAR_THREADS.format("SYNC", consumers)] == base[BAR_THREADS.format("SYNC", consumers)] - 1
    assert ops[BAR_THREADS.format("SYNC", 128)] == 2 and ops[BAR_THREADS.format("SYNC", 160)] == 1
    assert ops[BAR_THREADS.format("ARV", 160)] == warpgroups
    assert (count(ops, "STG.E.128"), count(ops, "LDS.128")) == (64 * 128 * 2 // (128 * 16),) * 2
    steps = 3 if kwargs.get("causal", True) else 2
    assert count(ops, "SYNCS.ARRIVE") - count(base, "SYNCS.ARRIVE") == steps - 1
    assert ops[MAIN_LOOP_LOCAL] <= MAIN_LOOP_LOCAL_BOUND.get(name.removesuffix("_own"), 0), ops[MAIN_LOOP_LOCAL]


def test_the_masked_half_and_the_own_boundary_compose(compiled):
    """Both knobs at once: the masked half's GEMMs (those of its own compile beside the defaults) and the own
    boundary's stores, no local memory in the main loop, the wgmmas still pipelined (no C7511 serialization: a
    WARPGROUP.ARRIVE per four QGMMA at most)."""
    _, ops = compiled["both_h15_sat_mma_n256_nooverlap_o_head_dim_persistent"]
    _, masked = compiled["h15_sat_mma_n256_nooverlap_o_head_dim_persistent_masked_half"]
    _, own = compiled["h15_sat_mma_n256_nooverlap_o_head_dim_persistent_own"]
    assert {op: n for op, n in ops.items() if op.startswith("QGMMA")} == {
        op: n for op, n in masked.items() if op.startswith("QGMMA")
    }
    for op in ("STG.E.128", "LDS.128", "UTMASTG"):
        assert count(ops, op) == count(own, op), op
    assert ops[MAIN_LOOP_LOCAL] == 0 and ops[CONSUMER_REGISTERS] == own[CONSUMER_REGISTERS]
    assert count(ops, "WARPGROUP.ARRIVE") <= count(ops, "QGMMA") // 4
