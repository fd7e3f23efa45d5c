"""Note [Tuned defaults] (fa4_rowmax/fp8_sm90.py): the SM90 FP8 forward's unset knobs take the benchmark's fastest
two-level configuration per mode, head dim and mask; a knob the caller passes wins, and one that excludes three
consumer warpgroups selects the two-warpgroup entry; single-level calls and the folded anchor are not tuned. On the
CPU: the resolution, and that every table entry is a stage the FP8 forward resolves (knob values accepted, rules
between knobs kept)."""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from fa4_rowmax import fp8_sm90
from fa4_rowmax.config import FP8_TILE_MS, STAGE_KNOBS
from fa4_rowmax.fp8_sm90 import (
    PACKED_CAUSAL_KEYS,
    PACKED_TILE_M,
    TUNED_DEFAULTS,
    TUNED_TILE_M,
    call_stage,
    check_shared_memory,
)
from fa4_rowmax.interface import softmax_stage


@pytest.fixture
def compiled_configs(monkeypatch):
    """The configs the FP8 forward compiles (the compile cache's keys), in call order; nothing compiles or runs, so
    the calls take fake CUDA tensors (FakeTensorMode)."""
    seen = []
    monkeypatch.setattr(fp8_sm90, "_compile", lambda config, *args: seen.append(config) or (lambda *a: None))
    monkeypatch.setattr(fp8_sm90, "_compile_cache", {})
    return seen


@pytest.mark.parametrize("tile_m", FP8_TILE_MS)
@pytest.mark.parametrize("key", sorted(TUNED_DEFAULTS, key=str))
def test_every_entry_resolves_on_the_fp8_forward(key, tile_m):
    """The unset knobs take the faster tiling's entry; tile_m passed takes its own; both resolve and fit."""
    mode, head_dim, causal = key
    stage = call_stage(mode, head_dim, causal, **({} if tile_m == TUNED_TILE_M[key] else {"tile_m": tile_m}))
    assert stage.tile_m == tile_m
    for knob, value in TUNED_DEFAULTS[key][tile_m].items():
        assert getattr(stage, knob) == value
    resolved = stage.for_kernel(arch=90, q_dtype=torch.float8_e4m3fn)
    assert resolved.kernel == "sm90_fp8" and resolved.pv_accumulation == "two_level"
    check_shared_memory(resolved, head_dim)


def test_the_table_covers_every_mode_head_dim_and_mask():
    keys = {(m, d, c) for m in ("exact", "rowmax_h15") for d in (64, 128) for c in (False, True)}
    assert set(TUNED_DEFAULTS) == set(TUNED_TILE_M) == keys
    assert all(set(entry) == set(FP8_TILE_MS) for entry in TUNED_DEFAULTS.values())


def test_a_knob_the_caller_passes_wins():
    stage = call_stage("rowmax_h15", 128, True, tile_n=128, row_sum="fadd")
    assert (stage.tile_n, stage.row_sum) == (128, "fadd")
    assert (stage.tile_m, stage.clamp, stage.intra_wg_overlap, stage.persistent) == (128, "sat", False, True)


@pytest.mark.parametrize(
    "knobs", [dict(tile_n=256), dict(tile_n=192), dict(intra_wg_overlap=True), dict(arrive_after_pv=True)]
)
def test_a_knob_that_excludes_three_warpgroups_selects_two(knobs):
    """Where three warpgroups are the fastest, a caller's knob that tile_m=192 refuses
    (interface._check_three_warpgroups) gets the two-warpgroup entry for the rest, not a refusal of a tile_m it
    never asked for."""
    key = ("exact", 128, False)
    assert TUNED_TILE_M[key] == 192
    stage = call_stage(*key, **knobs)
    assert stage.tile_m == 128
    for knob, value in TUNED_DEFAULTS[key][128].items():
        assert getattr(stage, knob) == knobs.get(knob, value), knob
    stage.for_kernel(arch=90, q_dtype=torch.float8_e4m3fn)


