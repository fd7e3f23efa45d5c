"""The SM90 FP8 forward (`fa4_rowmax.fp8_sm90`) on a Hopper GPU against the semantic reference; input checks on the CPU.

GPU tests carry `pytest.mark.gpu(arch="sm90")` (Note [GPU tests] in conftest.py). Every kernel output is compared with
`attention_reference` (FP8 inputs, max_offset 8, the kernel's tile_n and anchor) within per-row bounds derived
in `fa4_rowmax.gates.tolerances.fp8_kernel_bounds` (Note [FP8 kernel vs reference bounds]), with fresh random
inputs, output memory poisoned with NaN first, seqlens off the tile grid, GQA, causal with seqlen_q != seqlen_k
(rows with no key) and descales. P's bytes are read back exactly through a one-hot V (`test_p_bytes_*`).
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers_fp8 import poison_allocator, random_descales, stale_small_blocks

from fa4_rowmax.config import FP8_MAX_OFFSET, SoftmaxConfig
from fa4_rowmax.gates.tolerances import EX2_EMULATION_REL_ERROR, fp8_kernel_bounds

E4M3 = torch.float8_e4m3fn


def _inputs(seed, batch, sq, sk, hq, hk, d, q_std=1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randn(batch, sq, hq, d, device="cuda", generator=gen) * q_std).to(E4M3)
    k = torch.randn(batch, sk, hk, d, device="cuda", generator=gen).to(E4M3)
    v = torch.randn(batch, sk, hk, d, device="cuda", generator=gen).to(E4M3)
    return q, k, v


def _check_against_reference(q, k, v, causal, mode, descales=None, **levers):
    from fa4_rowmax.fp8_sm90 import call_stage, flash_attn_fp8_sm90
    from fa4_rowmax.reference.attention import attention_reference

    stage = call_stage(
        mode,
        q.shape[-1],
        causal,
        beta=levers.get("beta"),
        qhead_per_kvhead=q.shape[2] // k.shape[2],
        **{n: x for n, x in levers.items() if n != "beta"},
    )
    poison_allocator()
    dq, dk, dv = descales if descales is not None else (None, None, None)
    out, lse = flash_attn_fp8_sm90(
        q, k, v, causal=causal, softmax_mode=mode, q_descale=dq, k_descale=dk, v_descale=dv, **levers
    )
    config = SoftmaxConfig(
        mode=mode,
        max_offset=FP8_MAX_OFFSET,
        tile_n=stage.tile_n,
        anchor_rounding=stage.anchor_rounding,
        beta=levers.get("beta"),
    )
    ref_out, ref_lse = attention_reference(q, k, v, config, causal=causal, q_descale=dq, k_descale=dk, v_descale=dv)
    out_bound, lse_bound = fp8_kernel_bounds(
        q, k, v, config, causal, descales, stage.row_sum == "mma", pv_accumulation=stage.pv_accumulation
    )
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    no_key = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), no_key), "rows with no key differ"
    assert not torch.isnan(out).any(), "NaN in the output (unwritten or poisoned)"
    assert (out.float()[no_key.transpose(1, 2)] == 0).all(), "rows with no key must be 0"
    lse_err = (lse - ref_lse).abs().where(~no_key, 0.0)
    assert (lse_err <= lse_bound).all(), f"LSE off by {float((lse_err - lse_bound).max()):.3g} beyond its bound"
    out_err = (out.float() - ref_out.float()).abs().amax(-1, keepdim=True)
    assert (out_err <= out_bound).all(), f"out off by {float((out_err - out_bound).max()):.3g} beyond its bound"


SHAPES = [  # batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim
    (1, 128, 128, 2, 2, 128),
    (2, 1000, 1000, 4, 4, 128),
    (2, 777, 1531, 8, 2, 128),
    (1, 1531, 777, 4, 4, 128),  # causal: the first 754 rows see no key
    (2, 513, 513, 4, 1, 64),
    (1, 300, 2049, 2, 2, 64),
    (1, 700, 1100, 14, 2, 64),  # GQA 7 (Qwen2.5-0.5B): not packed (Note [GQA packing on FP8])
    (2, 333, 333, 12, 2, 128),  # GQA 6 (Qwen2.5-1.5B)
]


@pytest.mark.parametrize("mode", ["exact", "rowmax_h15"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.gpu(arch="sm90")
def test_matches_reference(shape, causal, mode):
    q, k, v = _inputs(hash((shape, causal, mode)) % 2**31, *shape)
    _check_against_reference(q, k, v, causal, mode)


LEVERS = [
    dict(softmax_mode="exact", tile_n=192),
    dict(softmax_mode="exact", tile_n=192, row_sum="mma", rescale_vote=True, pv_accumulation="single"),
    dict(softmax_mode="exact", tile_n=192, row_sum="mma", beta=0.25),
    dict(softmax_mode="rowmax_h15", tile_n=192),
    dict(softmax_mode="rowmax_h15", anchor_rounding="half_octave"),
    dict(
        softmax_mode="rowmax_h15",
        anchor_rounding="half_octave",
        tile_n=192,
        row_sum="mma",
        rescale_vote=True,
        pv_accumulation="single",
    ),
    dict(softmax_mode="rowmax_h15", clamp="sat", row_sum="mma", pv_accumulation="single"),
    dict(softmax_mode="rowmax_h15", clamp="sat", row_sum="mma", tile_n=224, intra_wg_overlap=False),
    dict(softmax_mode="exact", row_sum="mma", tile_n=192, intra_wg_overlap=False),
    dict(softmax_mode="exact", tile_n=224, intra_wg_overlap=False, pv_accumulation="single"),
    dict(softmax_mode="rowmax_h15", clamp="sat", row_sum="mma", tile_n=256, intra_wg_overlap=False),
    dict(
        softmax_mode="rowmax_h15", clamp="sat", row_sum="mma", tile_n=224, intra_wg_overlap=False, arrive_after_pv=True
    ),
    dict(softmax_mode="exact", row_sum="mma", tile_n=256, intra_wg_overlap=False, arrive_after_pv=True),
    dict(softmax_mode="exact", row_sum="mma", tile_n=256, intra_wg_overlap=False),  # the hd64-causal candidate
    dict(softmax_mode="rowmax_h15", rescale_threshold=0.4),
    dict(softmax_mode="rowmax_h15", clamp="sat", tile_n=192, row_sum="mma"),
    # three consumer warpgroups (Note [Three consumer warpgroups])
    dict(softmax_mode="rowmax_h15", clamp="sat", row_sum="mma", tile_m=192, tile_n=128, intra_wg_overlap=False),
    dict(softmax_mode="exact", row_sum="mma", tile_m=192, tile_n=160, intra_wg_overlap=False),
]


@pytest.mark.parametrize("levers", LEVERS, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
@pytest.mark.parametrize("shape", [SHAPES[2], SHAPES[4], (1, 300, 2048, 2, 2, 128)])  # 2048: MMA_ROW_SUM_MAX_KEYS
@pytest.mark.gpu(arch="sm90")
def test_levers_match_reference(shape, levers):
    levers = dict(levers)
    mode = levers.pop("softmax_mode")
    threshold = levers.pop("rescale_threshold", None)
    q, k, v = _inputs(7, *shape)
    if threshold is None:
        _check_against_reference(q, k, v, True, mode, **levers)
    else:
        # A stale max moves which tile anchors a row; the reference models it (SoftmaxConfig.rescale_threshold).
        from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90
        from fa4_rowmax.reference.attention import attention_reference

        out, lse = flash_attn_fp8_sm90(q, k, v, causal=True, softmax_mode=mode, rescale_threshold=threshold)
        config = SoftmaxConfig(mode=mode, max_offset=FP8_MAX_OFFSET, rescale_threshold=threshold)
        ref_out, ref_lse = attention_reference(q, k, v, config, causal=True)
        # Each row's anchor may differ (keep vs move within delta): bounded by the lattice envelope.
        env = math.log2(1.5)
        finite = torch.isfinite(ref_lse)
        assert ((lse - ref_lse).abs()[finite] <= math.log(2.0) * env).all()
        assert ((out.float() - ref_out.float()).abs() <= 2 * (2**env - 1) * v.float().abs().max()).all()


O_STORE_CASES = [  # shape index, causal, mode, knobs beside row_sum="mma" (the tuned tilings and FA4's overlapped one)
    (1, False, "rowmax_h15", dict(clamp="sat", tile_m=192, tile_n=160, intra_wg_overlap=False)),
    (2, True, "rowmax_h15", dict(clamp="sat", tile_m=128, tile_n=256, intra_wg_overlap=False)),  # GQA 4, packed
    (3, True, "exact", dict(tile_m=128, tile_n=256, intra_wg_overlap=False)),  # rows that see no key
    (4, False, "rowmax_h15", dict(clamp="sat", tile_m=128, tile_n=192, intra_wg_overlap=True)),  # head dim 64
    (6, True, "exact", dict(tile_m=192, tile_n=128, intra_wg_overlap=False)),  # GQA 7, unpacked, head dim 64
    (7, False, "exact", dict(tile_m=192, tile_n=160, intra_wg_overlap=False, scheduler_barrier=True)),  # GQA 6
]


@pytest.mark.parametrize(
    "case",
    O_STORE_CASES,
    ids=lambda c: "-".join([str(SHAPES[c[0]]), "causal" if c[1] else "full", c[2], *map(str, c[3].values())]),
)
@pytest.mark.gpu(arch="sm90")
def test_o_without_the_row_sum_columns_is_bit_identical(case):
    """Note [O's tile without the row-sum columns]: o_store="head_dim" changes where O's tile is staged and how it
    is stored, not a value: out and LSE equal o_store="pv_columns"'s bit for bit, every other knob equal, on
    off-grid seqlens, GQA packed and not, causal rows that see no key, head dim 64 and 128, a NaN score in a row
    that sees keys, output memory poisoned with NaN first."""
    from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90

    shape_index, causal, mode, knobs = case
    q, k, v = _inputs(hash(str(case)) % 2**31, *SHAPES[shape_index])
    q[0, -5, 0, 3] = math.nan
    common = dict(causal=causal, softmax_mode=mode, row_sum="mma", **knobs)
    poison_allocator()
    out_wide, lse_wide = flash_attn_fp8_sm90(q, k, v, o_store="pv_columns", **common)
    poison_allocator()
    out_narrow, lse_narrow = flash_attn_fp8_sm90(q, k, v, o_store="head_dim", **common)
    assert torch.isnan(out_wide).any() and not torch.isnan(out_wide).all()
    assert torch.equal(out_narrow.view(torch.int16), out_wide.view(torch.int16))
    assert torch.equal(lse_narrow.view(torch.int32), lse_wide.view(torch.int32))


TILE_M_CASES = [  # shape index, causal, mode, knobs beside tile_m and intra_wg_overlap=False
    (2, True, "rowmax_h15", dict(clamp="sat", row_sum="mma", tile_n=128)),  # GQA 4, packed at both
    (3, True, "rowmax_h15", dict(clamp="sat", row_sum="mma", tile_n=160)),  # rows that see no key
    (7, False, "rowmax_h15", dict(clamp="sat", tile_n=128)),  # GQA 6: packed at 192 only
    (6, True, "rowmax_h15", dict(anchor_rounding="half_octave", row_sum="mma", tile_n=160)),  # GQA 7, head dim 64
    (2, False, "exact", dict(row_sum="mma", tile_n=128)),
    (4, True, "exact", dict(tile_n=160, beta=0.25)),  # head dim 64, GQA 4
    (3, True, "exact", dict(row_sum="mma", tile_n=128)),
]


def _most_kv_stages(head_dim, tile_m, knobs):
    from fa4_rowmax.config import FP8_KV_STAGES
    from fa4_rowmax.fp8_sm90 import SMEM_PER_BLOCK, shared_memory_bytes

    row_sum = knobs.get("row_sum", "fadd")
    return max(
        n for n in FP8_KV_STAGES if shared_memory_bytes(head_dim, tile_m, knobs["tile_n"], n, row_sum) <= SMEM_PER_BLOCK
    )


@pytest.mark.parametrize(
    "structure",
    [
        "tile_m=192",
        "tile_m=192, most kv_stages",
        "most kv_stages",
        "tile_m=192, scheduler barrier",
        "tile_m=192, scheduler barrier, arrive after P.V",
    ],
)
@pytest.mark.parametrize(
    "case",
    TILE_M_CASES,
    ids=lambda c: "-".join([str(SHAPES[c[0]]), "causal" if c[1] else "full", c[2], *map(str, c[3].values())]),
)
@pytest.mark.gpu(arch="sm90")
def test_three_warpgroups_and_kv_stages_are_bit_identical(case, structure):
    """Note [Three consumer warpgroups], Note [KV stages in shared memory]: a row's arithmetic depends neither on
    tile_m, on the order the warpgroups take the tensor pipe in, nor on how many K/V tiles are in flight, so
    tile_m=192 (with and without the round-robin scheduler barrier) and the most kv_stages that fit give the out
    and LSE of tile_m=128 with two stages bit for bit, every other knob equal: off-grid seqlens, GQA 4 (packed at both),
    6 (packed at 192 only) and 7 (unpacked), causal rows that see no key, head dim 64, a NaN score in a row that
    sees keys and an e4m3-max key entry, output memory poisoned with NaN first. The most stages also show that
    `shared_memory_bytes` does not undercount: a block past the SM's shared memory does not launch."""
    from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90

    shape_index, causal, mode, knobs = case
    head_dim = SHAPES[shape_index][-1]
    tile_m = 192 if "tile_m=192" in structure else 128
    kv_stages = _most_kv_stages(head_dim, tile_m, knobs) if "kv_stages" in structure else 2
    assert (tile_m, kv_stages) != (128, 2)
    q, k, v = _inputs(hash((str(case), structure)) % 2**31, *SHAPES[shape_index])
    q[0, -5, 0, 3] = math.nan  # the last rows see keys under either causal alignment
    k[-1, 17, -1, 9] = 448.0
    # Every structural knob named, so Note [Tuned defaults], whose entries differ between tile_m 128 and 192, moves
    # nothing between the two calls.
    structural = dict(row_sum="fadd", **({"clamp": "max"} if mode == "rowmax_h15" else {}))
    common = dict(causal=causal, softmax_mode=mode, intra_wg_overlap=False, **{**structural, **knobs})
    poison_allocator()
    out2, lse2 = flash_attn_fp8_sm90(q, k, v, tile_m=128, kv_stages=2, **common)
    poison_allocator()
    barrier = {}
    if "scheduler barrier" in structure:
        barrier["scheduler_barrier"] = True
    if "arrive after" in structure:
        barrier["arrive_after_pv"] = True
    out3, lse3 = flash_attn_fp8_sm90(q, k, v, tile_m=tile_m, kv_stages=kv_stages, **barrier, **common)
    assert torch.isnan(out2).any() and not torch.isnan(out2).all(), "the NaN score must reach some rows, not all"
    assert torch.equal(out3.view(torch.int16), out2.view(torch.int16)), f"out differs at {structure} ({kv_stages})"
    assert torch.equal(lse3.view(torch.int32), lse2.view(torch.int32)), f"LSE differs at {structure} ({kv_stages})"


@pytest.mark.parametrize("beta", [0.25, 0.5, 1.0])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [SHAPES[1], SHAPES[3], SHAPES[5]])
@pytest.mark.gpu(arch="sm90")
def test_exact_beta_matches_reference(shape, causal, beta):
    """Note [beta on the FP8 exact twin]: the emulated share changes exact's values only within the bounds, whose
    delta carries the emulation's error (Note [FP8 kernel vs reference bounds]); off-grid seqlens, rows with no
    key (SHAPES[3] causal), head dim 64 over 2049 keys (SHAPES[5]); tile_n 192 with the odd beta."""
    q, k, v = _inputs(hash((shape, causal, beta)) % 2**31, *shape)
    _check_against_reference(q, k, v, causal, "exact", beta=beta, **(dict(tile_n=192) if beta == 0.25 else {}))


