"""The layouts serving engines call, with the FA4 softmax stage (BF16/FP16): varlen and paged KV.

Engines pack a batch of sequences (`cu_seqlens_q/k`, `seqused_q/k`) and keep keys in a paged cache (`page_table`
with `seqused_k`; FA4 refuses `page_table` beside `cu_seqlens_k`), a cached prefix longer than the new tokens in
chunked prefill and prefix caching. These change how FA4 loads K/V and bounds each sequence, not what the stage
computes; Note [Features allowed with a softmax stage] (interface.py) lets them through for 16-bit inputs because
the GPU tests here pass on the H200.
On a GPU (SM90/SM100; `gpu` mark, Note [GPU tests]) every sequence is compared
with `attention_reference` run on that sequence alone, within `kernel_bounds` (Note [Kernel vs reference:
lattice flips]), with output memory poisoned with NaN first, lengths 0 and 1 and off the tile grid, causal
bottom-right per sequence with seqlen_q != seqlen_k (rows with no key), GQA; packed and paged calls equal the
dense and the packed call bit for bit; a NaN in V reaches exactly the rows it reaches in stock FA4 (Note [A NaN
in a packed V]) and NaN in unused pages reaches no output.
On the CPU: what is accepted and what stays refused, and the SM100/SM90 compiles of these layouts (Note [Serving
layouts on the CPU], fa4_rowmax/testing/compile_check.py; tests/test_compile_sm90.py and test_compile_sm100.py
run them).
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from helpers_fp8 import poison_allocator

from fa4_rowmax.interface import SERVING_LAYOUT_FEATURES, softmax_stage

# Lengths 0 and 1 on both sides, off the tile grid, a query longer than its keys (causal: rows with no key), a
# sequence with no key, keys over several 128-key tiles.
LENGTHS_Q = (0, 1, 200, 77, 300, 129, 16)
LENGTHS_K = (5, 0, 333, 77, 1, 640, 1)
# Chunked prefill / prefix caching: new tokens after a cached prefix (seqlen_k = prefix + new), one of them a
# decode step (one query), one a fresh sequence, one a prefix past a page boundary.
NEW_TOKENS = (37, 1, 256, 129, 3)
CACHED = (300, 1000, 0, 385, 17)


def _cu(lengths, device="cuda"):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


# ----------------------------------------------------------------------------------------------------
# On the CPU: what these layouts do not lift.
# ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SERVING_LAYOUT_FEATURES)
@pytest.mark.parametrize("arch", [90, 100, 103])
def test_serving_layouts_are_accepted_for_16_bit_inputs(name, arch):
    value = torch.zeros(2, dtype=torch.int32) if name != "page_table" else torch.zeros(1, 1, dtype=torch.int32)
    for dtype in (torch.bfloat16, torch.float16):
        for mode in ("rowmax_h15", "rowmax_pot"):
            stage = softmax_stage(mode).for_kernel(arch=arch, q_dtype=dtype, features={name: value})
            assert stage.mode == mode and stage.q_dtype == dtype


@pytest.mark.parametrize("name", SERVING_LAYOUT_FEATURES)
def test_serving_layouts_stay_refused_for_fp8_on_sm100(name):
    """FA4's own SM100 FP8 forward with a stage has compiled only dense (tests/test_compile_sm100.py)."""
    value = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=rf"^{name} is not supported with softmax_mode='rowmax_h15'.*float8"):
        softmax_stage("rowmax_h15").for_kernel(arch=100, q_dtype=torch.float8_e4m3fn, features={name: value})


def test_split_kv_stays_refused_and_says_why():
    """Decode with split-KV merges per-split LSEs that the approximate weights do not define, and decode is
    memory-bound, so a cheaper exponential gains nothing there: num_splits != 1 is refused with that reason."""
    with pytest.raises(ValueError, match=r"^num_splits is not supported .*memory-bound.*num_splits=1"):
        softmax_stage("rowmax_h15").for_kernel(arch=90, q_dtype=torch.bfloat16, features={"num_splits": 4})