def test_the_round_robin_barrier_selects_three_warpgroups():
    """scheduler_barrier=True is a three-warpgroup knob: where two are the default it brings the tile_m=192 entry."""
    key = ("rowmax_h15", 128, True)
    assert TUNED_TILE_M[key] == 128
    stage = call_stage(*key, scheduler_barrier=True)
    assert (stage.tile_m, stage.scheduler_barrier) == (192, True)
    for knob, value in TUNED_DEFAULTS[key][192].items():
        assert getattr(stage, knob) == value, knob
    stage.for_kernel(arch=90, q_dtype=torch.float8_e4m3fn)


@pytest.mark.parametrize("knobs", [dict(tile_n=256), dict(tile_n=192), dict(intra_wg_overlap=True)])
def test_the_round_robin_barrier_with_an_excluding_knob_is_refused_by_its_own_name(knobs):
    """scheduler_barrier=True without tile_m selects three warpgroups; a knob they refuse is refused in terms of the
    barrier the caller passed, not of a tile_m it never passed."""
    ((knob, value),) = knobs.items()
    got = rf"got {knob}={value!r}\. Accepted: "
    with pytest.raises(ValueError, match=r"^scheduler_barrier=True runs three consumer warpgroups .*" + got):
        call_stage("rowmax_h15", 128, True, scheduler_barrier=True, **knobs)
    stage = call_stage("rowmax_h15", 128, True, scheduler_barrier=True, tile_n=128)
    assert (stage.tile_m, stage.tile_n, stage.scheduler_barrier) == (192, 128, True)


def test_kv_stages_passed_take_the_faster_entry_they_fit_in():
    """Note [KV stages in shared memory]: three stages do not fit beside two warpgroups' tile 256 (head dim 128
    causal's faster entry) but do beside three warpgroups' tile 160, so the call gets that, not a refusal naming a
    tile_n it never passed; where no entry holds them (five), the faster entry stays and the refusal names it."""
    stage = call_stage("rowmax_h15", 128, True, kv_stages=3)
    assert (stage.tile_m, stage.tile_n, stage.kv_stages) == (192, 160, 3)
    check_shared_memory(stage.for_kernel(arch=90, q_dtype=torch.float8_e4m3fn), 128)
    stage = call_stage("rowmax_h15", 128, False, kv_stages=4)
    assert (stage.tile_m, stage.tile_n) == (192, 160)
    stage = call_stage("exact", 128, False, kv_stages=5)
    assert (stage.tile_m, stage.tile_n) == (192, 160)
    with pytest.raises(ValueError, match=r"kv_stages=5 at tile_m=192, tile_n=160, .* kv_stages in \(2, 3, 4\)"):
        check_shared_memory(stage.for_kernel(arch=90, q_dtype=torch.float8_e4m3fn), 128)
    stage = call_stage("exact", 128, False, kv_stages=5, tile_n=128)  # the caller's own tile fits five
    check_shared_memory(stage.for_kernel(arch=90, q_dtype=torch.float8_e4m3fn), 128)


def test_tile_m_passed_with_an_excluding_knob_is_refused_by_name():
    stage = call_stage("rowmax_h15", 128, False, tile_m=192, tile_n=256)
    with pytest.raises(ValueError, match=r"tile_m=192 \(three consumer warpgroups\) takes tile_n in \(128, 160\)"):
        stage.for_kernel(arch=90, q_dtype=torch.float8_e4m3fn)


def test_single_level_keeps_the_stock_knobs():
    stage = call_stage("rowmax_h15", 128, True, pv_accumulation="single")
    for knob in ("tile_n", "row_sum", "clamp", "intra_wg_overlap"):
        assert getattr(stage, knob) == STAGE_KNOBS[knob].default, knob


def test_the_folded_anchor_keeps_the_fmnmx_clamp():
    """clamp='sat' needs the exact anchor (Note [Clamp by saturation]); the fold gets the other tuned knobs."""
    stage = call_stage("rowmax_h15", 64, False, anchor_rounding="half_octave")
    assert stage.clamp == "max" and stage.row_sum == "mma" and stage.tile_n == 192
    stage.for_kernel(arch=90, q_dtype=torch.float8_e4m3fn)