@pytest.mark.gpu(arch="sm90")
@pytest.mark.parametrize("row_sum", ["fadd", "mma"])
def test_clamp_by_saturation_is_bit_identical(row_sum):
    """Note [Clamp by saturation]: clamp="sat" gives rowmax_h15's out and LSE bit for bit."""
    from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90

    q, k, v = _inputs(5, *SHAPES[2])
    q[0, 3, 1, 7] = math.nan
    base = flash_attn_fp8_sm90(q, k, v, causal=True, softmax_mode="rowmax_h15", row_sum=row_sum, tile_n=192)
    sat = flash_attn_fp8_sm90(q, k, v, causal=True, softmax_mode="rowmax_h15", row_sum=row_sum, tile_n=192, clamp="sat")
    for a, b in zip(base, sat):
        assert torch.equal(
            a.view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32),
            b.view(torch.int16 if b.dtype == torch.bfloat16 else torch.int32),
        )


ARRIVE_CASES = [  # (mode, knobs): the tuned hd128 configurations and single-level, at both large tiles
    ("rowmax_h15", dict(clamp="sat", row_sum="mma", tile_n=224)),
    ("rowmax_h15", dict(clamp="sat", row_sum="mma", tile_n=256)),
    ("exact", dict(row_sum="mma", tile_n=192)),
    ("exact", dict(tile_n=224, pv_accumulation="single")),
]


