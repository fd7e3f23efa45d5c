"""Varlen on the SM90 FP8 forward (`fa4_rowmax.fp8_sm90`, cu_seqlens_q/k and seqused_q/k): input checks, the
varlen V^T pre-pass, compiles and the FA4 lines the kernel seam relies on on the CPU; the kernel on a Hopper GPU.

The pre-pass (Note [Varlen V^T], stage/v_transpose.py) runs under Triton's interpreter here and on the GPU, bit
for bit against `v_transpose_varlen_reference`; its Triton source also compiles for sm_90. The kernel compiles
in FakeTensorMode through FA4's `flash_attn_varlen_func` (patch 0001's route) against a private patched FA4,
and fails to compile when the V^T seam is cut (Note [V^T at FA4's padded offsets]). GPU tests (`gpu(arch="sm90")`,
Note [GPU tests]) compare every sequence with `attention_reference` (cu_seqlens, FP8 inputs, max_offset 8, the
kernel's tile_n) within `fp8_kernel_bounds` (Note [FP8 kernel vs reference bounds]), with output memory
poisoned with NaN first, lengths 0, 1 and off the tile grid, causal with seqlen_q != seqlen_k per sequence
(rows and whole tiles with no key), GQA, descales; varlen equals the batched kernel bit for bit on equal
lengths; `flash_attn_varlen_func` with e4m3 inputs equals the direct call.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
from helpers_fp8 import poison_allocator, random_descales

from fa4_rowmax import patching
from fa4_rowmax.config import FP8_MAX_OFFSET, SoftmaxConfig
from fa4_rowmax.testing import compile_check

ROOT = Path(__file__).resolve().parent.parent
E4M3 = torch.float8_e4m3fn


def _cu(lengths, device="cpu"):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


# ----------------------------------------------------------------------------------------------------
# Input checks (Note [Varlen host checks]): raised before any GPU work, so they run on the CPU.
# ----------------------------------------------------------------------------------------------------


def _cpu_problem(lengths_q=(3, 5), lengths_k=(4, 6), heads_q=4, heads_kv=2, head_dim=128):
    q = torch.zeros(sum(lengths_q), heads_q, head_dim, dtype=E4M3)
    k = torch.zeros(sum(lengths_k), heads_kv, head_dim, dtype=E4M3)
    return q, k, k.clone(), _cu(lengths_q), _cu(lengths_k)


def _bad_cases():
    cu2 = _cu((3, 5))
    return [
        (dict(cu_seqlens_q=cu2.long()), "cu_seqlens_q must be an int32 tensor of shape"),
        (dict(cu_seqlens_k=_cu((4, 3, 3))), r"cu_seqlens_k must be an int32 tensor of shape \(3,\)"),
        (dict(cu_seqlens_q=cu2[None]), r"cu_seqlens_q must be an int32 tensor of shape \(batch \+ 1,\)"),
        (dict(cu_seqlens_k=None), "cu_seqlens_q and cu_seqlens_k must be given together"),
        (dict(cu_seqlens_k=torch.tensor([0, 7, 6], dtype=torch.int32)), "cu_seqlens_k must start at 0, never decrease"),
        (dict(cu_seqlens_q=torch.tensor([1, 4, 8], dtype=torch.int32)), "cu_seqlens_q must start at 0"),
        (dict(cu_seqlens_q=torch.tensor([0, 3, 7], dtype=torch.int32)), r"end at q.shape\[0\] = 8 \(total_q\)"),
        (dict(cu_seqlens_k=torch.tensor([0, 4, 11], dtype=torch.int32)), r"end at k.shape\[0\] = 10 \(total_k\)"),
        (dict(seqused_k=torch.tensor([4, 7], dtype=torch.int32)), r"seqused_k must lie in .*seqused_k\[1\] = 7"),
        (dict(seqused_q=torch.tensor([-1, 0], dtype=torch.int32)), r"seqused_q must lie in .*seqused_q\[0\] = -1"),
        (
            dict(seqused_q=torch.tensor([1, 2, 3], dtype=torch.int32)),
            r"seqused_q must be an int32 tensor of shape \(2,\)",
        ),
        (dict(seqused_k=torch.tensor([1, 2])), "seqused_k must be an int32 tensor"),
        (dict(cu_seqlens_k=torch.zeros(6, dtype=torch.int32)[::2]), "cu_seqlens_k must be contiguous"),
        (dict(cu_seqlens_q=_cu((3, 5), device="meta")), "cu_seqlens_q must be on q's device"),
        (dict(q_descale=torch.ones(1, 2)), r"q_descale must be None .* \(batch, heads_kv\) = \(2, 2\)"),
        (dict(validate=1), "validate must be a bool"),
    ]


@pytest.mark.parametrize("change,match", _bad_cases(), ids=lambda x: x if isinstance(x, str) else "")
def test_bad_varlen_inputs_raise(change, match):
    from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90

    q, k, v, cu_q, cu_k = _cpu_problem()
    kwargs = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    kwargs.update(change)
    with pytest.raises(ValueError, match=match):
        flash_attn_fp8_sm90(q, k, v, **kwargs)


def test_varlen_layout_and_seqused_need_both_offsets():
    from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90

    q, k, v, cu_q, cu_k = _cpu_problem()
    with pytest.raises(ValueError, match=r"q must be 3-D \(total, heads, head_dim\)"):
        flash_attn_fp8_sm90(q[None], k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    dense = torch.zeros(2, 5, 4, 128, dtype=E4M3)
    with pytest.raises(ValueError, match="seqused_k is accepted with cu_seqlens_q and cu_seqlens_k only"):
        flash_attn_fp8_sm90(dense, dense, dense, seqused_k=torch.tensor([5, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_k must be given together"):
        flash_attn_fp8_sm90(dense, dense, dense, cu_seqlens_q=cu_q)


def test_mma_row_sum_bound_is_total_k_in_varlen():
    from fa4_rowmax.fp8_sm90 import MMA_ROW_SUM_MAX_KEYS, flash_attn_fp8_sm90

    q, k, v, cu_q, cu_k = _cpu_problem(lengths_k=(MMA_ROW_SUM_MAX_KEYS // 2, MMA_ROW_SUM_MAX_KEYS // 2 + 1))
    single = r"row_sum='mma' with pv_accumulation='single' is accepted for total_k .* <= 2048 only .* got total_k 2049"
    with pytest.raises(ValueError, match=single):
        flash_attn_fp8_sm90(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, row_sum="mma", pv_accumulation="single")


@pytest.mark.parametrize("varlen", [False, True])
def test_no_key_anywhere_gives_zero_and_neg_inf_without_a_kernel(varlen):
    """FA4's rule for an empty problem (no rows, or no key for any row): out 0, LSE -inf, before any launch."""
    from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90

    if varlen:
        q, k, v, cu_q, cu_k = _cpu_problem(lengths_k=(0, 0))
        out, lse = flash_attn_fp8_sm90(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        assert out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    else:
        q, k = torch.zeros(2, 7, 4, 128, dtype=E4M3), torch.zeros(2, 0, 2, 128, dtype=E4M3)
        out, lse = flash_attn_fp8_sm90(q, k, k)
        assert out.shape == q.shape and lse.shape == (2, 4, 7)
    assert out.dtype == torch.bfloat16 and (out == 0).all() and torch.isneginf(lse).all()


def test_validate_false_skips_exactly_the_content_checks():
    from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90

    q, k, v, _, _ = _cpu_problem(lengths_k=(0, 0))
    decreasing = torch.tensor([0, 5, 3], dtype=torch.int32)  # ends at 3 != total_q 8 and decreases
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0, never decrease"):
        flash_attn_fp8_sm90(q, k, v, cu_seqlens_q=decreasing, cu_seqlens_k=_cu((0, 0)))
    out, _ = flash_attn_fp8_sm90(q, k, v, cu_seqlens_q=decreasing, cu_seqlens_k=_cu((0, 0)), validate=False)
    assert (out == 0).all()
    with pytest.raises(ValueError, match="cu_seqlens_q must be an int32 tensor"):
        flash_attn_fp8_sm90(q, k, v, cu_seqlens_q=decreasing.long(), cu_seqlens_k=_cu((0, 0)), validate=False)


def test_the_fa4_route_passes_varlen_on_and_refuses_the_rest():
    """fa4_sm90_fp8_forward takes FA4's varlen arguments (checked by the FP8 entry) and still refuses paged KV."""
    from fa4_rowmax.fp8_sm90 import fa4_sm90_fp8_forward

    q, k, v, cu_q, cu_k = _cpu_problem()
    route = dict(softmax_scale=None, causal=False, softmax_stage=None)
    with pytest.raises(ValueError, match="cu_seqlens_k must start at 0, never decrease"):
        fa4_sm90_fp8_forward(q, k, v, **route, features=dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k.flip(0)))
    with pytest.raises(ValueError, match="seqused_q must lie in"):
        fa4_sm90_fp8_forward(
            q, k, v, **route, features=dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=cu_k[1:] * 9)
        )
    with pytest.raises(ValueError, match=r"^page_table is not supported by the SM90 FP8 forward"):
        fa4_sm90_fp8_forward(
            q, k, v, **route, features=dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, page_table=torch.zeros(2, 1))
        )