def test_flash_attn_func_gets_the_tuned_stage(compiled_configs):
    """The route of FA4's flash_attn_func (no FP8 knob can be passed there) compiles the tuned stage: checked at the
    config the compile cache is keyed by, with fake CUDA tensors."""
    with FakeTensorMode():
        q = torch.empty(1, 256, 2, 128, dtype=torch.float8_e4m3fn, device="cuda")
        fp8_sm90.fa4_sm90_fp8_forward(
            q, q, q, softmax_scale=None, causal=False, softmax_stage=softmax_stage("exact", None, None)
        )
    (config,) = compiled_configs
    key = ("exact", 128, False)
    assert config.tile_m == TUNED_TILE_M[key] == 192
    for knob, value in TUNED_DEFAULTS[key][TUNED_TILE_M[key]].items():
        assert getattr(config.stage, knob) == value, knob


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("mode", ["exact", "rowmax_h15"])
def test_causal_gqa_that_packs_a_tile_takes_three_warpgroups(mode, head_dim):
    """Note [Causal tiles that pack GQA]: causal calls whose Q heads per KV head pack a 192-row tile to <= 64
    positions take the tile_m=192 entry, but H15 at head dim 128 (its persistent tile_m 128 entry is ahead there);
    MHA, ratio 2 and ratios that do not divide 192 keep TUNED_TILE_M, and non-causal calls and a caller's excluding
    knob are unaffected."""
    causal_key, full_key = (mode, head_dim, True), (mode, head_dim, False)
    rule = (mode, head_dim) != ("rowmax_h15", 128)
    assert (causal_key in PACKED_CAUSAL_KEYS) == rule and full_key not in PACKED_CAUSAL_KEYS
    for ratio, packs in ((1, False), (2, False), (3, True), (4, True), (6, True), (7, False), (8, True), (16, True)):
        stage = call_stage(mode, head_dim, True, qhead_per_kvhead=ratio)
        assert stage.tile_m == (192 if packs and rule else TUNED_TILE_M[causal_key]), ratio
        for knob, value in TUNED_DEFAULTS[causal_key][stage.tile_m].items():
            if knob == "warpgroup_epilogue" and fp8_sm90.packs_gqa(ratio, stage.tile_m):
                value = "shared"  # Note [Each warpgroup's own tile boundary]: unpacked heads only
            assert getattr(stage, knob) == value, (ratio, knob)
        if full_key not in PACKED_TILE_M:  # Note [Packed tiles without the own boundary]: the next test
            assert call_stage(mode, head_dim, False, qhead_per_kvhead=ratio).tile_m == TUNED_TILE_M[full_key]
    assert call_stage(mode, head_dim, True, qhead_per_kvhead=4, tile_n=256).tile_m == 128


def test_h15_non_causal_tiles_that_pack_gqa_keep_three_warpgroups():
    """Note [Packed tiles without the own boundary]: H15 at head dim 128 non-causal runs tile_m 128 on each
    warpgroup's own boundary where its heads stay unpacked (MHA, ratios that do not divide 128), and tile_m 192 where
    GQA would pack the 128-row tile (the own boundary is unbuilt there); both on the persistent grid. Other keys are
    untouched, and a caller's excluding knob still takes two warpgroups."""
    assert set(PACKED_TILE_M) == {("rowmax_h15", 128, False)}
    for ratio, tile_m in ((1, 128), (2, 192), (3, 128), (4, 192), (6, 128), (7, 128), (8, 192), (16, 192)):
        stage = call_stage("rowmax_h15", 128, False, qhead_per_kvhead=ratio)
        assert (stage.tile_m, stage.persistent) == (tile_m, True), ratio
        assert stage.warpgroup_epilogue == ("own" if tile_m == 128 else "shared"), ratio
        for knob, value in TUNED_DEFAULTS[("rowmax_h15", 128, False)][tile_m].items():
            assert getattr(stage, knob) == value, (ratio, knob)
    assert call_stage("rowmax_h15", 128, False, qhead_per_kvhead=4, tile_n=256).tile_m == 128