@pytest.mark.gpu(arch="sm90")
@pytest.mark.parametrize("mode,knobs", ARRIVE_CASES, ids=str)
@pytest.mark.parametrize(
    "shape,causal",
    [
        ((2, 777, 1531, 8, 2, 128), True),
        ((1, 1531, 777, 4, 4, 128), True),  # rows with no key: work tiles whose only block is n_block -1
        ((3, 1000, 4099, 4, 4, 128), False),  # more work tiles than one wave: the persistent loop
        ((2, 513, 513, 4, 1, 64), False),
        ((1, 64, 2176, 2, 2, 128), True),  # off the 256 grid
    ],
    ids=str,
)
def test_arrive_after_pv_is_bit_identical(shape, causal, mode, knobs):
    """Note [Scheduler window after the P.V GEMM]: the hand-over moves only the order in which the two warpgroups
    issue, never what either computes, so out and LSE equal FA4's hand-over bit for bit; a miscounted barrier would
    hang or leave work tiles unwritten (the output memory is poisoned with NaN first)."""
    from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90

    q, k, v = _inputs(hash((shape, causal, mode)) % 2**31, *shape)
    q[0, 3, 1, 7] = math.nan
    results = []
    for arrive_after_pv in (False, True):
        poison_allocator()
        results.append(
            flash_attn_fp8_sm90(
                q,
                k,
                v,
                causal=causal,
                softmax_mode=mode,
                intra_wg_overlap=False,
                arrive_after_pv=arrive_after_pv,
                **knobs,
            )
        )
    torch.cuda.synchronize()
    for a, b in zip(*results):
        view = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
        assert torch.equal(a.view(view), b.view(view))


def _assert_bit_identical(results: list) -> None:
    """Every (out, LSE) of `results` equals the first bit for bit; the first's out is finite past the NaN of q's first
    batch (the poisoned memory was written)."""
    torch.cuda.synchronize()
    assert torch.isfinite(results[0][0][1:].float()).all()
    for result in results[1:]:
        for a, b in zip(results[0], result):
            view = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
            assert torch.equal(a.view(view), b.view(view))


# Note [Persistent work tiles]: (shape (batch, seqlen_q, seqlen_k, heads_q, heads_kv, head_dim), causal, mode, knobs,
# descales). Every shape but the last gives most CTAs several work tiles (132 SMs).
PERSISTENT_CASES = [
    ((2, 4096, 4096, 16, 16, 128), True, "rowmax_h15", {}, False),  # the defaults: tile_m 128, tile 256; 1,024 tiles
    ((2, 4096, 4096, 16, 16, 128), True, "exact", {}, True),  # with descales: the counter is the second aux tensor
    ((4, 2048, 2048, 16, 4, 128), True, "rowmax_h15", {}, True),  # causal GQA packed: three warpgroups (416 threads)
    ((3, 1000, 4099, 16, 16, 128), False, "rowmax_h15", {}, False),  # non-causal defaults, off the tile grid
    ((3, 1000, 4099, 16, 16, 128), False, "exact", {}, False),
    ((2, 777, 1531, 8, 2, 128), True, "rowmax_h15", {"tile_n": 192, "intra_wg_overlap": True}, False),  # overlap
    ((1, 1531, 777, 16, 16, 128), True, "exact", {"pv_accumulation": "single"}, False),  # rows with no key
    ((8, 1024, 1024, 14, 2, 64), True, "rowmax_h15", {}, False),  # head dim 64, GQA 7 unpacked (Qwen2.5-0.5B)
    ((8, 1024, 1024, 16, 16, 64), False, "exact", {}, False),  # head dim 64: the round-robin barrier
    ((1, 100, 300, 1, 1, 128), False, "rowmax_h15", {}, False),  # one work tile: a grid of one CTA
    # O's tile at head_dim + 8 columns, which FA4's epilogue overruns by tile_m x 8 (o_store_overrun): 72 columns at
    # tile 192 faulted before O's region held the overrun; 136 columns at the head-dim-128 defaults.
    ((8, 1024, 1024, 16, 16, 64), True, "exact", {"tile_m": 128, "tile_n": 192, "o_store": "pv_columns"}, False),
    ((2, 4096, 4096, 16, 16, 128), True, "rowmax_h15", {"o_store": "pv_columns"}, False),
    # One KV tile per work tile: each epilogue follows the last O store by one tile's work, the shortest window for
    # the store warp's deferred wait (Note [O store wait on the persistent grid]); 4,096 work tiles.
    ((64, 512, 64, 16, 16, 128), False, "rowmax_h15", {}, False),
    ((64, 512, 64, 16, 16, 128), True, "exact", {}, False),
]