# ----------------------------------------------------------------------------------------------------
# The varlen V^T pre-pass on the CPU: Triton's interpreter (bit for bit) and the sm_90 compile.
# ----------------------------------------------------------------------------------------------------

_INTERPRETED = r"""
import json
import torch
from fa4_rowmax.stage.v_transpose import (
    v_transpose, v_transpose_reference, v_transpose_varlen, v_transpose_varlen_reference,
)
gen = torch.Generator().manual_seed(0)
lengths = [0, 1, 17, 16, 160, 0, 300, 5]
cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
results = {}
for tile_n, rows, head_dim in ((128, 0, 64), (160, 8, 64), (192, 8, 128)):
    v = (torch.randn(int(cu[-1]), 3, head_dim, generator=gen) * 8).to(torch.float8_e4m3fn)
    dq, dv = (torch.rand(len(lengths), 3, generator=gen) + 0.5 for _ in range(2))
    vt, descale = v_transpose_varlen(v, cu, tile_n, dq, None, dv, row_sum_rows=rows)
    expected = v_transpose_varlen_reference(v, cu, tile_n, rows)
    results[f"varlen_{tile_n}_{rows}"] = [
        vt.stride(0) == 1,
        torch.equal(vt.permute(1, 2, 0).view(torch.uint8), expected.view(torch.uint8)),
        torch.equal(descale[..., 0], dq) and torch.equal(descale[..., 1], dv),
    ]
v = (torch.randn(2, 100, 3, 64, generator=gen) * 8).to(torch.float8_e4m3fn)
vt, descale = v_transpose(v, row_sum_rows=8)
expected = v_transpose_reference(v, 8).view(torch.uint8)
results["dense_8"] = [descale is None, torch.equal(vt.permute(0, 2, 3, 1).view(torch.uint8), expected)]
counter = torch.arange(5, 5 + 265, dtype=torch.int32)
vt, _ = v_transpose(v, row_sum_rows=8, counter=counter)
results["dense_counter"] = [
    counter[0].item() == 0,
    torch.equal(counter[1:], torch.arange(6, 5 + 265, dtype=torch.int32)),
    torch.equal(vt.permute(0, 2, 3, 1).view(torch.uint8), expected),
]
print(json.dumps(results))
"""