@pytest.mark.parametrize("heads_kv, tile_m", [(8, TUNED_TILE_M[("exact", 128, True)]), (2, 192)])
def test_flash_attn_func_passes_the_gqa_ratio(compiled_configs, heads_kv, tile_m):
    """The forward resolves its tuned stage with the call's own Q heads per KV head (8 Q heads: MHA, then 4 per KV
    head, which packs a 192-row tile), at the config the compile cache is keyed by, with fake CUDA tensors."""
    with FakeTensorMode():
        q = torch.empty(1, 256, 8, 128, dtype=torch.float8_e4m3fn, device="cuda")
        k = torch.empty(1, 256, heads_kv, 128, dtype=torch.float8_e4m3fn, device="cuda")
        fp8_sm90.fa4_sm90_fp8_forward(
            q, k, k, softmax_scale=None, causal=True, softmax_stage=softmax_stage("exact", None, None)
        )
    (config,) = compiled_configs
    assert config.tile_m == tile_m and config.qhead_per_kvhead == 8 // heads_kv


@pytest.mark.parametrize("mode", ["exact", "rowmax_h15"])
def test_flash_attn_func_takes_the_persistent_grid_for_dense_batches_only(compiled_configs, mode):
    """Note [Tuned defaults]: the head-dim-128 causal MHA entries take the persistent grid (Note [Persistent work
    tiles]); flash_attn_varlen_func's route, whose varlen scheduler the persistent grid does not replace, keeps FA4's
    grid for the same mode instead of refusing a knob the caller never passed. Checked at the config the compile
    cache is keyed by, with fake CUDA tensors."""
    assert TUNED_DEFAULTS[(mode, 128, True)][TUNED_TILE_M[(mode, 128, True)]]["persistent"]
    with FakeTensorMode():
        q = torch.empty(2, 256, 4, 128, dtype=torch.float8_e4m3fn, device="cuda")
        fp8_sm90.fa4_sm90_fp8_forward(
            q, q, q, softmax_scale=None, causal=True, softmax_stage=softmax_stage(mode, None, None)
        )
        packed = q.view(512, 4, 128)
        cu_seqlens = torch.tensor([0, 200, 512], dtype=torch.int32, device="cuda")
        fp8_sm90.fa4_sm90_fp8_forward(
            packed,
            packed,
            packed,
            softmax_scale=None,
            causal=True,
            softmax_stage=softmax_stage(mode, None, None),
            features=dict(cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens),
        )
    dense, varlen = compiled_configs
    assert dense.stage.persistent and dense.persistent_ctas > 0
    assert not varlen.stage.persistent and varlen.persistent_ctas == 0
    assert (varlen.tile_m, varlen.tile_n) == (dense.tile_m, dense.tile_n)


def test_the_own_tile_boundary_yields_where_it_is_not_built(compiled_configs):
    """Note [Tuned defaults]: H15's head-dim-128 causal entry takes each warpgroup's own tile boundary (Note [Each
    warpgroup's own tile boundary]) for one head per Q tile, and yields to the shared boundary, not a refusal, where
    the call packs GQA heads into the tile, passes overlap, or runs varlen."""
    key = ("rowmax_h15", 128, True)
    assert TUNED_DEFAULTS[key][TUNED_TILE_M[key]]["warpgroup_epilogue"] == "own"
    assert call_stage(*key).warpgroup_epilogue == "own"
    assert call_stage(*key, qhead_per_kvhead=7).warpgroup_epilogue == "own"  # 7 does not divide 128: unpacked
    packed = call_stage(*key, qhead_per_kvhead=4)
    assert (packed.tile_m, packed.warpgroup_epilogue, packed.persistent) == (128, "shared", True)
    assert call_stage(*key, intra_wg_overlap=True).warpgroup_epilogue == "shared"
    with FakeTensorMode():
        q = torch.empty(2, 256, 4, 128, dtype=torch.float8_e4m3fn, device="cuda")
        stage = softmax_stage("rowmax_h15", None, None)
        fp8_sm90.fa4_sm90_fp8_forward(q, q, q, softmax_scale=None, causal=True, softmax_stage=stage)
        packed_q = q.view(512, 4, 128)
        cu_seqlens = torch.tensor([0, 200, 512], dtype=torch.int32, device="cuda")
        features = dict(cu_seqlens_q=cu_seqlens, cu_seqlens_k=cu_seqlens)
        fp8_sm90.fa4_sm90_fp8_forward(
            packed_q, packed_q, packed_q, softmax_scale=None, causal=True, softmax_stage=stage, features=features
        )
    dense, varlen = compiled_configs
    assert dense.stage.warpgroup_epilogue == "own"
    assert varlen.stage.warpgroup_epilogue == "shared"