@pytest.mark.parametrize("num_splits", [0, -1])
@pytest.mark.parametrize("arch, dtype", [(90, torch.bfloat16), (100, torch.bfloat16), (100, torch.float8_e4m3fn)])
def test_a_request_to_choose_the_split_count_is_accepted(num_splits, arch, dtype):
    """num_splits <= 0 is FA4's "let the heuristic choose", which engines pass (SGLang's fa4 prefill: 0); under a
    stage it runs unsplit (Note [num_splits=0 under a softmax stage]), so it is accepted for every input dtype."""
    stage = softmax_stage("rowmax_h15").for_kernel(arch=arch, q_dtype=dtype, features={"num_splits": num_splits})
    assert stage.mode == "rowmax_h15"
    for refused in (2, 4):
        with pytest.raises(ValueError, match=r"^num_splits is not supported"):
            softmax_stage("rowmax_h15").for_kernel(arch=arch, q_dtype=dtype, features={"num_splits": refused})


def test_the_patch_resolves_a_split_request_to_one_split_under_a_stage():
    """Patch 0001 sets num_splits = 1 right after the stage accepted the call's features, before FA4 plans the
    launch (`_tile_size_fwd` would otherwise run its split heuristic on num_splits < 1), and only on the stage's
    branch: stock FA4 keeps its heuristic."""
    from fa4_rowmax.patching import PATCH_DIR

    diff = (PATCH_DIR / "0001-interface-softmax-mode.diff").read_text()
    branch = diff.split("+    if softmax_stage is not None:\n", 1)[1].split("\n     if is_fp8 and requires_grad:", 1)[0]
    lines = branch.splitlines()
    assert lines[0].startswith("+        softmax_stage = softmax_stage.for_kernel(")
    assert lines[-1].startswith("+        num_splits = 1  # Note [num_splits=0 under a softmax stage]")
    assert all(line.startswith("+        ") for line in lines), "the assignment must stay inside the stage's branch"


# ----------------------------------------------------------------------------------------------------
# On a GPU.
# ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def fa4():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability()[0] not in (9, 10, 11):
        pytest.skip("FA4's softmax stage runs on SM90 and SM100-family GPUs")
    from fa4_rowmax.interface import is_fa4_patched

    if not is_fa4_patched():
        pytest.skip("FA4 is not patched: python -m fa4_rowmax.patching apply")
    from flash_attn.cute import flash_attn_varlen_func

    return flash_attn_varlen_func


def _packed(seed, lengths, heads, head_dim, dtype, std=1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(sum(lengths), heads, head_dim, device="cuda", generator=gen) * std).to(dtype)


def _reference_config(mode, dtype, **knobs):
    from fa4_rowmax.interface import SoftmaxStage

    major, minor = torch.cuda.get_device_capability()
    stage = SoftmaxStage(mode, **knobs).for_kernel(arch=major * 10 + minor, q_dtype=dtype)
    return stage.reference_config(tile_n=128)  # FA4's key tile at head dim <= 128 on SM90 and SM100