def _run(script: str, env: dict, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", script, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


def test_varlen_prepass_bit_for_bit_under_the_interpreter():
    """Lengths 0, 1, 16, 17, a tile and more, at tile_n 128 / 160 / 192, with and without the MMA row-sum rows
    and descales; the reference places each sequence's dense V^T at its start (zeros elsewhere), so the whole
    buffer is compared, gaps included. Also the dense pass, which shares the block writer, and its zeroing of the
    persistent grid's counter (Note [The counter zeroed by the pre-pass]): element 0 alone."""
    result = _run(_INTERPRETED, dict(os.environ, TRITON_INTERPRET="1"))
    assert result.returncode == 0, result.stderr[-3000:]
    checks = json.loads(result.stdout.strip().splitlines()[-1])
    assert all(all(v) for v in checks.values()), checks


@pytest.mark.parametrize(
    "counter, match",
    [
        (torch.zeros(3, dtype=torch.float32), r"counter must be an int32 tensor .* got torch.float32 of 3 elements"),
        (torch.zeros(0, dtype=torch.int32), r"counter must be an int32 tensor of at least one element .* 0 elements"),
    ],
)
def test_the_prepass_refuses_a_counter_it_cannot_zero(counter, match):
    """Note [The counter zeroed by the pre-pass]: named before any launch."""
    from fa4_rowmax.stage.v_transpose import v_transpose

    with pytest.raises(ValueError, match=match):
        v_transpose(torch.zeros(1, 16, 1, 64).to(E4M3), counter=counter)


def test_the_reference_places_each_sequence_at_fa4s_padded_offset():
    """The torch reference the pre-pass is compared with: sequence b's keys (group-permuted) from column
    varlen_vt_start(cu[b], b, tile_n), whose range is a whole number of tiles above the sequence's length."""
    from fa4_rowmax.stage.softmax_sm90_fp8 import KEY_ORDER_IN_16
    from fa4_rowmax.stage.v_transpose import v_transpose_varlen_reference, varlen_vt_start

    lengths, tile_n = [0, 1, 17, 192, 0, 300], 192
    cu = _cu(lengths)
    v = torch.arange(1, int(cu[-1]) + 1, dtype=torch.float32)[:, None, None].expand(-1, 1, 16).to(E4M3)
    vt = v_transpose_varlen_reference(v, cu, tile_n).view(torch.uint8)[0, 0]
    starts = [varlen_vt_start(int(cu[b]), b, tile_n) for b in range(len(lengths) + 1)]
    assert starts[-1] == varlen_vt_start(int(cu[-1]), len(lengths), tile_n) == vt.numel()
    for b, length in enumerate(lengths):
        assert starts[b] % tile_n == 0 and starts[b + 1] - starts[b] >= -(-(length + 1) // tile_n) * tile_n
        keys = torch.tensor(
            [KEY_ORDER_IN_16[p % 16] + p // 16 * 16 for p in range(-(-length // 16) * 16)], dtype=torch.long
        )
        expected = torch.where(keys < length, v.view(torch.uint8)[int(cu[b]) + keys.clamp(max=length - 1), 0, 0], 0)
        assert torch.equal(vt[starts[b] : starts[b] + keys.numel()], expected)
        assert (vt[starts[b] + keys.numel() : starts[b + 1]] == 0).all()


_SM90_TRITON = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fa4_rowmax.stage import v_transpose as m
pointers = dict(v_ptr="*u8", vt_ptr="*u8", cu_seqlens_ptr="*i32", qd_ptr="*fp32", kd_ptr="*fp32", vd_ptr="*fp32",
                descale_ptr="*fp32")
scalars = dict(batch="i32", heads_kv="i32", columns="i32", stride_vs="i32", stride_vh="i32")
for rows, descale in ((128, False), (136, True)):
    constexprs = dict(HEAD_DIM=128, ROWS_OUT=rows, TILE=160, BLOCK_KEYS=m.VARLEN_BLOCK_KEYS, HAS_DESCALE=descale,
                      HAS_Q=descale, HAS_K=False, HAS_V=descale)
    signature = {**pointers, **scalars, **{name: "constexpr" for name in constexprs}}
    source = ASTSource(fn=m._v_transpose_varlen_kernel, signature=signature, constexprs=constexprs)
    assert "st.global" in triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
dense_pointers = dict(v_ptr="*u8", vt_ptr="*u8", qd_ptr="*u8", kd_ptr="*u8", vd_ptr="*u8", descale_ptr="*u8",
                      counter_ptr="*i32")
dense_scalars = dict(seqlen_k="i32", heads_kv="i32", keys_padded="i32", stride_vb="i32", stride_vs="i32",
                     stride_vh="i32")
constexprs = dict(HEAD_DIM=128, ROWS_OUT=136, BLOCK_KEYS=m.BLOCK_KEYS, HAS_DESCALE=False, HAS_Q=False, HAS_K=False,
                  HAS_V=False, HAS_COUNTER=True)
signature = {**dense_pointers, **dense_scalars, **{name: "constexpr" for name in constexprs}}
source = ASTSource(fn=m._v_transpose_kernel, signature=signature, constexprs=constexprs)
assert "st.global.b32" in triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]  # the counter's 0
print("ok")
"""


def test_varlen_prepass_compiles_for_sm90(tmp_path):
    """The interpreter runs Python; the CUDA build (Triton ships ptxas) must accept the binary search loop too, and
    the dense pass with the counter's store (Note [The counter zeroed by the pre-pass])."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = _run(_SM90_TRITON, dict(env, TRITON_CACHE_DIR=str(tmp_path)))
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


# ----------------------------------------------------------------------------------------------------
# The kernel on the CPU: FakeTensorMode compile through FA4's flash_attn_varlen_func, and the seam's guard.
# ----------------------------------------------------------------------------------------------------

_VARLEN_COMPILE = r"""
import sys
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
if sys.argv[1] == "cut_the_seam":  # V^T no longer recognised: the producer would read it at K's offsets
    from fa4_rowmax.stage import flash_fwd_sm90_fp8 as kernel
    create = kernel.SeqlenInfoQKVt.create
    kernel.SeqlenInfoQKVt.create = staticmethod(lambda b, **kw: create(b, **{**kw, "vt": object()}))
from flash_attn.cute import flash_attn_varlen_func
with FakeTensorMode():
    q = torch.empty(1000, 8, 128, dtype=torch.float8_e4m3fn, device="cuda")
    k = torch.empty(900, 2, 128, dtype=torch.float8_e4m3fn, device="cuda")
    cu = torch.empty(5, dtype=torch.int32, device="cuda")
    used = torch.empty(4, dtype=torch.int32, device="cuda")
    out, lse = flash_attn_varlen_func(q, k, k, cu_seqlens_q=cu, cu_seqlens_k=cu, seqused_k=used, causal=True,
                                      softmax_mode="rowmax_h15", return_lse=True)
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and lse.shape == (8, 1000)
print("ok")
"""


@pytest.fixture(scope="module")
def patched_site(tmp_path_factory):
    return patching.copy_package(patching.default_site(), tmp_path_factory.mktemp("fa4"), state="patched")


def _compile_env(site: Path, dump: Path) -> dict:
    return dict(
        os.environ,
        **compile_check.ARCH_ENV["sm90"],
        CUTE_DSL_KEEP="cubin",
        CUTE_DSL_DUMP_DIR=str(dump),
        PYTHONPATH=os.pathsep.join([str(site), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        PYTHONWARNINGS="ignore",
    )


def test_varlen_kernel_compiles_through_flash_attn_varlen_func(patched_site, tmp_path):
    """Patch 0001 routes FA4's varlen call with e4m3 inputs on SM90 to this forward (GQA 4, causal, H15,
    seqused_k), which compiles one FP8 kernel with the V^T seam engaged."""
    result = _run(_VARLEN_COMPILE, _compile_env(patched_site, tmp_path), "as_is")
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]
    assert len(list(tmp_path.glob("*Sm90Fp8*.cubin"))) == 1, sorted(p.name for p in tmp_path.iterdir())


def test_cutting_the_v_transpose_seam_fails_the_compile(patched_site, tmp_path):
    result = _run(_VARLEN_COMPILE, _compile_env(patched_site, tmp_path), "cut_the_seam")
    assert result.returncode != 0 and "FA4's producer no longer offsets V" in result.stderr, result.stderr[-3000:]


def test_the_fa4_lines_the_seam_relies_on():
    """Note [V^T at FA4's padded offsets]: FA4's producer offsets V with offset_batch_K on the SeqlenInfoCls
    object, and padded_offset_k is the formula the pre-pass uses (varlen_vt_start and _vt_start)."""
    from fa4_rowmax.stage.v_transpose import varlen_vt_start

    cute = Path(patching.default_site()) / "flash_attn/cute"
    load = (cute / "flash_fwd_sm90.py").read_text().split("    def load(", 1)[1].split("    def load_KV(", 1)[0]
    assert load.count("seqlen = SeqlenInfoCls(batch_idx)") == 1
    assert load.count("seqlen.offset_batch_K(mV, batch_idx, dim=3)") == 1
    seqlen_info = (cute / "seqlen_info.py").read_text()
    assert "cute.assume((offset_k + batch_idx * tile_n) // tile_n * tile_n, divby=tile_n)" in seqlen_info
    source = (ROOT / "fa4_rowmax/stage/v_transpose.py").read_text()
    assert "return (tl.load(cu_seqlens_ptr + b) + b * TILE) // TILE * TILE" in source
    assert [varlen_vt_start(offset, b, 160) for offset, b in ((0, 0), (1, 1), (159, 1), (160, 1), (320, 2))] == [
        0,
        160,
        160,
        320,
        640,
    ]


# ----------------------------------------------------------------------------------------------------
# GPU: the kernel against the reference, sequence by sequence.
# ----------------------------------------------------------------------------------------------------


def _varlen_inputs(seed, lengths_q, lengths_k, heads_q, heads_kv, head_dim):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(sum(lengths_q), heads_q, head_dim, device="cuda", generator=gen).to(E4M3)
    k = torch.randn(sum(lengths_k), heads_kv, head_dim, device="cuda", generator=gen).to(E4M3)
    v = torch.randn(sum(lengths_k), heads_kv, head_dim, device="cuda", generator=gen).to(E4M3)
    return q, k, v, _cu(lengths_q, "cuda"), _cu(lengths_k, "cuda")


def _check_sequences(out, lse, q, k, v, cu_q, cu_k, causal, mode, descales, levers):
    """Every sequence against the reference with cu_seqlens, within its per-row bounds."""
    from fa4_rowmax.fp8_sm90 import call_stage
    from fa4_rowmax.gates.tolerances import fp8_kernel_bounds
    from fa4_rowmax.reference.attention import attention_reference

    stage = call_stage(mode, q.shape[-1], causal, qhead_per_kvhead=q.shape[1] // k.shape[1], **levers)
    config = SoftmaxConfig(
        mode=mode,
        max_offset=FP8_MAX_OFFSET,
        tile_n=stage.tile_n,
        anchor_rounding=stage.anchor_rounding,
    )
    dq, dk, dv = descales if descales is not None else (None, None, None)
    ref_out, ref_lse = attention_reference(
        q, k, v, config, causal=causal, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, q_descale=dq, k_descale=dk, v_descale=dv
    )
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse.shape == (q.shape[1], q.shape[0])
    assert not torch.isnan(out).any() and not torch.isnan(lse).any(), "NaN in the output (unwritten or poisoned)"
    no_key = torch.isneginf(ref_lse)
    assert torch.equal(torch.isneginf(lse), no_key), "rows with no key differ"
    assert (out.float()[no_key.T] == 0).all(), "rows with no key must be 0"
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(cu_q) - 1):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if cu_q[b] == cu_q[b + 1] or cu_k[b] == cu_k[b + 1]:
            continue  # no rows, or no key: checked above
        seq_descales = None if descales is None else [d[b : b + 1] for d in descales]
        out_bound, lse_bound = fp8_kernel_bounds(
            q[None, rows],
            k[None, keys],
            v[None, keys],
            config,
            causal,
            seq_descales,
            stage.row_sum == "mma",
            pv_accumulation=stage.pv_accumulation,
        )
        lse_err = (lse[:, rows] - ref_lse[:, rows]).abs().where(~no_key[:, rows], 0.0)
        assert (lse_err <= lse_bound[0]).all(), f"sequence {b}: LSE off by {float((lse_err - lse_bound[0]).max()):.3g}"
        out_err = (out[rows].float() - ref_out[rows].float()).abs().amax(-1, keepdim=True)
        assert (out_err <= out_bound[0]).all(), f"sequence {b}: out off by {float((out_err - out_bound[0]).max()):.3g}"


# Lengths: 0 and 1 on both sides, off the tile grid, a query longer than its keys (causal: 299 rows and two
# whole 128-row tiles with no key, FA4's n_block = -1), a sequence with no key, and keys over several tiles.
LENGTHS_Q = (0, 1, 200, 77, 300, 129, 16)
LENGTHS_K = (5, 0, 333, 77, 1, 640, 1)
CASES = [  # mode, causal, heads_q, heads_kv, head_dim, descales, levers
    ("exact", True, 8, 2, 128, False, {}),
    ("rowmax_h15", True, 8, 2, 128, True, {}),
    ("exact", False, 4, 4, 64, True, {}),
    ("rowmax_h15", False, 4, 1, 64, False, {}),
    ("rowmax_h15", True, 8, 2, 128, True, dict(tile_n=192, row_sum="mma")),
    ("exact", True, 4, 4, 128, False, dict(tile_n=160)),
    ("rowmax_h15", True, 14, 2, 128, False, dict(anchor_rounding="half_octave")),  # GQA 7: unpacked
    # three consumer warpgroups (Note [Three consumer warpgroups]): 192-row Q tiles over the packed sequences
    ("rowmax_h15", True, 8, 2, 128, True, dict(tile_m=192, tile_n=128, intra_wg_overlap=False, row_sum="mma")),
    ("exact", False, 12, 2, 64, False, dict(tile_m=192, tile_n=160, intra_wg_overlap=False)),  # GQA 6: packed
]


def _case_id(case):
    mode, causal, hq, hk, d, descales, levers = case
    parts = [mode, "causal" if causal else "full", f"{hq}x{hk}", f"d{d}"] + (["descales"] if descales else [])
    return "-".join(parts + [f"{k}={v}" for k, v in levers.items()])


@pytest.mark.parametrize("case", CASES, ids=_case_id)
@pytest.mark.gpu(arch="sm90")
def test_varlen_matches_reference(case):
    from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90

    mode, causal, heads_q, heads_kv, head_dim, with_descales, levers = case
    q, k, v, cu_q, cu_k = _varlen_inputs(
        zlib.crc32(_case_id(case).encode()), LENGTHS_Q, LENGTHS_K, heads_q, heads_kv, head_dim
    )
    descales = random_descales(3, len(LENGTHS_Q), heads_kv) if with_descales else None
    dq, dk, dv = descales if descales is not None else (None, None, None)
    poison_allocator()
    out, lse = flash_attn_fp8_sm90(
        q, k, v, causal=causal, softmax_mode=mode, q_descale=dq, k_descale=dk, v_descale=dv,
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **levers,
    )  # fmt: skip
    _check_sequences(out, lse, q, k, v, cu_q, cu_k, causal, mode, descales, levers)


@pytest.mark.gpu(arch="sm90")
def test_seqused_matches_reference_on_the_used_rows_and_keys():
    """seqused_q / seqused_k below the sequences' lengths: the used rows equal the varlen problem cut to the used
    rows and keys (rows past seqused_q are not written, as in FA4, so they are not compared)."""
    from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90

    lengths_q, lengths_k = (50, 1, 300, 0), (400, 3, 129, 7)
    used_q, used_k = (37, 1, 300, 0), (150, 0, 128, 7)
    q, k, v, cu_q, cu_k = _varlen_inputs(17, lengths_q, lengths_k, 8, 2, 128)
    seqused_q, seqused_k = (torch.tensor(u, dtype=torch.int32, device="cuda") for u in (used_q, used_k))
    poison_allocator()
    out, lse = flash_attn_fp8_sm90(
        q, k, v, causal=True, softmax_mode="rowmax_h15", cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_q=seqused_q,
        seqused_k=seqused_k,
    )  # fmt: skip
    rows = torch.cat([torch.arange(s, s + n) for s, n in zip(cu_q[:-1].tolist(), used_q)]).cuda()
    keys = torch.cat([torch.arange(s, s + n) for s, n in zip(cu_k[:-1].tolist(), used_k)]).cuda()
    _check_sequences(
        out[rows], lse[:, rows], q[rows], k[keys], v[keys], _cu(used_q, "cuda"), _cu(used_k, "cuda"), True,
        "rowmax_h15", None, {},
    )  # fmt: skip


EQUAL_LEVERS = [
    dict(softmax_mode="exact"),
    dict(softmax_mode="rowmax_h15", tile_n=192, row_sum="mma", descales=True),
    # Note [O's tile without the row-sum columns]: the ragged O store at head_dim columns.
    dict(softmax_mode="rowmax_h15", tile_n=192, row_sum="mma", o_store="head_dim", descales=True),
]


@pytest.mark.parametrize("levers", EQUAL_LEVERS, ids=lambda d: "-".join(f"{k}={v}" for k, v in d.items()))
@pytest.mark.gpu(arch="sm90")
def test_varlen_equals_the_batched_kernel_bit_for_bit(levers):
    """Equal lengths: packing the batch changes which memory the tiles past a sequence's end read (the next
    sequence's Q and K, V^T's zeros) but no value, so out and LSE equal the dense call's bit for bit."""
    from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90

    levers = dict(levers)
    batch, seqlen_q, seqlen_k, heads_q, heads_kv = 3, 300, 600, 8, 2  # 1,800 keys: the MMA row sum takes them
    q, k, v, cu_q, cu_k = _varlen_inputs(5, (seqlen_q,) * batch, (seqlen_k,) * batch, heads_q, heads_kv, 128)
    dq, dk, dv = random_descales(5, batch, heads_kv) if levers.pop("descales", False) else (None, None, None)
    common = dict(causal=True, q_descale=dq, k_descale=dk, v_descale=dv, **levers)
    out, lse = flash_attn_fp8_sm90(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, **common)
    dense_out, dense_lse = flash_attn_fp8_sm90(
        *(t.view(batch, -1, *t.shape[1:]) for t in (q, k, v)), **common
    )  # fmt: skip
    assert torch.equal(out.view(torch.int16), dense_out.reshape(out.shape).view(torch.int16))
    assert torch.equal(lse.view(torch.int32), dense_lse.transpose(0, 1).reshape(lse.shape).view(torch.int32))


@pytest.mark.gpu(arch="sm90")
def test_a_nan_in_one_sequences_v_stays_in_that_sequence():
    """Note [Varlen V^T]: a sequence's KV tiles read only its own V^T range, so a NaN in sequence 1's V (which
    reaches every row of sequence 1 whose tiles hold it, 0 * NaN in the PV MMA) leaves the others finite. No
    sequence here has a tile without a key, the one case that reads the previous range."""
    from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90

    lengths = (130, 70, 200)
    q, k, v, cu_q, cu_k = _varlen_inputs(9, lengths, lengths, 4, 4, 128)
    v[130 + 69, 0, 3] = math.nan  # the last key of sequence 1
    out, _ = flash_attn_fp8_sm90(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert torch.isnan(out[130:200, 0, 3]).all()
    assert not torch.isnan(out[:130]).any() and not torch.isnan(out[200:]).any()


@pytest.mark.gpu(arch="sm90")
@pytest.mark.parametrize("row_sum_rows", [0, 8])
def test_varlen_prepass_on_the_gpu(row_sum_rows):
    from fa4_rowmax.stage.v_transpose import v_transpose_varlen, v_transpose_varlen_reference

    lengths = (0, 1, 17, 192, 0, 1000, 3)
    cu = _cu(lengths, "cuda")
    v = torch.randn(sum(lengths), 3, 128, device="cuda").to(E4M3)
    dq, dk, dv = random_descales(0, len(lengths), 3)
    vt, descale = v_transpose_varlen(v, cu, 192, dq, dk, dv, row_sum_rows=row_sum_rows)
    expected = v_transpose_varlen_reference(v, cu, 192, row_sum_rows)
    assert vt.stride(0) == 1 and torch.equal(vt.permute(1, 2, 0).view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(descale[..., 0], dq * dk) and torch.equal(descale[..., 1], dv)


@pytest.mark.gpu(arch="sm90")
def test_validate_false_is_sync_free():
    """Note [Varlen host checks]: validate=False reads nothing back (torch's sync debug mode turns a sync into an
    error), validate=True reads the offsets once."""
    from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90

    q, k, v, cu_q, cu_k = _varlen_inputs(2, LENGTHS_Q, LENGTHS_K, 8, 2, 128)
    expected = flash_attn_fp8_sm90(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out, lse = flash_attn_fp8_sm90(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, validate=False)
        with pytest.raises(RuntimeError, match="synchroniz"):
            flash_attn_fp8_sm90(q, k, v, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out, expected[0]) and torch.equal(lse, expected[1])


# --- FA4's public varlen call routes SM90 FP8 to this forward (patch 0001) ------------------------------------


@pytest.mark.gpu(arch="sm90")
@pytest.mark.parametrize("mode", ["exact", "rowmax_h15"])
def test_flash_attn_varlen_func_routes_fp8_on_sm90(mode):
    """Code written for FA4 FP8 varlen on a B200 runs unchanged on an H200: flash_attn_varlen_func with e4m3
    q/k/v (max_seqlen hints and seqused_k included) gives exactly what the SM90 FP8 forward gives."""
    from flash_attn.cute import flash_attn_varlen_func

    from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90

    q, k, v, cu_q, cu_k = _varlen_inputs(21, LENGTHS_Q, LENGTHS_K, 8, 2, 128)
    seqused_k = (cu_k[1:] - cu_k[:-1]) // 2
    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, seqused_k=seqused_k)
    with torch.no_grad():
        out, lse = flash_attn_varlen_func(
            q, k, v, **varlen, max_seqlen_q=max(LENGTHS_Q), max_seqlen_k=max(LENGTHS_K), causal=True,
            softmax_mode=mode, return_lse=True,
        )  # fmt: skip
        direct_out, direct_lse = flash_attn_fp8_sm90(q, k, v, causal=True, softmax_mode=mode, **varlen)
    assert out.dtype == torch.bfloat16 and torch.equal(out, direct_out) and torch.equal(lse, direct_lse)
    with pytest.raises(ValueError, match="window_size_left is not supported"):
        flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True, window_size=(64, 0))


@pytest.mark.gpu(arch="sm90")
def test_bf16_varlen_is_not_routed(monkeypatch):
    """Only e4m3 inputs take the route: a BF16 varlen call runs FA4's own kernel (the FP8 entry, made to raise
    here, is never reached), each sequence within FA4's derived bounds of the exact reference
    (`kernel_bounds`, Note [Kernel vs reference: lattice flips])."""
    from flash_attn.cute import flash_attn_varlen_func

    from fa4_rowmax import fp8_sm90
    from fa4_rowmax.gates.tolerances import assert_within_bounds, kernel_bounds
    from fa4_rowmax.reference.attention import attention_reference

    def refuse(*args, **kwargs):
        raise AssertionError("a BF16 call reached the SM90 FP8 route")

    monkeypatch.setattr(fp8_sm90, "fa4_sm90_fp8_forward", refuse)
    q, k, v, cu_q, cu_k = _varlen_inputs(4, LENGTHS_Q, LENGTHS_K, 8, 2, 128)
    q, k, v = (t.to(torch.bfloat16) for t in (q, k, v))
    with torch.no_grad():
        out, lse = flash_attn_varlen_func(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True, return_lse=True)
    assert out.dtype == torch.bfloat16 and out.shape == q.shape
    config = SoftmaxConfig()
    ref_out, ref_lse = attention_reference(q, k, v, config, causal=True, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for b in range(len(LENGTHS_Q)):
        rows, keys = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        if LENGTHS_Q[b] and LENGTHS_K[b]:
            bounds = kernel_bounds(q[None, rows], k[None, keys], v[None, keys], config, causal=True)
            assert_within_bounds(
                out[None, rows], lse[None, :, rows], ref_out[None, rows], ref_lse[None, :, rows], bounds
            )