@pytest.mark.gpu(arch="sm90")
@pytest.mark.parametrize("shape, causal, mode, knobs, descales", PERSISTENT_CASES, ids=str)
def test_persistent_grid_is_bit_identical(shape, causal, mode, knobs, descales):
    """Note [Persistent work tiles]: a persistent grid changes which CTA runs a work tile and when, never what it
    computes, so out and LSE equal FA4's one-CTA-per-tile grid bit for bit (a NaN in q included). A tile taken twice or
    never (Note [Dynamic persistent order]), the next Q loaded over O in shared memory, or softmax state carried from
    a CTA's previous tile would show (the output memory is poisoned with NaN first; two runs, since the order in which
    CTAs take tiles changes from run to run). The tile counter's memory starts stale, as an earlier call leaves it:
    only the pre-pass's 0 lets the grid take its tiles (Note [The counter zeroed by the pre-pass])."""
    from fa4_rowmax.fp8_sm90 import _sm_count, flash_attn_fp8_sm90
    from fa4_rowmax.stage.tile_scheduler_sm90 import semaphore_numel

    q, k, v = _inputs(hash((shape, causal, mode, "persistent")) % 2**31, *shape)
    q[0, shape[1] // 2, 0, 5] = math.nan
    names = ("q_descale", "k_descale", "v_descale")
    scales = dict(zip(names, random_descales(3, shape[0], shape[4]))) if descales else {}
    results = []
    for persistent in (False, True, True):
        poison_allocator()
        stale_small_blocks(semaphore_numel(_sm_count(q.device, False)), 2**30)
        results.append(
            flash_attn_fp8_sm90(q, k, v, causal=causal, softmax_mode=mode, persistent=persistent, **knobs, **scales)
        )
    _assert_bit_identical(results)


# Note [The masked half of the first KV tile]: (shape, causal, mode, knobs, descales). Two-level, no intra-warpgroup
# overlap; the tiles that qualify differ per case: every other m block on the causal diagonal at tile_m 128 / tile_n
# 256 (the defaults at head dim 128 causal MHA), a third at tile 192, the packed GQA diagonal, keys ending in a
# tile's first half without a causal mask, rows that see no key, three warpgroups at tile 128.
MASKED_HALF_CASES = [
    ((2, 4096, 4096, 16, 16, 128), True, "rowmax_h15", {}, False),
    ((2, 4096, 4096, 16, 16, 128), True, "exact", {}, True),
    ((4, 2048, 2048, 16, 4, 128), True, "rowmax_h15", {"tile_m": 128, "tile_n": 256}, True),  # packed GQA diagonal
    ((3, 1000, 4099, 16, 16, 128), False, "rowmax_h15", {"tile_m": 128, "tile_n": 256}, False),  # 4099 = 16 x 256 + 3
    ((2, 777, 1531, 8, 2, 128), True, "exact", {"tile_n": 192, "persistent": False}, False),
    ((1, 1531, 777, 16, 16, 128), True, "rowmax_h15", {"tile_n": 128, "persistent": True}, False),  # rows with no key
    ((8, 1024, 1024, 16, 16, 64), True, "rowmax_h15", {"tile_n": 256, "intra_wg_overlap": False}, False),
    ((2, 2048, 2048, 12, 2, 128), True, "exact", {"tile_m": 192, "tile_n": 128}, False),  # three warpgroups
]


@pytest.mark.gpu(arch="sm90")
@pytest.mark.parametrize("shape, causal, mode, knobs, descales", MASKED_HALF_CASES, ids=str)
def test_skipping_the_masked_half_is_bit_identical(shape, causal, mode, knobs, descales):
    """Note [The masked half of the first KV tile]: with finite V the skipped GEMM steps would add 0 x V, so out and
    LSE equal the full tile's bit for bit (a NaN in q included; output memory poisoned with NaN first)."""
    from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90

    q, k, v = _inputs(hash((shape, causal, mode, "masked_half")) % 2**31, *shape)
    q[0, shape[1] // 2, 0, 5] = math.nan
    names = ("q_descale", "k_descale", "v_descale")
    scales = dict(zip(names, random_descales(3, shape[0], shape[4]))) if descales else {}
    results = []
    for masked_half in ("compute", "skip"):
        poison_allocator()
        results.append(
            flash_attn_fp8_sm90(q, k, v, causal=causal, softmax_mode=mode, masked_half=masked_half, **knobs, **scales)
        )
    torch.cuda.synchronize()
    assert torch.isfinite(results[0][0][1:].float()).all()
    for a, b in zip(*results):
        view = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
        assert torch.equal(a.view(view), b.view(view))


@pytest.mark.gpu(arch="sm90")
@pytest.mark.parametrize("mode", ["exact", "rowmax_h15"])
def test_a_nan_in_the_skipped_half_reaches_no_row(mode):
    """Note [The masked half of the first KV tile]: causal, tile_m 128, tile_n 256: rows 0-127 see keys 0-127 only, so
    their first (and only) KV tile's second half is skipped, and a NaN in V at key 200 no longer reaches them through
    0 x NaN: they equal the output with that key's V zeroed, bit for bit, while the full tile's GEMM (compute) makes
    them NaN. Rows 200 and after see the key and are NaN either way."""
    from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90

    q, k, v = _inputs(20261204, 1, 512, 512, 2, 2, 128)
    v_nan = v.clone()
    v_nan[0, 200, 0, 7] = math.nan
    v_zero = v.clone()
    v_zero[0, 200, 0, 7] = 0
    knobs = dict(causal=True, softmax_mode=mode, tile_m=128, tile_n=256, intra_wg_overlap=False)
    skip = flash_attn_fp8_sm90(q, k, v_nan, masked_half="skip", **knobs)[0]
    compute = flash_attn_fp8_sm90(q, k, v_nan, masked_half="compute", **knobs)[0]
    clean = flash_attn_fp8_sm90(q, k, v_zero, masked_half="skip", **knobs)[0]
    torch.cuda.synchronize()
    assert torch.equal(skip[0, :128, 0].view(torch.int16), clean[0, :128, 0].view(torch.int16))
    assert torch.isfinite(skip[0, :128, 0].float()).all()
    assert torch.isnan(compute[0, :128, 0, 7].float()).all()
    assert torch.isnan(skip[0, 200:, 0, 7].float()).all() and torch.isnan(compute[0, 200:, 0, 7].float()).all()
    assert torch.isfinite(skip[0, :, 1].float()).all()  # the other head has no NaN


# Note [Each warpgroup's own tile boundary]: (shape, causal, mode, knobs, descales); every case on the persistent grid,
# unpacked (MHA, or a head ratio tile_m does not divide).
OWN_BOUNDARY = dict(warpgroup_epilogue="own", persistent=True, intra_wg_overlap=False)
OWN_BOUNDARY_CASES = [
    ((2, 4096, 4096, 16, 16, 128), True, "rowmax_h15", {}, False),  # the defaults: two warpgroups, tile 256
    ((2, 4096, 4096, 16, 16, 128), True, "exact", {}, True),  # descales
    ((3, 1000, 4099, 16, 16, 128), False, "rowmax_h15", {}, False),  # three warpgroups; the last m block's warpgroups
    ((3, 1000, 4099, 16, 16, 128), False, "exact", {"tile_m": 128}, False),  # hold 40, 0 and 0 rows (tile_m 192)
    ((1, 1531, 777, 16, 16, 128), True, "exact", {"pv_accumulation": "single"}, False),  # rows with no key: n block -1
    ((8, 1024, 1024, 14, 2, 64), True, "rowmax_h15", {"tile_n": 192}, False),  # head dim 64, GQA 7 unpacked
    ((8, 1024, 1024, 16, 16, 64), False, "exact", {}, False),  # head dim 64: the round-robin scheduler barrier
    ((1, 100, 300, 1, 1, 128), False, "rowmax_h15", {}, False),  # one work tile: a grid of one CTA
    ((64, 512, 64, 16, 16, 128), False, "rowmax_h15", {}, False),  # one KV tile a work tile: Q released by the first
    ((64, 512, 64, 16, 16, 128), True, "exact", {"tile_m": 128}, False),  # block, which is also the last
]


# Both at once (branch fp8-next): the masked half skipped under each warpgroup's own boundary, against neither.
BOTH_CASES = [
    ((2, 4096, 4096, 16, 16, 128), True, "rowmax_h15", {}, False),  # the goal cell's structure
    ((2, 4096, 4096, 16, 16, 128), True, "exact", {}, True),
    ((1, 1531, 777, 16, 16, 128), True, "rowmax_h15", {"tile_n": 128}, False),  # rows with no key
    ((64, 512, 512, 16, 16, 128), True, "rowmax_h15", {}, False),  # one or two KV tiles a work tile
    ((8, 1024, 1024, 16, 16, 64), True, "rowmax_h15", {"tile_n": 256}, False),  # head dim 64
]


@pytest.mark.gpu(arch="sm90")
@pytest.mark.parametrize("shape, causal, mode, knobs, descales", BOTH_CASES, ids=str)
def test_the_masked_half_under_the_own_boundary_is_bit_identical(shape, causal, mode, knobs, descales):
    """Note [The masked half of the first KV tile] and Note [Each warpgroup's own tile boundary] together: the first
    KV tile's half GEMMs, then the early Q release in the same block; out and LSE equal neither's bit for bit."""
    from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90

    q, k, v = _inputs(hash((shape, causal, mode, "both")) % 2**31, *shape)
    q[0, shape[1] // 2, 0, 5] = math.nan
    names = ("q_descale", "k_descale", "v_descale")
    scales = dict(zip(names, random_descales(7, shape[0], shape[4]))) if descales else {}
    results = []
    for masked_half, boundary in (("compute", "shared"), ("skip", "own"), ("skip", "own")):
        poison_allocator()
        results.append(
            flash_attn_fp8_sm90(
                q, k, v, causal=causal, softmax_mode=mode, **{**OWN_BOUNDARY, "warpgroup_epilogue": boundary},
                masked_half=masked_half, tile_m=128, **knobs, **scales,
            )
        )  # fmt: skip
    _assert_bit_identical(results)


@pytest.mark.gpu(arch="sm90")
@pytest.mark.parametrize("shape, causal, mode, knobs, descales", OWN_BOUNDARY_CASES, ids=str)
def test_each_warpgroups_own_tile_boundary_is_bit_identical(shape, causal, mode, knobs, descales):
    """Note [Each warpgroup's own tile boundary] changes who stores O and when Q is released, never what a work tile
    computes: out and LSE equal the shared boundary's on the same persistent grid bit for bit (a NaN in q included;
    output memory poisoned with NaN first; two runs, the order in which CTAs take tiles changing between runs). A
    row stored twice or never, a Q overwritten under a warpgroup's last S GEMM, or a tile number read from the
    wrong slot would show."""
    from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90

    q, k, v = _inputs(hash((shape, causal, mode, "own boundary")) % 2**31, *shape)
    q[0, shape[1] // 2, 0, 5] = math.nan
    names = ("q_descale", "k_descale", "v_descale")
    scales = dict(zip(names, random_descales(5, shape[0], shape[4]))) if descales else {}
    results = []
    for boundary in ("shared", "own", "own"):
        poison_allocator()
        results.append(
            flash_attn_fp8_sm90(
                q, k, v, causal=causal, softmax_mode=mode, **{**OWN_BOUNDARY, "warpgroup_epilogue": boundary},
                **knobs, **scales,
            )
        )  # fmt: skip
    _assert_bit_identical(results)


def test_dynamic_persistent_scheduler_factory_checks_its_sizes():
    """Note [Dynamic persistent order]: one scheduler class per SM count and consumer thread count (the named
    barriers' size); the counter and two slots per CTA in one int32 tensor."""
    from flash_attn.cute.named_barrier import NamedBarrierFwd

    from fa4_rowmax.stage.tile_scheduler_sm90 import SLOT_BARRIERS, dynamic_persistent_scheduler, semaphore_numel

    scheduler = dynamic_persistent_scheduler(132, 384)
    assert (scheduler.num_ctas, scheduler.consumer_threads) == (132, 384)
    assert semaphore_numel(132) == 265
    assert min(SLOT_BARRIERS) > max(NamedBarrierFwd) and max(SLOT_BARRIERS) < 16  # FA4's ids, and the hardware's 16
    with pytest.raises(ValueError, match=r"num_ctas must be an int >= 1"):
        dynamic_persistent_scheduler(0, 256)
    with pytest.raises(ValueError, match=r"consumer_threads must be 256 or 384"):
        dynamic_persistent_scheduler(132, 128)


def test_a_tuned_persistent_grid_yields_to_the_callers_knobs(monkeypatch):
    """Note [Tuned defaults]: a persistent entry never turns a call the one-CTA-per-tile grid runs into a refusal: it
    keeps FA4's grid where the caller's knobs leave no shared memory for O's own tile (kv_stages), and otherwise runs
    persistent, O's row-sum columns included."""
    from fa4_rowmax import fp8_sm90

    key = ("exact", 64, True)
    monkeypatch.setitem(
        fp8_sm90.TUNED_DEFAULTS, key, {m: {**k, "persistent": True} for m, k in fp8_sm90.TUNED_DEFAULTS[key].items()}
    )
    assert fp8_sm90.call_stage("exact", 64, True).persistent
    assert fp8_sm90.call_stage("exact", 64, True, tile_n=192, row_sum="mma", o_store="pv_columns").persistent
    key = ("exact", 128, True)
    monkeypatch.setitem(
        fp8_sm90.TUNED_DEFAULTS, key, {m: {**k, "persistent": True} for m, k in fp8_sm90.TUNED_DEFAULTS[key].items()}
    )
    assert fp8_sm90.call_stage("exact", 128, True).persistent
    # GQA 4 under a causal mask takes three warpgroups at tile 160 (Note [Causal tiles that pack GQA]): 4 K/V stages
    # fit there, O's own tile beside them does not.
    tight = fp8_sm90.call_stage("exact", 128, True, qhead_per_kvhead=4, kv_stages=4)
    assert (tight.tile_m, tight.tile_n, tight.persistent) == (192, 160, False)
    sizes = [fp8_sm90.shared_memory_bytes(128, 192, 160, 4, tight.row_sum, tight.o_store, p) for p in (False, True)]
    assert sizes[0] <= fp8_sm90.SMEM_PER_BLOCK < sizes[1]


def test_a_tuned_masked_half_and_own_boundary_yield_to_the_call(monkeypatch):
    """Note [Tuned defaults]: an entry that skips the masked half and ends each warpgroup's tiles alone keeps both
    where the call allows them (head dim 128 causal MHA at tile_m 128), and drops each where the call's knobs or heads
    leave it unbuilt instead of refusing the call: intra-warpgroup overlap (both), packed GQA (the own boundary),
    FA4's grid (the own boundary), tile_n 160 (the masked half). Passed by the caller, they steer the other knobs."""
    from fa4_rowmax import fp8_sm90

    key = ("rowmax_h15", 128, True)
    entries = fp8_sm90.TUNED_DEFAULTS[key]
    monkeypatch.setitem(
        fp8_sm90.TUNED_DEFAULTS,
        key,
        {**entries, 128: {**entries[128], "masked_half": "skip", "warpgroup_epilogue": "own"}},
    )

    def knobs(**kwargs):
        stage = fp8_sm90.call_stage("rowmax_h15", 128, True, **kwargs)
        return stage.tile_m, stage.masked_half, stage.warpgroup_epilogue

    assert knobs() == (128, "skip", "own")
    assert knobs(qhead_per_kvhead=4) == (128, "skip", "shared")  # 4 divides tile_m 128: packed
    assert knobs(qhead_per_kvhead=7) == (128, "skip", "own")
    assert knobs(intra_wg_overlap=True, tile_n=128) == (128, "compute", "shared")
    assert knobs(persistent=False) == (128, "skip", "shared")
    assert knobs(tile_n=160) == (128, "compute", "own")
    # Passed by the caller, each takes the tiling and structure it is built for instead of a refusal: the step without
    # overlap, the persistent grid for the own boundary, two warpgroups for the masked half, the tiling that does not
    # pack the heads; a ratio that packs at both tile_m (4) is refused by name (test_..._refuses_packed_gqa).
    for key in fp8_sm90.TUNED_DEFAULTS:
        for ratio in (1, 3, 7):
            skip, own = dict(masked_half="skip"), dict(warpgroup_epilogue="own")
            for passed in (skip, own, {**skip, **own}):
                stage = fp8_sm90.call_stage(*key, qhead_per_kvhead=ratio, **passed)
                stage.for_kernel(arch=90, q_dtype=E4M3)
                assert not (stage.warpgroup_epilogue == "own" and fp8_sm90.packs_gqa(ratio, stage.tile_m)), (key, ratio)
    # varlen calls run FA4's varlen scheduler: dense-only knobs drop before the checks, so only the CPU tensors fail
    q = torch.zeros(64, 4, 128).to(E4M3)
    cu = torch.tensor([0, 30, 64], dtype=torch.int32)
    varlen = dict(causal=True, softmax_mode="rowmax_h15", cu_seqlens_q=cu, cu_seqlens_k=cu)
    with pytest.raises(ValueError, match="must be CUDA tensors"):
        fp8_sm90.flash_attn_fp8_sm90(q, q, q, **varlen)
    with pytest.raises(ValueError, match="masked_half='skip' is tested on dense batches only"):
        fp8_sm90.flash_attn_fp8_sm90(q, q, q, **varlen, masked_half="skip")


def test_persistent_grid_holds_what_the_epilogue_writes_past_o():
    """Note [Persistent work tiles]: FA4's epilogue writes tile_m x 8 BF16 past an O tile of head_dim + 8 columns, so
    O's own region holds that much more (the estimate the host refuses kv_stages by counts it; the traced storage is
    checked against the estimate in tests/test_compile_sm90_fp8.py), and every O store is accepted."""
    from fa4_rowmax.fp8_sm90 import shared_memory_bytes
    from fa4_rowmax.interface import softmax_stage
    from fa4_rowmax.stage.flash_fwd_sm90_fp8 import o_store_overrun

    assert [o_store_overrun(128, n) for n in (64, 72, 128, 136)] == [0, 1024, 0, 1024]
    assert o_store_overrun(192, 72) == 1536
    for knobs in (dict(row_sum="mma", o_store="head_dim"), dict(row_sum="mma", o_store="pv_columns"), {}):
        assert softmax_stage("exact", persistent=True, **knobs).for_kernel(arch=90, q_dtype=E4M3).persistent
    wide, narrow = (shared_memory_bytes(64, 128, 192, 2, "mma", store, True) for store in ("pv_columns", "head_dim"))
    o_bytes = 128 * 8 * 2 + o_store_overrun(128, 72) * 2  # the 8 row-sum columns and the overrun
    assert wide - narrow == -(-o_bytes // 1024) * 1024


def test_persistent_grid_is_refused_for_varlen():
    """Note [Persistent work tiles]: a varlen call runs FA4's varlen scheduler, so persistent=True is refused there
    by name rather than ignored."""
    from fa4_rowmax.interface import softmax_stage

    stage = softmax_stage("rowmax_h15", persistent=True)
    assert stage.for_kernel(arch=90, q_dtype=E4M3).persistent
    cu = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^persistent=True applies to dense batches.*persistent=False"):
        stage.for_kernel(arch=90, q_dtype=E4M3, features={"cu_seqlens_q": cu, "cu_seqlens_k": cu})


@pytest.mark.parametrize(
    "knobs",
    [
        dict(pv_accumulation="single", intra_wg_overlap=False, tile_n=256),
        dict(intra_wg_overlap=True, tile_n=256),
        dict(intra_wg_overlap=False, tile_n=160),
        dict(intra_wg_overlap=False, tile_n=224),
    ],
    ids=str,
)
def test_skipping_the_masked_half_is_refused_where_it_is_not_built(knobs):
    """Note [The masked half of the first KV tile]: the step without overlap, two-level, whole k32 steps of keys in a
    half tile, dense batches (the GPU tests' cases); anything else is refused by name, never run with the full tile
    instead."""
    from fa4_rowmax.interface import softmax_stage

    for tile_n in (128, 192, 256):
        accepted = softmax_stage("rowmax_h15", masked_half="skip", intra_wg_overlap=False, tile_n=tile_n)
        assert accepted.for_kernel(arch=90, q_dtype=E4M3).masked_half == "skip"
    with pytest.raises(ValueError, match=r"^masked_half='skip' runs the first KV tile.*masked_half='compute'"):
        softmax_stage("rowmax_h15", masked_half="skip", **knobs).for_kernel(arch=90, q_dtype=E4M3)
    cu = torch.zeros(2, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^masked_half='skip' is tested on dense batches only.*'compute'"):
        accepted.for_kernel(arch=90, q_dtype=E4M3, features={"cu_seqlens_q": cu, "cu_seqlens_k": cu})


@pytest.mark.gpu(arch="sm90")
@pytest.mark.parametrize("mode", ["exact", "rowmax_h15"])
@pytest.mark.parametrize("heads_q", [8, 14])  # packed GQA 4, unpacked GQA 7 (the K/V head of each Q head)
def test_descales_match_reference(mode, heads_q):
    shape = (2, 1000, 1000, heads_q, 2, 128)
    q, k, v = _inputs(11, *shape)
    _check_against_reference(q, k, v, True, mode, descales=random_descales(11, 2, 2))


def _one_hot_problem(seed, rows=256, head_dim=128, values=(-2.0, -1.0, 0.0, 1.0, 2.0)):
    """Integer q, k (exact scores in any accumulator) and V = identity over 128 keys: out[i, j] = P_ij / L_i."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pick = torch.tensor(values, device="cuda")
    q = pick[torch.randint(len(values), (1, rows, 1, head_dim), device="cuda", generator=gen)].to(E4M3)
    k = pick[torch.randint(len(values), (1, head_dim, 1, head_dim), device="cuda", generator=gen)].to(E4M3)
    v = torch.eye(head_dim, device="cuda")[None, :, None, :].to(E4M3)
    return q, k, v


@pytest.mark.gpu(arch="sm90")
@pytest.mark.parametrize(
    "mode,levers",
    [
        ("rowmax_h15", dict(row_sum="fadd")),  # named: the tuned default at head dim 128 is the MMA row sum
        ("rowmax_h15", dict(row_sum="mma")),
        ("exact", dict(row_sum="fadd")),
        ("exact", dict(row_sum="mma")),
        ("exact", dict(beta=1.0, row_sum="fadd")),
        ("exact", dict(beta=0.5, row_sum="mma")),
    ],
    ids=["h15", "h15-mma", "exact", "exact-mma", "exact-beta1", "exact-beta0.5-mma"],
)
@pytest.mark.parametrize("scale_log2", [0.173, 0.5123])
def test_p_bytes_single_tile(mode, levers, scale_log2):
    """P's bytes of one 128-key tile: out[i, j] * 256 / out[i, argmax] is P_ij (the max weight is 2^8 = byte
    0x78 in both modes), exact in e4m3 up to BF16's 2^-8 (the e4m3 grid is 2^-3 apart). rowmax_h15 must give
    torch.float8_e4m3fn(H15 weight) for weights >= 2^-6 (normals), 2^-7 for H = 1.5 * 2^-7 and 0 below
    (Note [H15 e4m3 bytes by integer ops]); exact must give e4m3(exp2(y)) except within MUFU ex2.approx's
    2^-22 of a rounding midpoint (with a beta: within EX2_EMULATION_REL_ERROR, Note [exp2 emulation error]).
    Rows sum to 1 (the row sum adds the P that enters the MMA) within BF16's rounding of 128 terms, 128 * 2^-9."""
    from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90
    from fa4_rowmax.reference.exp_approx import h15_bits

    q, k, v = _one_hot_problem(int(scale_log2 * 1e4))
    softmax_scale = scale_log2 / math.log2(math.e)
    out, lse = flash_attn_fp8_sm90(q, k, v, softmax_scale=softmax_scale, softmax_mode=mode, **levers)
    scores = q.double()[0, :, 0] @ k.double()[0, :, 0].T  # (rows, 128), exact integers
    scale_f32 = torch.tensor(softmax_scale, dtype=torch.float32) * torch.tensor(math.log2(math.e), dtype=torch.float32)
    y = scores * float(scale_f32) - scores.amax(-1, keepdim=True) * float(scale_f32) + FP8_MAX_OFFSET
    o = out.double()[0, :, 0]
    p_read = 256.0 * o / o.amax(-1, keepdim=True)
    bytes_read = p_read.float().to(E4M3).view(torch.uint8)
    if mode == "rowmax_h15":
        weight = h15_bits(y.float())
        expected = weight.to(E4M3).view(torch.uint8)
        expected = torch.where(weight == 1.5 * 2**-7, torch.full_like(expected, 4), expected)
        expected = torch.where(weight < 1.5 * 2**-7, torch.zeros_like(expected), expected)
        step_gap = ((y - 0.25) / 0.5 - torch.round((y - 0.25) / 0.5)).abs() * 0.5
        checked = step_gap > 2.0**-18
    else:
        weight = torch.exp2(y)
        expected = weight.float().to(E4M3).view(torch.uint8)
        exponent = torch.floor(torch.log2(weight.clamp(min=2.0**-9)))
        ulp = torch.exp2(torch.clamp(exponent, min=-6) - 3)
        midpoint_gap = ((weight / ulp - 0.5) - torch.round(weight / ulp - 0.5)).abs() * ulp / weight
        checked = midpoint_gap > (2 * EX2_EMULATION_REL_ERROR if "beta" in levers else 2.0**-20)
    # Not vacuous: most elements are compared. The excluded bands are the midpoint margins above; the integer
    # scores put y on a lattice, and with a beta (2 x 8.8e-5 wide bands) the H200 run of 2026-12-01 (second
    # session) left 98.5 % of the elements at scale_log2 0.173 outside them, so the guard is 95 %, not 99 %.
    assert checked.float().mean() > 0.95
    mismatch = (bytes_read != expected) & checked
    assert not mismatch.any(), (
        f"{int(mismatch.sum())} P bytes differ, "
        f"e.g. {bytes_read[mismatch][:8].tolist()} vs {expected[mismatch][:8].tolist()}"
    )
    row_sums = o.sum(-1)
    assert ((row_sums - 1).abs() <= 128 * 2.0**-9).all()
    # LSE: ln(row sum * 2^-8) + max score * scale. The row sum adds P as read (rowmax_h15; row_sum="mma") or
    # the fp32 weights (exact, FADD; MUFU ex2.approx 2^-22, the emulated share EX2_EMULATION_REL_ERROR). The MMA
    # row sum is off by up to 4 k-blocks x 34 x 2^-13 (Note [FP8 kernel vs reference bounds]).
    p_values = bytes_read.view(E4M3).double()
    mma_sum = levers.get("row_sum") == "mma"
    summed = weight if (mode == "exact" and not mma_sum) else p_values
    lse_expected = torch.log(summed.sum(-1) * 2.0**-FP8_MAX_OFFSET) + scores.amax(-1) * softmax_scale
    tolerance = math.log1p(4 * 34 * 2.0**-13) if mma_sum else 2.0**-16
    if "beta" in levers and not mma_sum:
        tolerance += math.log1p(EX2_EMULATION_REL_ERROR)
    assert ((lse[0, 0].double() - lse_expected).abs() <= tolerance).all()


@pytest.mark.gpu(arch="sm90")
@pytest.mark.parametrize(
    "mode,levers",
    [("exact", {}), ("rowmax_h15", {}), ("exact", dict(beta=0.5)), ("exact", dict(beta=1.0))],
    ids=["exact", "h15", "exact-beta0.5", "exact-beta1"],
)
@pytest.mark.parametrize("where", ["q_nan", "k_nan", "v_nan", "q_inf"])
def test_nan_inf_rows(mode, levers, where):
    """A NaN in q (one row), k or v (one key), or +inf in q: exact gives FA4's values (NaN O, and LSE -inf for a
    NaN row sum); rowmax_h15 and exact with a beta give the same NaN rows (Note [NaN rows in the approximate
    modes], softmax_sm90.py; Note [beta on the FP8 exact twin]: the emulation alone would turn a NaN into 0)."""
    from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90

    q, k, v = _inputs(3, 1, 300, 300, 2, 2, 128)
    if where == "q_nan":
        q[0, 17, 1, 5] = math.nan
    elif where == "k_nan":
        k[0, 250, 0, 3] = math.nan
    elif where == "v_nan":
        v[0, 250, 0, 3] = math.nan
    else:
        q[0, 17, 1, :] = math.inf
    out, lse = flash_attn_fp8_sm90(q, k, v, causal=True, softmax_mode=mode, **levers)
    exact_out, exact_lse = flash_attn_fp8_sm90(q, k, v, causal=True, softmax_mode="exact")
    assert torch.equal(torch.isnan(out), torch.isnan(exact_out))
    assert torch.equal(torch.isneginf(lse), torch.isneginf(exact_lse))
    if where in ("q_nan", "q_inf"):
        assert torch.isnan(out[0, 17, 1]).all() and not torch.isnan(out[0, :17]).any()
    if where == "v_nan":
        # kv head 0 serves q head 0 only. Every row whose KV tiles include key 250 gets NaN in column 3, also
        # where the causal mask makes P = 0 for that key: 0 * NaN = NaN inside the PV MMA, as in FA4's and FA3's
        # kernels (seen on the H200 at tile 128: rows 128..249 as well as 250..; bench/results/h200_2026-12-01/fp8/).
        # A 128-row tile m loads key tiles 0 .. ceil(128 (m + 1) / tile_n) - 1 (causal, seqlen_q = seqlen_k), so
        # the rows that see key 250's tile depend on the tile the call resolves (256 at head dim 128 by default:
        # every row).
        from fa4_rowmax.fp8_sm90 import call_stage

        tile_n = call_stage(mode, 128, True, **levers).tile_n
        rows = torch.arange(300)
        sees_key = -(-(128 * (rows // 128 + 1)) // tile_n) > 250 // tile_n
        nan_rows = torch.isnan(out[0, :, 0, 3]).cpu()
        assert torch.equal(nan_rows, sees_key), (tile_n, nan_rows.nonzero().flatten()[:4].tolist())
        assert not torch.isnan(out[0, :, 1]).any() and not torch.isnan(out[0, :, 0, :3]).any()
        assert not torch.isnan(out[0, :, 0, 4:]).any()


@pytest.mark.gpu(arch="sm90")
@pytest.mark.parametrize("row_sum_rows", [0, 8])
def test_v_transpose_prepass(row_sum_rows):
    from fa4_rowmax.stage.v_transpose import v_transpose, v_transpose_reference

    v = torch.randn(2, 1000, 3, 128, device="cuda").to(E4M3)[:, :, :, :]
    vt, descale = v_transpose(v, row_sum_rows=row_sum_rows)
    assert descale is None and vt.stride(1) == 1
    expected = v_transpose_reference(v, row_sum_rows)
    assert torch.equal(vt.permute(0, 2, 3, 1).view(torch.uint8), expected.view(torch.uint8))
    dq, dk, dv = random_descales(0, 2, 3)
    _, descale = v_transpose(v, dq, None, dv)
    assert torch.equal(descale[..., 0], dq) and torch.equal(descale[..., 1], dv)
    # Note [The counter zeroed by the pre-pass]: element 0 alone, whatever was there.
    counter = torch.arange(7, 7 + 265, dtype=torch.int32, device="cuda")
    vt_with_counter, _ = v_transpose(v, row_sum_rows=row_sum_rows, counter=counter)
    assert counter[0].item() == 0 and torch.equal(counter[1:].cpu(), torch.arange(8, 7 + 265, dtype=torch.int32))
    assert torch.equal(vt_with_counter.view(torch.uint8), vt.view(torch.uint8))


# ----------------------------------------------------------------------------------------------------
# Input checks: raised before any GPU work, so they run on the CPU too.
# ----------------------------------------------------------------------------------------------------


def _cpu_inputs(hq=4, hk=4, d=128, dtype=E4M3):
    return [torch.zeros(1, 64, h, d, dtype=dtype) for h in (hq, hk, hk)]


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(dtype=torch.bfloat16), "q must be torch.float8_e4m3fn"),
        (dict(dtype=torch.float8_e5m2), "q must be torch.float8_e4m3fn: e5m2 inputs are not implemented"),
        (dict(d=96), "head_dim must be one of"),
        (dict(hq=6, hk=4), "must be a multiple"),
    ],
)
def test_bad_inputs_raise(change, match):
    from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90

    with pytest.raises(ValueError, match=match):
        flash_attn_fp8_sm90(*_cpu_inputs(**change))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(softmax_mode="rowmax_pot"), "softmax_mode must be one of"),
        (dict(softmax_mode="rowmax_h15", beta=0.5), "beta must be None or 1.0 with softmax_mode='rowmax_h15'"),
        (dict(softmax_mode="rowmax_h15", beta=0.0), "every H15 weight is built by integer ops off the MUFU"),
        (dict(beta=1.5), r"beta must be None or a number in \[0, 1\], got 1.5"),
        (dict(beta=math.nan), r"beta must be None or a number in \[0, 1\]"),
        (dict(beta=0.25, exp2_deleted=True), "beta must be None with exp2_deleted=True"),
        (dict(rescale_threshold=-1.0), "rescale_threshold must be"),
        (dict(softmax_mode="rowmax_h15", rescale_threshold=0.5), "lets P reach"),
        (dict(softmax_mode="exact", rescale_threshold=0.9), "lets P reach"),
        (
            dict(q_descale=torch.ones(1, 3)),
            r"q_descale must be None or a torch.float32 tensor of shape \(batch, heads_kv\)",
        ),
        (dict(v_descale=torch.ones(1, 4, dtype=torch.float64)), "v_descale must be None or a torch.float32"),
        (dict(tile_n=176), "tile_n must be one of"),
        (dict(row_sum="gemm"), "row_sum must be one of"),
        (dict(anchor_rounding="half_octave"), "applies to softmax_mode='rowmax_h15' only"),
        (dict(clamp="sat"), "clamp='sat' applies to softmax_mode='rowmax_h15'"),
        (dict(softmax_mode="rowmax_h15", clamp="min"), "clamp must be one of"),
        (dict(arrive_after_pv=True, intra_wg_overlap=True), "arrive_after_pv=True with intra_wg_overlap=False"),
        (dict(tile_m=192, intra_wg_overlap=True), "tile_m=192 .* needs intra_wg_overlap=False"),
        (dict(tile_m=192, tile_n=192, intra_wg_overlap=False), r"tile_m=192 .* takes tile_n in \(128, 160\)"),
        (dict(kv_stages=6), r"kv_stages must be one of \(2, 3, 4, 5\)"),
        (dict(warpgroup_epilogue="alone"), r"warpgroup_epilogue must be one of \('shared', 'own'\)"),
        (
            dict(warpgroup_epilogue="own", persistent=False, intra_wg_overlap=False),
            r"warpgroup_epilogue='own' .* got persistent=False, intra_wg_overlap=False, .* Accepted: "
            r"warpgroup_epilogue='own' with persistent=True",
        ),
        (
            dict(warpgroup_epilogue="own", persistent=True, intra_wg_overlap=True),
            r"warpgroup_epilogue='own' .* got persistent=True, intra_wg_overlap=True",
        ),
        (
            dict(warpgroup_epilogue="own", persistent=True, row_sum="mma", o_store="pv_columns"),
            r"warpgroup_epilogue='own' .* o_store='pv_columns' with row_sum='mma'",
        ),
        (dict(tile_m=128, scheduler_barrier=True), "scheduler_barrier=True gives three consumer warpgroups"),
        (
            dict(tile_n=256, intra_wg_overlap=False, row_sum="mma", kv_stages=3),
            r"kv_stages=3 at tile_m=128, tile_n=256, head dim 128, row_sum='mma' needs 237,568 bytes .* "
            r"accepted there: kv_stages in \(2,\)",
        ),
        (
            dict(tile_m=192, tile_n=160, intra_wg_overlap=False, kv_stages=5),
            r"kv_stages=5 at tile_m=192, tile_n=160, .* accepted there: kv_stages in \(2, 3, 4\)",
        ),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90

    with pytest.raises(ValueError, match=match):
        flash_attn_fp8_sm90(*_cpu_inputs(), **kwargs)


def test_each_warpgroups_own_tile_boundary_refuses_packed_gqa():
    """Note [Each warpgroup's own tile boundary]: its stores are unpacked, so a head ratio that tile_m packs (4 at
    tile_m 128) is refused by name, before any GPU work; one that it does not pack (3) passes the check."""
    from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90

    knobs = dict(warpgroup_epilogue="own", persistent=True, tile_m=128, intra_wg_overlap=False, o_store="head_dim")
    with pytest.raises(ValueError, match=r"got 16 q heads over 4 kv heads, which tile_m=128 packs"):
        flash_attn_fp8_sm90(*_cpu_inputs(hq=16, hk=4), **knobs)
    with pytest.raises(ValueError, match="CUDA"):
        flash_attn_fp8_sm90(*_cpu_inputs(hq=12, hk=4), **knobs)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(beta=True), TypeError, r"beta must be None or a number in \[0, 1\] \(a real number\), got True"),
        (dict(causal="no"), TypeError, "causal must be a bool"),
        (dict(softmax_scale=math.nan), ValueError, r"softmax_scale must be None \(1 / sqrt\(head_dim\)\) or a finite"),
        (dict(softmax_scale=-1.0), ValueError, "softmax_scale must be .* > 0, got -1.0"),
        (dict(softmax_scale=0.0), ValueError, "softmax_scale must be .* > 0, got 0.0"),
        (dict(softmax_scale="0.1"), TypeError, "softmax_scale must be .*a real number"),
        (dict(exp2_deleted="yes"), TypeError, "exp2_deleted must be a bool"),
        (dict(arrive_after_pv=1), TypeError, "arrive_after_pv must be a bool"),
        (dict(scheduler_barrier="yes"), TypeError, "scheduler_barrier must be a bool"),
        (dict(persistent="yes"), TypeError, "persistent must be a bool"),
        (dict(tile_n=128.0), TypeError, r"tile_n must be an int, one of \(128, 160, 192, 224, 256\)"),
        (dict(rescale_threshold=True), TypeError, "rescale_threshold must be None"),
        (dict(rescale_threshold=10**400), ValueError, "rescale_threshold must be None .* >= 0"),
        (dict(row_sum=1), TypeError, "row_sum must be a str"),
        (dict(rescale_vote=1), TypeError, "rescale_vote must be a bool"),
        (dict(softmax_modes="exact"), TypeError, "unknown softmax-stage knobs"),
    ],
)
def test_bad_types_and_values_name_the_argument(kwargs, error, match):
    """Issue 25 defect 7: flags are bools, counts ints, scales finite and positive (each ran before, or ran
    another kernel: causal='no' ran causal, exp2_deleted='yes' the wrong-values probe)."""
    from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90

    with pytest.raises(error, match=match):
        flash_attn_fp8_sm90(*_cpu_inputs(), **kwargs)


def test_cpu_tensors_and_zero_heads_are_refused_before_any_gpu_work():
    """Issue 25 defect 7: CPU tensors reached the Triton pre-pass; zero q heads a kernel with an empty grid."""
    from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90

    with pytest.raises(ValueError, match="q, k and v must be CUDA tensors"):
        flash_attn_fp8_sm90(*_cpu_inputs())
    with pytest.raises(ValueError, match="heads of q must be >= 1"):
        flash_attn_fp8_sm90(*_cpu_inputs(hq=0, hk=2))
    with pytest.raises(ValueError, match="must be a multiple of heads of k and v"):
        flash_attn_fp8_sm90(*_cpu_inputs(hq=0, hk=0))


def test_the_fa4_route_checks_the_callers_out_and_lse():
    """Issue 25 defect 7: FA4's route copied into any `out` / `lse` (a copy broadcasts and converts); FA4 checks
    dtype, shape, device and layout, and so does the route now, before any work."""
    from fa4_rowmax.fp8_sm90 import fa4_sm90_fp8_forward

    q, k, v = _cpu_inputs()
    out_like = dict(dtype=torch.bfloat16)
    for name, buffer, match in (
        ("out", torch.empty(q.shape, dtype=torch.float16), "out must be a torch.bfloat16 tensor of shape"),
        ("out", torch.empty(1, 1, 1, 128, **out_like), r"out must be .* of shape \(1, 64, 4, 128\)"),
        ("out", torch.empty(q.shape, dtype=torch.bfloat16, device="meta"), "out must be .* on cpu, got .* on meta"),
        ("out", torch.empty(1, 1, 4, 128, **out_like).expand(q.shape), "out must have no broadcast dimension"),
        ("out", torch.empty(1, 64, 128, 4, **out_like).transpose(-1, -2), "contiguous last dimension"),
        ("lse", torch.empty(1, 64, 4), r"lse must be a torch.float32 tensor of shape \(1, 4, 64\)"),
        ("lse", torch.empty(1, 4, 64, dtype=torch.float64), "lse must be a torch.float32 tensor"),
    ):
        with pytest.raises(ValueError, match=match):
            fa4_sm90_fp8_forward(q, k, v, softmax_scale=None, causal=False, softmax_stage=None, **{name: buffer})


def test_beta_resolves_to_one_kernel_per_meaning():
    """Note [beta on the FP8 exact twin]: exact beta 0 is beta None (the unchanged kernel: one stage, one compile
    key), rowmax_h15 beta 1.0 is None (its weights use no MUFU); exact keeps a share in (0, 1]."""
    from fa4_rowmax.fp8_sm90 import resolve_stage

    for mode, same in (("exact", 0.0), ("exact", 0), ("rowmax_h15", 1.0), ("rowmax_h15", 1)):
        assert resolve_stage(mode, None, same, False) == resolve_stage(mode, None, None, False), (mode, same)
    assert resolve_stage("exact", None, None, False).beta is None
    for beta in (0.125, 0.25, 1.0):
        assert resolve_stage("exact", None, beta, False).beta == beta


def test_mixed_dtypes_and_gradients_raise():
    from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90

    q, k, v = _cpu_inputs()
    with pytest.raises(ValueError, match="v must be torch.float8_e4m3fn"):
        flash_attn_fp8_sm90(q, k, v.to(torch.bfloat16))
    with pytest.raises(ValueError, match="forward-only"):
        flash_attn_fp8_sm90(q.clone().requires_grad_(True), k, v)


def test_fa4_routing_entry_refuses_non_stock_features():
    from fa4_rowmax.fp8_sm90 import fa4_sm90_fp8_forward

    q, k, v = _cpu_inputs()
    for features, match in (
        (dict(softcap=30.0), "softcap is not supported"),
        (dict(num_splits=4), "num_splits is not supported"),
        (dict(page_table=torch.zeros(1, 1, dtype=torch.int32)), "page_table is not supported"),
    ):
        with pytest.raises(ValueError, match=match):
            fa4_sm90_fp8_forward(q, k, v, softmax_scale=None, causal=False, softmax_stage=None, features=features)
    with pytest.raises(TypeError, match="unknown FA4 feature"):
        fa4_sm90_fp8_forward(q, k, v, softmax_scale=None, causal=False, softmax_stage=None, features=dict(foo=1))


def test_fa4_routing_entry_maps_the_stage():
    """The stage's knobs reach the FP8 path's validation (beta other than None/1.0 is refused for H15, the range
    rule applies)."""
    from fa4_rowmax.fp8_sm90 import fa4_sm90_fp8_forward
    from fa4_rowmax.interface import SoftmaxStage

    q, k, v = _cpu_inputs()
    with pytest.raises(ValueError, match="beta must be None or 1.0 with softmax_mode='rowmax_h15'"):
        fa4_sm90_fp8_forward(
            q, k, v, softmax_scale=None, causal=False, softmax_stage=SoftmaxStage("rowmax_h15", beta=0.5), features={}
        )
    with pytest.raises(ValueError, match="lets P reach"):
        fa4_sm90_fp8_forward(
            q,
            k,
            v,
            softmax_scale=None,
            causal=False,
            softmax_stage=SoftmaxStage("rowmax_h15", rescale_threshold=1.0),
            features={},
        )


# --- FA4's public calls route SM90 FP8 to this forward (patch 0001) ------------------------------------------------


@pytest.mark.gpu(arch="sm90")
@pytest.mark.parametrize("mode", ["exact", "rowmax_h15"])
def test_flash_attn_func_routes_fp8_on_sm90(mode):
    """Code written for FA4 FP8 on a B200 runs unchanged on an H200: flash_attn_func with e4m3 q/k/v gives
    exactly what the SM90 FP8 forward gives; untested features and gradients are refused."""
    from flash_attn.cute import flash_attn_func

    from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90

    q, k, v = _inputs(21, 2, 509, 777, 8, 2, 128)
    with torch.no_grad():
        out, lse = flash_attn_func(q, k, v, causal=True, softmax_mode=mode, return_lse=True)
        direct_out, direct_lse = flash_attn_fp8_sm90(q, k, v, causal=True, softmax_mode=mode)
    assert out.dtype == torch.bfloat16 and torch.equal(out, direct_out) and torch.equal(lse, direct_lse)
    with pytest.raises(ValueError, match="window_size_left is not supported"):
        flash_attn_func(q, k, v, causal=True, softmax_mode=mode, window_size=(64, 0))
    with pytest.raises(ValueError, match="learnable_sink is not supported"):
        flash_attn_func(q, k, v, softmax_mode=mode, learnable_sink=torch.zeros(8, device="cuda"))


def test_mma_row_sum_is_refused_beyond_the_tested_length():
    from fa4_rowmax.fp8_sm90 import MMA_ROW_SUM_MAX_KEYS, flash_attn_fp8_sm90

    q = torch.zeros(1, 64, 2, 128, dtype=E4M3)
    kv = torch.zeros(1, MMA_ROW_SUM_MAX_KEYS + 1, 2, 128, dtype=E4M3)
    with pytest.raises(
        ValueError, match=r"row_sum='mma' with pv_accumulation='single' is accepted for seqlen_k <= 2048"
    ):
        flash_attn_fp8_sm90(q, kv, kv, row_sum="mma", pv_accumulation="single")


@pytest.mark.parametrize(
    "name, value",
    [
        ("window_size_left", 64),
        ("page_table", torch.zeros(1, 1, dtype=torch.int32)),
        ("num_splits", 4),
        ("learnable_sink", torch.zeros(2)),
    ],
)
def test_the_fa4_route_refuses_untested_features(name, value):
    from fa4_rowmax.fp8_sm90 import fa4_sm90_fp8_forward

    q = torch.zeros(1, 64, 2, 128, dtype=E4M3)
    with pytest.raises(ValueError, match=rf"^{name} is not supported by the SM90 FP8 forward"):
        fa4_sm90_fp8_forward(q, q, q, softmax_scale=None, causal=False, softmax_stage=None, features={name: value})