def _check_sequences(out, lse, q, k, v, lengths_q, lengths_k, causal, config):
    """Each sequence (its rows of q, keys of k/v, packed) against the reference run on it alone."""
    from fa4_rowmax.gates.tolerances import assert_within_bounds, kernel_bounds
    from fa4_rowmax.reference.attention import attention_reference

    assert out.shape == q.shape and out.dtype == q.dtype and lse.shape == (q.shape[1], q.shape[0])
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "NaN in the output (unwritten or poisoned)"
    cu_q, cu_k = _cu(lengths_q).tolist(), _cu(lengths_k).tolist()
    for b, (n_q, n_k) in enumerate(zip(lengths_q, lengths_k)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if n_q == 0:
            continue
        if n_k == 0:  # FA4's rule for a row with no key: out 0, LSE -inf
            assert (out[rows] == 0).all() and torch.isneginf(lse[:, rows]).all(), f"sequence {b} has no key"
            continue
        seq = (q[None, rows], k[None, keys], v[None, keys])
        ref_out, ref_lse = attention_reference(*seq, config, causal=causal)
        assert torch.equal(torch.isneginf(lse[None, :, rows]), torch.isneginf(ref_lse)), f"sequence {b}: no-key rows"
        bounds = kernel_bounds(*seq, config, causal=causal)
        assert bounds.decision_rows <= max(1, 0.01 * bounds.lse.numel()), (b, bounds.decision_rows)
        assert_within_bounds(out[None, rows], lse[None, :, rows], ref_out, ref_lse, bounds)


CASES = [  # mode, knobs, causal, heads_q, heads_kv, head_dim, dtype
    ("rowmax_h15", {}, True, 8, 2, 128, torch.bfloat16),
    ("rowmax_h15", {}, False, 4, 4, 64, torch.float16),
    ("rowmax_pot", {}, True, 6, 2, 64, torch.bfloat16),
    ("rowmax_h15", dict(rescale_threshold=8.0, beta=0.5), True, 4, 1, 128, torch.bfloat16),
    ("exact", dict(rescale_threshold=8.0), False, 8, 2, 128, torch.bfloat16),
]


def _case_id(case):
    mode, knobs, causal, hq, hk, d, dtype = case
    parts = [mode, *(f"{k}={v}" for k, v in knobs.items()), "causal" if causal else "full", f"{hq}x{hk}", f"d{d}"]
    return "-".join(parts + [str(dtype).removeprefix("torch.")])


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_varlen_matches_reference(fa4, case):
    mode, knobs, causal, heads_q, heads_kv, head_dim, dtype = case
    seed = zlib.crc32(_case_id(case).encode())
    q = _packed(seed, LENGTHS_Q, heads_q, head_dim, dtype, std=3.0)
    k, v = (_packed(seed + i, LENGTHS_K, heads_kv, head_dim, dtype) for i in (1, 2))
    poison_allocator()
    with torch.no_grad():
        out, lse = fa4(
            q, k, v, cu_seqlens_q=_cu(LENGTHS_Q), cu_seqlens_k=_cu(LENGTHS_K), max_seqlen_q=max(LENGTHS_Q),
            max_seqlen_k=max(LENGTHS_K), causal=causal, return_lse=True, softmax_mode=mode, **knobs,
        )  # fmt: skip
    _check_sequences(out, lse, q, k, v, LENGTHS_Q, LENGTHS_K, causal, _reference_config(mode, dtype, **knobs))


@pytest.mark.gpu
def test_seqused_matches_reference_on_the_used_rows_and_keys(fa4):
    """seqused_q / seqused_k below the sequences' lengths: the used rows equal the problem cut to the used rows and
    keys (rows past seqused_q are not written, as in stock FA4, so they are not compared)."""
    lengths_q, lengths_k = (50, 1, 300, 0), (400, 3, 129, 7)
    used_q, used_k = (37, 1, 300, 0), (150, 0, 128, 7)
    q = _packed(17, lengths_q, 8, 128, torch.bfloat16, std=3.0)
    k, v = (_packed(18 + i, lengths_k, 2, 128, torch.bfloat16) for i in (0, 1))
    poison_allocator()
    with torch.no_grad():
        out, lse = fa4(
            q, k, v, cu_seqlens_q=_cu(lengths_q), cu_seqlens_k=_cu(lengths_k),
            seqused_q=torch.tensor(used_q, dtype=torch.int32, device="cuda"),
            seqused_k=torch.tensor(used_k, dtype=torch.int32, device="cuda"), causal=True, return_lse=True,
            softmax_mode="rowmax_h15",
        )  # fmt: skip
    rows = torch.cat([torch.arange(s, s + n) for s, n in zip(_cu(lengths_q)[:-1].tolist(), used_q)]).cuda()
    keys = torch.cat([torch.arange(s, s + n) for s, n in zip(_cu(lengths_k)[:-1].tolist(), used_k)]).cuda()
    config = _reference_config("rowmax_h15", torch.bfloat16)
    _check_sequences(out[rows], lse[:, rows], q[rows], k[keys], v[keys], used_q, used_k, True, config)


@pytest.mark.gpu
def test_varlen_equals_the_dense_call_bit_for_bit(fa4):
    """Equal lengths: packing changes which memory a tile past a sequence's end reads (the next sequence's rows),
    never a value, so out and LSE equal the dense call's."""
    from flash_attn.cute import flash_attn_func

    batch, seqlen_q, seqlen_k = 3, 300, 600
    q = _packed(5, (seqlen_q,) * batch, 8, 128, torch.bfloat16, std=3.0)
    k, v = (_packed(6 + i, (seqlen_k,) * batch, 2, 128, torch.bfloat16) for i in (0, 1))
    common = dict(causal=True, return_lse=True, softmax_mode="rowmax_h15")
    with torch.no_grad():
        out, lse = fa4(q, k, v, cu_seqlens_q=_cu((seqlen_q,) * batch), cu_seqlens_k=_cu((seqlen_k,) * batch), **common)
        dense_out, dense_lse = flash_attn_func(*(t.view(batch, -1, *t.shape[1:]) for t in (q, k, v)), **common)
    assert torch.equal(out, dense_out.reshape(out.shape))
    assert torch.equal(lse, dense_lse.transpose(0, 1).reshape(lse.shape))


# Note [A NaN in a packed V]
# FA4 loads a sequence's last key tile whole from the packed K/V, so a tile of sequence b reads the first keys of
# sequence b + 1 past b's end and masks their scores; their weights are 0, but 0 * NaN is NaN in the P V GEMM.
# A NaN in V therefore reaches every row of its own sequence (every row weighs it) and, in stock FA4 too, the
# rows of the sequence before it whose last tile overlaps it (measured on the H200: stock exact and rowmax_h15 put
# NaN in the same 200 rows, studies/serving/nan_leak_probe.py). The stage adds no leak of its own: its NaN
# pattern equals stock FA4's, and the sequence after the NaN stays finite (its tiles start at its own offset).


@pytest.mark.gpu
def test_a_nan_in_v_reaches_the_rows_it_reaches_in_stock_fa4(fa4):
    lengths = (130, 70, 200)
    q = _packed(9, lengths, 4, 128, torch.bfloat16)
    k, v = (_packed(10 + i, lengths, 4, 128, torch.bfloat16) for i in (0, 1))
    v[130 + 69, 0, 3] = math.nan  # the last key of sequence 1: every row of it sees it
    outs = {}
    for mode in ("exact", "rowmax_h15"):
        with torch.no_grad():
            out = fa4(q, k, v, cu_seqlens_q=_cu(lengths), cu_seqlens_k=_cu(lengths), softmax_mode=mode)
        outs[mode] = out[0] if isinstance(out, tuple) else out
    out = outs["rowmax_h15"]
    assert torch.isnan(out[130:200, 0, 3]).all()
    assert not torch.isnan(out[200:]).any() and not torch.isnan(out[:, 1:]).any()
    assert torch.equal(torch.isnan(out), torch.isnan(outs["exact"]))


def _page(k, v, lengths_k, page_size, seed):
    """A paged cache holding each sequence's keys (packed `k`, `v`) in pages scattered at random, FA4's layout:
    k/v (num_pages, page_size, heads_kv, head_dim), page_table (batch, max pages) int32. Spare pages (never in a
    page table's used part) hold NaN; the unused tail of a sequence's last page holds finite noise, as FA4
    asks (its docstring: a TMA tile loads the whole page)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    pages_per_seq = [-(-n // page_size) for n in lengths_k]
    max_pages = max(max(pages_per_seq), 1)
    spare = 3
    num_pages = sum(pages_per_seq) + spare
    physical = torch.randperm(num_pages, device="cuda", generator=gen)
    k_cache = torch.full((num_pages, page_size, *k.shape[1:]), math.nan, dtype=k.dtype, device="cuda")
    v_cache = torch.full_like(k_cache, math.nan)
    page_table = torch.full((len(lengths_k), max_pages), -1, dtype=torch.int32, device="cuda")
    start, next_page = 0, 0
    for b, (n, pages) in enumerate(zip(lengths_k, pages_per_seq)):
        ids = physical[next_page : next_page + pages]
        next_page += pages
        page_table[b, :pages] = ids.int()
        # unused page-table slots point at a spare page (any valid index: FA4 reads no slot past seqused_k)
        page_table[b, pages:] = physical[-1].int()
        for cache, src in ((k_cache, k), (v_cache, v)):
            block = torch.randn(pages * page_size, *k.shape[1:], device="cuda", generator=gen).to(k.dtype)
            block[:n] = src[start : start + n]
            cache[ids] = block.view(pages, page_size, *k.shape[1:])
        start += n
    seqused_k = torch.tensor(lengths_k, dtype=torch.int32, device="cuda")
    return k_cache, v_cache, page_table, seqused_k


PAGED_CASES = [  # mode, causal, heads_q, heads_kv, head_dim, page_size
    ("rowmax_h15", True, 8, 2, 128, 128),  # one key tile a page: FA4 loads pages by TMA
    ("rowmax_h15", True, 8, 2, 128, 64),  # FA4's non-TMA page loads
    ("rowmax_h15", True, 4, 4, 64, 256),
    ("rowmax_pot", False, 4, 1, 128, 16),
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", PAGED_CASES, ids=lambda c: "-".join(map(str, c)))
def test_paged_kv_matches_reference_and_the_packed_call(fa4, case):
    """Chunked prefill over a paged cache: each sequence's new tokens (q, packed by cu_seqlens_q) attend to its
    cached prefix and themselves (seqused_k = prefix + new, bottom-right causal). Per sequence within the
    reference's bounds, and equal bit for bit to the same call on the packed K/V (cu_seqlens_k)."""
    mode, causal, heads_q, heads_kv, head_dim, page_size = case
    lengths_k = tuple(c + n for c, n in zip(CACHED, NEW_TOKENS))
    seed = zlib.crc32(repr(case).encode())
    q = _packed(seed, NEW_TOKENS, heads_q, head_dim, torch.bfloat16, std=3.0)
    k, v = (_packed(seed + i, lengths_k, heads_kv, head_dim, torch.bfloat16) for i in (1, 2))
    k_cache, v_cache, page_table, seqused_k = _page(k, v, lengths_k, page_size, seed)
    common = dict(causal=causal, return_lse=True, softmax_mode=mode, max_seqlen_q=max(NEW_TOKENS))
    poison_allocator()
    with torch.no_grad():
        out, lse = fa4(
            q, k_cache, v_cache, cu_seqlens_q=_cu(NEW_TOKENS), seqused_k=seqused_k, page_table=page_table, **common
        )
        packed_out, packed_lse = fa4(
            q, k, v, cu_seqlens_q=_cu(NEW_TOKENS), cu_seqlens_k=_cu(lengths_k), max_seqlen_k=max(lengths_k), **common
        )
    _check_sequences(out, lse, q, k, v, NEW_TOKENS, lengths_k, causal, _reference_config(mode, torch.bfloat16))
    assert torch.equal(out, packed_out) and torch.equal(lse, packed_lse)


@pytest.mark.gpu
def test_paged_kv_with_a_dense_batch_of_queries(fa4):
    """page_table with dense q (batch, seqlen_q, heads, dim), as prefix caching with equal chunks calls it."""
    batch, seqlen_q, lengths_k = 3, 64, (64, 700, 200)
    q = _packed(31, (seqlen_q,) * batch, 8, 128, torch.bfloat16, std=3.0).view(batch, seqlen_q, 8, 128)
    k, v = (_packed(32 + i, lengths_k, 2, 128, torch.bfloat16) for i in (0, 1))
    k_cache, v_cache, page_table, seqused_k = _page(k, v, lengths_k, 128, 33)
    poison_allocator()
    with torch.no_grad():
        out, lse = fa4(
            q, k_cache, v_cache, seqused_k=seqused_k, page_table=page_table, causal=True, return_lse=True,
            softmax_mode="rowmax_h15",
        )  # fmt: skip
    assert out.shape == q.shape
    config = _reference_config("rowmax_h15", torch.bfloat16)
    cu_k = _cu(lengths_k).tolist()
    for b in range(batch):
        keys = slice(cu_k[b], cu_k[b + 1])
        _check_sequences(out[b], lse[b], q[b], k[keys], v[keys], (seqlen_q,), (lengths_k[b],), True, config)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_a_split_request_runs_unsplit_bit_for_bit(fa4, dtype):
    """num_splits=0 (FA4's "choose", SGLang's prefill value) under rowmax_h15 equals num_splits=1 bit for bit, on a
    decode-like shape where FA4's heuristic would split (few rows, many keys) and on a prefill shape; BF16 through
    FA4's forward, e4m3 through the SM90 FP8 forward (Note [num_splits=0 under a softmax stage])."""
    if dtype is torch.float8_e4m3fn and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the packed FP8 forward with a stage runs on SM90 (FA4's SM100 FP8 path is dense only)")
    for lengths_q, lengths_k in (((1, 1), (4000, 3000)), ((300, 129), (300, 640))):
        q = _packed(41, lengths_q, 8, 128, torch.bfloat16, std=2.0).to(dtype)
        k, v = (_packed(42 + i, lengths_k, 2, 128, torch.bfloat16).to(dtype) for i in (0, 1))
        cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
        results = []
        for num_splits in (1, 0):
            poison_allocator()
            with torch.no_grad():
                results.append(fa4(
                    q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max(lengths_q),
                    max_seqlen_k=max(lengths_k), causal=True, return_lse=True, softmax_mode="rowmax_h15",
                    num_splits=num_splits,
                ))  # fmt: skip
        (out1, lse1), (out0, lse0) = results
        assert not torch.isnan(out1.float()).any()
        assert torch.equal(out0, out1) and torch.equal(lse0, lse1), (lengths_q, lengths_k)
