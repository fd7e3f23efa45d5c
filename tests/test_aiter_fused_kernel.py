"""The Fused-Softmax Triton kernel against the pure reference, on Triton's CPU interpreter
(small shapes: the interpreter runs every program in Python). On a CUDA machine the same tests run
on the GPU. The dot modes "fp8" and "bf16" run here through the interpreter's own FP8 and (fp32 stand-in)
BF16 dots; "scaled" runs on a GPU only: the pinned Triton 3.6 (the H200's) has no ``dot_scaled`` in its
interpreter (``InterpreterBuilder`` lacks ``create_dot_scaled``). One test compiles the kernel for sm_90 on the
CPU to check the CUDA build and its FP8 tensor-core instructions."""

import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when aiter_fused.kernel is first imported

pytest.importorskip("triton")

from aiter_fused.attention import (  # noqa: E402
    fused_softmax_attention,
    fused_softmax_attention_varlen,
)
from aiter_fused.launch import LAUNCHES  # noqa: E402
from aiter_fused.tolerances import (  # noqa: E402
    INTERPRETER_FOLD_Z_ROUNDINGS,
    OUT_REL_TOL,
    fold_lse_ok,
    fold_out_rel_tol,
    fold_z_ulp,
    gpu_fold_z_roundings,
    lse_ok,
    lse_stats,
)
from fa4_rowmax.reference.fused_softmax import (  # noqa: E402
    fused_softmax_attention_reference,
    fused_softmax_attention_reference_varlen,
)
from fa4_rowmax.testing.fused_softmax_inputs import ADVERSARIAL, adversarial_qkv  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)


# Triton 3.6's interpreter has no dot_scaled (module docstring): the "scaled" dot mode runs compiled, on a GPU.
_NEEDS_GPU_FOR_SCALED = pytest.mark.gpu


def _randn(*shape, gen):
    return torch.randn(*shape, generator=gen).bfloat16().to(DEVICE)


def _assert_close_to_reference(out, lse, ref_out, ref_lse, dot_mode, mx_format):
    """Agreement to rounding (aiter_fused/tolerances.py): the output is BF16 (2**-9 relative), the scores
    differ by summation order, which can move a rare P element by one step of its grid. The interpreter
    sums every dot mode in fp32; on a GPU, MXFP8 through "fp8" dots gets Note [FP8 LSE tolerance]."""
    out, ref_out = out.float().cpu(), ref_out.float().cpu()
    rel = ((out - ref_out).norm() / ref_out.norm()).item()
    assert rel < OUT_REL_TOL, rel
    assert (out - ref_out).abs().max() < 0.05 * ref_out.abs().max()
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite)
    stats = lse_stats(lse.cpu(), ref_lse)
    assert lse_ok(dot_mode, mx_format, stats, fp32_sums=DEVICE == "cpu"), stats
    if DEVICE == "cpu":  # the interpreter's dots sum in fp32 in the reference's order up to rounding
        assert stats["lse_max_diff"] < 1e-5, stats


@pytest.mark.parametrize(
    "mx_format,causal,dot_mode",
    [
        ("mxfp8", False, "bf16"),
        pytest.param("mxfp6", True, "scaled", marks=_NEEDS_GPU_FOR_SCALED),
        ("mxfp4", True, "bf16"),
        pytest.param("mxfp4", False, "scaled", marks=_NEEDS_GPU_FOR_SCALED),
        ("mxfp8", True, "fp8"),
        ("mxfp4", False, "fp8"),
    ],
)
def test_kernel_matches_reference(mx_format, causal, dot_mode):
    gen = torch.Generator().manual_seed(11)
    q, k, v = _randn(1, 37, 4, 64, gen=gen), _randn(1, 83, 2, 64, gen=gen), _randn(1, 83, 2, 64, gen=gen)
    out, lse, recoveries = fused_softmax_attention(
        q,
        k,
        v,
        causal=causal,
        mx_format=mx_format,
        tile_n=32,
        dot_mode=dot_mode,
        recovery_threshold=2.0,
        return_recoveries=True,
    )
    assert out.dtype == torch.bfloat16 and out.shape == q.shape and lse.shape == (1, 4, 37)
    ref_out, ref_lse, counters = fused_softmax_attention_reference(
        q.cpu(),
        k.cpu(),
        v.cpu(),
        causal=causal,
        mx_format=mx_format,
        tile_n=32,
        recovery_threshold=2.0,
        return_counters=True,
    )
    _assert_close_to_reference(out, lse, ref_out, ref_lse, dot_mode, mx_format)
    assert torch.equal(recoveries.cpu().long(), counters["recoveries"])
    assert counters["recoveries"].sum() > 0  # threshold 2 makes recoveries happen on plain N(0, 1) data


@pytest.mark.parametrize("dot_mode", ["bf16", "fp8"])
def test_kernel_head_dim_128_and_default_tile(dot_mode):
    """The launch table's tile (128 here; Note [Launch table]): the FP8 path's 32-key sub-tiles share one
    tile max (recoveries at threshold 1)."""
    from aiter_fused.launch import launch_for

    gen = torch.Generator().manual_seed(12)
    q, k, v = _randn(2, 20, 2, 128, gen=gen), _randn(2, 150, 1, 128, gen=gen), _randn(2, 150, 1, 128, gen=gen)
    out, lse, recoveries = fused_softmax_attention(
        q, k, v, mx_format="mxfp8", dot_mode=dot_mode, recovery_threshold=1.0, return_recoveries=True
    )
    ref_out, ref_lse, counters = fused_softmax_attention_reference(
        q.cpu(),
        k.cpu(),
        v.cpu(),
        mx_format="mxfp8",
        recovery_threshold=1.0,
        return_counters=True,
        tile_n=launch_for(q.device)[1].tile_n,
    )
    _assert_close_to_reference(out, lse, ref_out, ref_lse, dot_mode, "mxfp8")
    assert torch.equal(recoveries.cpu().long(), counters["recoveries"]) and counters["recoveries"].sum() > 0


@pytest.mark.parametrize("dot_mode,tile_n", [("bf16", 32), ("fp8", 64)])
def test_kernel_varlen_with_empty_and_fully_masked_rows(dot_mode, tile_n):
    gen = torch.Generator().manual_seed(13)
    cu_q = torch.tensor([0, 3, 3, 40], dtype=torch.int32)
    cu_k = torch.tensor([0, 70, 75, 85], dtype=torch.int32)  # last sequence: 37 queries, 10 keys (causal)
    q, k, v = _randn(40, 2, 32, gen=gen), _randn(85, 1, 32, gen=gen), _randn(85, 1, 32, gen=gen)
    out, lse = fused_softmax_attention_varlen(
        q,
        k,
        v,
        cu_q.to(DEVICE),
        cu_k.to(DEVICE),
        37,
        70,
        causal=True,
        mx_format="mxfp6",
        tile_n=tile_n,
        dot_mode=dot_mode,
    )
    ref_out, ref_lse = fused_softmax_attention_reference_varlen(
        q.cpu(), k.cpu(), v.cpu(), cu_q, cu_k, causal=True, mx_format="mxfp6", tile_n=tile_n
    )
    assert lse.shape == (2, 40)
    assert torch.all(out[3:30].float() == 0) and torch.all(lse[:, 3:30] == -math.inf)
    _assert_close_to_reference(out, lse, ref_out, ref_lse, dot_mode, "mxfp6")
    unchecked = fused_softmax_attention_varlen(
        q,
        k,
        v,
        cu_q.to(DEVICE),
        cu_k.to(DEVICE),
        37,
        70,
        causal=True,
        mx_format="mxfp6",
        tile_n=tile_n,
        dot_mode=dot_mode,
        validate=False,
    )
    assert torch.equal(unchecked[0], out) and torch.equal(unchecked[1], lse)


def test_fp8_varlen_short_rows_match_reference_with_fp32_sums():
    """The H200's "fp8" varlen LSE differences (up to 1.1e-2) come from Hopper's narrow FP8 accumulator,
    not from the varlen path (kernel.py, Note [FP8 accumulation]): with fp32 sums (the interpreter) the
    FP8 path's V layout, scale indexing and sub-tile masking give the reference's LSE to fp32 rounding on
    the shapes that amplify one P flip: GQA 4, head_dim 128, a 5-key sequence and a causal one with
    more queries than keys (rows of 1-40 keys), partial 32-key blocks."""
    gen = torch.Generator().manual_seed(17)
    cu_q = torch.tensor([0, 1, 41, 41, 111], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 69, 86, 126], dtype=torch.int32)
    q, k, v = _randn(111, 4, 128, gen=gen), _randn(126, 1, 128, gen=gen), _randn(126, 1, 128, gen=gen)
    out, lse = fused_softmax_attention_varlen(
        q, k, v, cu_q.to(DEVICE), cu_k.to(DEVICE), 70, 64, causal=True, mx_format="mxfp8", dot_mode="fp8"
    )
    ref_out, ref_lse = fused_softmax_attention_reference_varlen(
        q.cpu(), k.cpu(), v.cpu(), cu_q, cu_k, causal=True, mx_format="mxfp8"
    )
    _assert_close_to_reference(out, lse, ref_out, ref_lse, "fp8", "mxfp8")
    finite = torch.isfinite(ref_lse)
    assert (~finite).sum() == 4 * 30  # the last sequence's first 30 rows see no key


@pytest.mark.parametrize("poisoned", ["q", "k", "v"])
def test_nan_input_poisons_its_rows_in_every_dot_mode(poisoned):
    """A NaN in q poisons its row; in k or v, every row that reads its MX block (here: all of them).
    The kernel's clamps must not turn a NaN score or P into a finite number."""
    gen = torch.Generator().manual_seed(15)
    q, k, v = _randn(1, 20, 2, 64, gen=gen), _randn(1, 70, 1, 64, gen=gen), _randn(1, 70, 1, 64, gen=gen)
    {"q": q[0, 7, 1], "k": k[0, 50, 0], "v": v[0, 40, 0]}[poisoned][3] = float("nan")
    ref_out, ref_lse = fused_softmax_attention_reference(q.cpu(), k.cpu(), v.cpu(), tile_n=32)
    expected_rows = 1 if poisoned == "q" else 40
    assert torch.isnan(ref_out).any(-1).sum() == expected_rows
    for dot_mode in ("bf16", "fp8"):
        out, lse = fused_softmax_attention(q, k, v, tile_n=32, dot_mode=dot_mode)
        assert torch.equal(torch.isnan(out.float().cpu()), torch.isnan(ref_out)), dot_mode
        assert torch.equal(torch.isnan(lse.cpu()), torch.isnan(ref_lse)), dot_mode


def test_exact_build_is_bf16_attention():
    gen = torch.Generator().manual_seed(14)
    q, k, v = _randn(1, 33, 2, 64, gen=gen), _randn(1, 70, 2, 64, gen=gen), _randn(1, 70, 2, 64, gen=gen)
    out, lse = fused_softmax_attention(q, k, v, causal=True, exact=True, tile_n=32)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double().cpu(), k.double().cpu()) / 8.0
    s = s.masked_fill(torch.arange(70)[None, :] > torch.arange(33)[:, None] + 37, -math.inf)
    ref = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1), v.double().cpu())
    assert ((out.double().cpu() - ref).norm() / ref.norm()) < 6e-3  # BF16 P and BF16 output
    assert (lse.double().cpu() - s.logsumexp(-1)).abs().max() < 1e-4


@pytest.mark.parametrize(
    "seqlen_q,seqlen_k,causal,tile_n",
    [
        (48, 100, True, 32),  # more keys than queries: unmasked tiles, then the diagonal band
        (70, 40, True, 32),  # fewer: the first 30 rows see no key, the first blocks have no unmasked tile
        (64, 64, False, 32),  # aligned: no masked tile at all
        (50, 77, False, 64),  # a partial last tile
    ],
)
@pytest.mark.parametrize("kv_tile_offsets", [False, True])
def test_exact_twin_unmasked_and_masked_loops(seqlen_q, seqlen_k, causal, tile_n, kv_tile_offsets):
    """Note [Unmasked and masked KV loops], Note [Exact twin: scale folded into exp2] and both forms of Note [KV
    addresses] in kernel.py: the exact twin against float64 softmax attention wherever the split falls (BLOCK_M
    16), with the bounds of test_exact_build_is_bf16_attention; fully masked rows give 0 and an LSE of -inf."""
    from aiter_fused.launch import Launch

    gen = torch.Generator().manual_seed(18)
    q = _randn(2, seqlen_q, 2, 64, gen=gen)
    k, v = _randn(2, seqlen_k, 2, 64, gen=gen), _randn(2, seqlen_k, 2, 64, gen=gen)
    launch = Launch(block_m=16, num_warps=4, tile_n=tile_n, kv_tile_offsets=kv_tile_offsets)
    out, lse = fused_softmax_attention(q, k, v, causal=causal, exact=True, launch=launch)
    s = torch.einsum("bqhd,bkhd->bhqk", q.double().cpu(), k.double().cpu()) / 8.0
    if causal:
        s = s.masked_fill(
            torch.arange(seqlen_k)[None, :] > torch.arange(seqlen_q)[:, None] + seqlen_k - seqlen_q, -math.inf
        )
    seen = torch.isfinite(s).any(-1)  # (b, h, q)
    ref = torch.einsum("bhqk,bkhd->bqhd", s.softmax(-1).nan_to_num(0.0), v.double().cpu())
    assert ((out.double().cpu() - ref).norm() / ref.norm()) < 6e-3
    assert torch.equal(torch.isfinite(lse.cpu()), seen) and torch.all(out.cpu().transpose(1, 2)[~seen] == 0)
    assert (lse.double().cpu()[seen] - s.logsumexp(-1)[seen]).abs().max() < 1e-4


def test_launch_override_changes_no_value():
    """``launch=`` (the tuning script's candidates): BLOCK_M, warps and stages change no value; its tile_n is
    the default tile. Outputs within one BF16 step, LSE to fp32 rounding (the dots' shapes differ)."""
    from aiter_fused.launch import Launch

    gen = torch.Generator().manual_seed(19)
    q, k, v = _randn(1, 40, 2, 64, gen=gen), _randn(1, 90, 2, 64, gen=gen), _randn(1, 90, 2, 64, gen=gen)
    for exact, dot_mode in ((True, None), (False, "bf16")):
        out, lse = fused_softmax_attention(q, k, v, causal=True, exact=exact, dot_mode=dot_mode, tile_n=32)
        other = Launch(block_m=32, num_warps=8, tile_n=32, num_stages=2, kv_tile_offsets=True)
        out2, lse2 = fused_softmax_attention(q, k, v, causal=True, exact=exact, dot_mode=dot_mode, launch=other)
        torch.testing.assert_close(out2.float(), out.float(), rtol=2**-8, atol=0)
        torch.testing.assert_close(lse2, lse, rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ADVERSARIAL)
def test_kernel_never_misses_a_recovery(name):
    """FP8 path, tile_n 64: a tile max taken over two 32-key sub-tiles must see every late score."""
    q, k, v, scale = adversarial_qkv(name, 320)
    q, k, v = (t.bfloat16().to(DEVICE) for t in (q, k, v))
    out, lse, recoveries = fused_softmax_attention(
        q, k, v, softmax_scale=scale, tile_n=64, mx_format="mxfp8", dot_mode="fp8", return_recoveries=True
    )
    ref_out, ref_lse, counters = fused_softmax_attention_reference(
        q.cpu(), k.cpu(), v.cpu(), softmax_scale=scale, tile_n=64, return_counters=True
    )
    assert torch.equal(recoveries.cpu().long(), counters["recoveries"])
    assert torch.isfinite(out.float()).all()
    _assert_close_to_reference(out, lse, ref_out, ref_lse, "fp8", "mxfp8")


def test_dot_mode_the_architecture_cannot_compile_is_refused(monkeypatch):
    """gfx942: Triton 3.6 cannot lower dot_scaled there (Note [Launch table]); a ValueError, not a crash."""
    from aiter_fused import attention, launch

    monkeypatch.setattr(attention, "launch_for", lambda device: ("gfx942", launch.LAUNCHES["gfx942"]))
    q = _randn(1, 8, 1, 64, gen=torch.Generator().manual_seed(17))
    with pytest.raises(
        ValueError,
        match=r"dot_mode='scaled' does not compile for gfx942; accepted there: "
        r"\('bf16', 'fp8'\)",
    ):
        fused_softmax_attention(q, q, q, dot_mode="scaled")


def _summation_order_bound(terms: int) -> float:
    """Note [Row sum by GEMM]: two fp32 sums of ``terms`` non-negative terms, in any two orders, differ by at
    most 2 gamma_n relative (gamma_n = n u / (1 - n u), u = 2**-24)."""
    n_u = terms * 2.0**-24
    return 2 * n_u / (1 - n_u)


@pytest.mark.parametrize(
    "causal,dot_mode", [(False, "bf16"), (True, "bf16"), pytest.param(True, "scaled", marks=_NEEDS_GPU_FOR_SCALED)]
)
def test_row_sum_by_gemm_matches_the_reduction(causal, dot_mode):
    """Note [Row sum by GEMM]: dense and causal, GQA, 83 keys in tiles of 32 (a partial last tile), recoveries at
    threshold 2. Against the reduction only the row sum's fp32 order differs: the same recoveries, the LSE
    within 2 gamma_n (n = keys plus recoveries) plus its own fp32 rounding, the output within 2 gamma_n plus
    one BF16 step; against the reference as every mode."""
    gen = torch.Generator().manual_seed(14)
    q, k, v = _randn(1, 37, 4, 64, gen=gen), _randn(1, 83, 2, 64, gen=gen), _randn(1, 83, 2, 64, gen=gen)
    threshold, scale_log2 = 2.0, 64**-0.5 * math.log2(math.e)
    common = dict(causal=causal, tile_n=32, dot_mode=dot_mode, recovery_threshold=threshold, return_recoveries=True)
    out, lse, recoveries = fused_softmax_attention(q, k, v, row_sum="gemm", **common)
    out_r, lse_r, recoveries_r = fused_softmax_attention(q, k, v, **common)
    assert torch.equal(recoveries, recoveries_r) and recoveries.sum() > 0
    bound = _summation_order_bound(83 + int(recoveries.max()))
    # The LSE's rounding, (m + log2 l) * ln 2 in both runs: three fp32 roundings each of a value below
    # |m| + |log2 l|, with |m| <= max |score| and 1 <= l <= keys * 2**(threshold + 1) (the max's element is 1).
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float().cpu(), k.float().cpu().repeat_interleave(2, dim=2))
    magnitude = scores.abs().max().item() * scale_log2 + math.log2(83) + threshold + 1
    lse_tol = bound + 6 * 2.0**-24 * magnitude
    finite = torch.isfinite(lse_r)
    assert torch.equal(torch.isfinite(lse), finite)
    assert (lse - lse_r)[finite].abs().max().item() <= lse_tol
    out, out_r = out.float(), out_r.float()
    assert torch.all((out - out_r).abs() <= (bound + 2.0**-22 + 2.0**-7) * out_r.abs())
    ref_out, ref_lse = fused_softmax_attention_reference(
        q.cpu(), k.cpu(), v.cpu(), causal=causal, tile_n=32, recovery_threshold=threshold
    )
    _assert_close_to_reference(out, lse, ref_out, ref_lse, dot_mode, "mxfp8")


def _assert_fold_close_to_reference(out, lse, ref_out, ref_lse, moves, keys, head_dim, dot_mode, z_ulp=None):
    """Note [Folded Schraudolph tolerance] (aiter_fused/tolerances.py): the fold's z roundings under the
    interpreter, or the GPU's assumed ones; rows with a quantized-P flip counted, all capped."""
    z_roundings = INTERPRETER_FOLD_Z_ROUNDINGS if DEVICE == "cpu" else gpu_fold_z_roundings(head_dim, dot_mode)
    z_ulp = fold_z_ulp(0.0) if z_ulp is None else z_ulp
    out, ref_out = out.float().cpu(), ref_out.float().cpu()
    assert ((out - ref_out).norm() / ref_out.norm()).item() < fold_out_rel_tol(z_roundings)
    assert torch.equal(torch.isfinite(lse.cpu()), torch.isfinite(ref_lse))
    assert fold_lse_ok(lse.cpu(), ref_lse, moves, keys, z_roundings, z_ulp), lse_stats(lse.cpu(), ref_lse)


@pytest.mark.parametrize(
    "mx_format,causal,dot_mode,row_sum",
    [
        ("mxfp8", False, "bf16", "reduce"),
        ("mxfp8", True, "bf16", "reduce"),
        ("mxfp4", True, "bf16", "reduce"),
        ("mxfp6", False, "bf16", "gemm"),
        pytest.param("mxfp8", False, "scaled", "reduce", marks=_NEEDS_GPU_FOR_SCALED),
        pytest.param("mxfp4", True, "scaled", "gemm", marks=_NEEDS_GPU_FOR_SCALED),
    ],
)
def test_exp_fold_matches_reference(mx_format, causal, dot_mode, row_sum):
    """Note [Folded Schraudolph]: the kernel with exp_fold against the reference with exp_fold, GQA 4:2, 83 keys
    in tiles of 32 (a partial last tile), recoveries at threshold 2 (the re-derivation), row_sum="gemm" too.
    The same recoveries; LSE and output within Note [Folded Schraudolph tolerance]."""
    gen = torch.Generator().manual_seed(11)
    q, k, v = _randn(1, 37, 4, 64, gen=gen), _randn(1, 83, 2, 64, gen=gen), _randn(1, 83, 2, 64, gen=gen)
    common = dict(causal=causal, mx_format=mx_format, tile_n=32, recovery_threshold=2.0)
    out, lse, recoveries = fused_softmax_attention(
        q, k, v, dot_mode=dot_mode, row_sum=row_sum, exp_fold=True, return_recoveries=True, **common
    )
    ref_out, ref_lse, counters = fused_softmax_attention_reference(
        q.cpu(), k.cpu(), v.cpu(), exp_fold=True, return_counters=True, **common
    )
    assert torch.equal(recoveries.cpu().long(), counters["recoveries"]) and counters["recoveries"].sum() > 0
    moves = 1 + int(counters["recoveries"].max())
    _assert_fold_close_to_reference(out, lse, ref_out, ref_lse, moves, 83, 64, dot_mode)


def test_exp_fold_varlen_with_empty_and_fully_masked_rows():
    """exp_fold on the varlen entry: an empty sequence, rows that see no key (the addend stays 0, the max unset:
    out 0, LSE -inf), a 10-key sequence in one partial tile."""
    gen = torch.Generator().manual_seed(13)
    cu_q = torch.tensor([0, 3, 3, 40], dtype=torch.int32)
    cu_k = torch.tensor([0, 70, 75, 85], dtype=torch.int32)
    q, k, v = _randn(40, 2, 32, gen=gen), _randn(85, 1, 32, gen=gen), _randn(85, 1, 32, gen=gen)
    common = dict(causal=True, mx_format="mxfp8", tile_n=32, exp_fold=True)
    out, lse = fused_softmax_attention_varlen(
        q, k, v, cu_q.to(DEVICE), cu_k.to(DEVICE), 37, 70, dot_mode="bf16", **common
    )
    ref_out, ref_lse, counters = fused_softmax_attention_reference_varlen(
        q.cpu(), k.cpu(), v.cpu(), cu_q, cu_k, return_counters=True, **common
    )
    assert torch.all(out[3:30].float() == 0) and torch.all(lse[:, 3:30] == -math.inf)
    moves = 1 + int(counters["recoveries"].max())
    _assert_fold_close_to_reference(out, lse, ref_out, ref_lse, moves, 70, 32, "bf16")


@pytest.mark.parametrize("name", ADVERSARIAL)
def test_exp_fold_extreme_scores(name):
    """Extreme score ranges (a late max, a late 400, a staircase up and down, one score of 3000, all equal):
    every recovery seen on the folded z, and the reference's values. Scores up to 3000 log2 units put the
    addend far past 2**15: the tolerance takes fp32's ulp there (``fold_z_ulp``). Head dim 64: tile 64 at head
    dim 32 is refused on sm90 (Note [sm90 refusals] in aiter_fused/launch.py)."""
    q, k, v, scale = adversarial_qkv(name, 320, d=64)
    q, k, v = (t.bfloat16().to(DEVICE) for t in (q, k, v))
    common = dict(softmax_scale=scale, tile_n=64, mx_format="mxfp8", exp_fold=True)
    out, lse, recoveries = fused_softmax_attention(q, k, v, dot_mode="bf16", return_recoveries=True, **common)
    ref_out, ref_lse, counters = fused_softmax_attention_reference(
        q.cpu(), k.cpu(), v.cpu(), return_counters=True, **common
    )
    unfolded = fused_softmax_attention_reference(
        q.cpu(), k.cpu(), v.cpu(), softmax_scale=scale, tile_n=64, return_counters=True
    )[2]
    assert torch.equal(recoveries.cpu().long(), counters["recoveries"])
    assert torch.equal(counters["recoveries"], unfolded["recoveries"])
    assert torch.isfinite(out.float()).all()
    max_score = (q.float().cpu()[0, :, 0] @ k.float().cpu()[0, :, 0].T).abs().max().item()  # scale: log2 units
    moves = 1 + int(counters["recoveries"].max())
    _assert_fold_close_to_reference(out, lse, ref_out, ref_lse, moves, 320, 64, "bf16", fold_z_ulp(max_score))


def test_exp_fold_nan_input_poisons_its_rows():
    """As test_nan_input_poisons_its_rows_in_every_dot_mode, with exp_fold: a NaN z must stay NaN in P."""
    gen = torch.Generator().manual_seed(15)
    q, k, v = _randn(1, 20, 2, 64, gen=gen), _randn(1, 70, 1, 64, gen=gen), _randn(1, 70, 1, 64, gen=gen)
    for poisoned in (q[0, 7, 1], k[0, 50, 0]):
        poisoned[3] = float("nan")
        ref_out, ref_lse = fused_softmax_attention_reference(q.cpu(), k.cpu(), v.cpu(), tile_n=32, exp_fold=True)
        out, lse = fused_softmax_attention(q, k, v, tile_n=32, dot_mode="bf16", exp_fold=True)
        assert torch.isnan(ref_out).any()
        assert torch.equal(torch.isnan(out.float().cpu()), torch.isnan(ref_out))
        assert torch.equal(torch.isnan(lse.cpu()), torch.isnan(ref_lse))


def test_sm90_refusals_name_the_accepted_tiles():
    """Note [sm90 refusals]: the sm90 launch refuses what the H200 sweep found wrong or out of shared memory, with
    a ValueError naming the kernel, the head dim and the tiles that run; everything else passes."""
    sm90 = LAUNCHES["sm90"]
    assert sm90.refusal(32, 64, "bf16") and sm90.refusal(32, 128, "scaled") and sm90.refusal(256, 64, "exact")
    assert sm90.refusal(256, 128, "bf16") and sm90.refusal(256, 128, "scaled")
    for head_dim, tile_n, kernel in [
        (32, 32, "bf16"),
        (32, 64, "fp8"),
        (32, 128, "exact"),
        (64, 128, "bf16"),
        (128, 64, "scaled"),
        (256, 32, "exact"),
        (256, 64, "bf16"),
        (256, 128, "fp8"),
    ]:
        assert sm90.refusal(head_dim, tile_n, kernel) is None, (head_dim, tile_n, kernel)
    assert all(launch.refusals == () for arch, launch in LAUNCHES.items() if arch != "sm90")


@pytest.mark.parametrize(
    "head_dim,tile_n,kwargs,accepted",
    [
        (32, 64, dict(dot_mode="bf16"), "[32]"),
        (32, None, dict(dot_mode="scaled", exp_fold=True), "[32]"),
        (256, None, dict(exact=True), "[32]"),
        (256, 128, dict(dot_mode="scaled"), "[32, 64]"),
    ],
)
def test_sm90_refusal_reaches_the_public_entry(monkeypatch, head_dim, tile_n, kwargs, accepted):
    """The dispatcher applies the launch's refusals before quantizing anything: with the sm90 entry of the launch
    table (on the CPU: the interpreter told it is an sm90), a refused call raises and names the accepted tiles."""
    from aiter_fused import attention

    monkeypatch.setattr(attention, "launch_for", lambda device: ("sm90", LAUNCHES["sm90"]))
    q = torch.zeros(1, 8, 2, head_dim, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(
        ValueError, match=rf"head_dim={head_dim} with tile_n=\d+ is refused on sm90.*{re.escape(accepted)}"
    ):
        fused_softmax_attention(q, q, q, tile_n=tile_n, **kwargs)


def test_a_custom_launch_on_sm90_inherits_the_refusals(monkeypatch):
    """Note [sm90 refusals]: a caller's `launch=Launch(...)` on sm90 is refused the head-dim-32 fault (not placed)
    as the table's launch is, keeps its own refusals, and is not refused the table's shared-memory limits; it keeps
    the architecture's dot modes; on an architecture without refusals it runs."""
    from aiter_fused import attention
    from aiter_fused.launch import Launch, Refusal

    own = Refusal(64, ("fp8",), (32,), "the caller's own")
    custom = Launch(block_m=16, num_warps=4, tile_n=32, refusals=(own,))
    q = torch.zeros(1, 8, 2, 32, dtype=torch.bfloat16, device=DEVICE)
    monkeypatch.setattr(attention, "launch_for", lambda device: ("sm90", LAUNCHES["sm90"]))
    with pytest.raises(ValueError, match=r"head_dim=32 with tile_n=64 is refused on sm90.*\[32\]"):
        fused_softmax_attention(q, q, q, tile_n=64, dot_mode="bf16", launch=custom)
    q64 = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="the caller's own"):
        fused_softmax_attention(q64, q64, q64, dot_mode="fp8", launch=custom)
    # The shared-memory refusals are the table's launch's resources (inherited=False): a caller's launch at head
    # dim 256, tile 128 passes the dispatcher where the table's is refused.
    q256 = torch.zeros(1, 8, 2, 256, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim=256 with tile_n=128 is refused on sm90"):
        fused_softmax_attention(q256, q256, q256, tile_n=128, dot_mode="bf16")
    if DEVICE == "cpu":  # on a GPU this launch meets the device's own shared-memory limit, not measured here
        out, _ = fused_softmax_attention(q256, q256, q256, tile_n=128, dot_mode="bf16", launch=custom)
        assert out.shape == q256.shape and torch.isfinite(out.float()).all()
    # A caller's launch keeps the architecture's dot modes: gfx942 compiles no "scaled".
    monkeypatch.setattr(attention, "launch_for", lambda device: ("gfx942", LAUNCHES["gfx942"]))
    with pytest.raises(ValueError, match="does not compile for gfx942"):
        fused_softmax_attention(q, q, q, dot_mode="scaled", launch=custom)
    monkeypatch.setattr(attention, "launch_for", lambda device: ("interpreter", LAUNCHES["interpreter"]))
    out, _ = fused_softmax_attention(q, q, q, tile_n=64, dot_mode="bf16", launch=custom)
    assert out.shape == q.shape and torch.isfinite(out.float()).all()


def test_bad_arguments():
    q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(TypeError, match="bfloat16"):
        fused_softmax_attention(q.float(), q, q)
    with pytest.raises(ValueError, match="mx_format"):
        fused_softmax_attention(q, q, q, mx_format="mxfp16")
    with pytest.raises(ValueError, match="head_dim"):
        fused_softmax_attention(q[..., :48], q[..., :48], q[..., :48])
    with pytest.raises(ValueError, match="heads"):
        fused_softmax_attention(q, q[:, :, :1].expand(1, 8, 3, 64), q[:, :, :1].expand(1, 8, 3, 64))
    with pytest.raises(ValueError, match="recovery_threshold"):
        fused_softmax_attention(q, q, q, recovery_threshold=-1.0)
    with pytest.raises(ValueError, match="tile_n"):
        fused_softmax_attention(q, q, q, tile_n=48)
    with pytest.raises(ValueError, match="dot_mode"):
        fused_softmax_attention(q, q, q, dot_mode="fp16")
    with pytest.raises(TypeError, match="launch must be None"):
        fused_softmax_attention(q, q, q, launch="sm90")
    with pytest.raises(ValueError, match="row_sum must be one of"):
        fused_softmax_attention(q, q, q, row_sum="sum")
    for refused in (dict(exact=True), dict(dot_mode="fp8")):
        with pytest.raises(ValueError, match='row_sum="gemm" takes'):
            fused_softmax_attention(q, q, q, row_sum="gemm", **refused)
    for refused in (dict(exact=True), dict(dot_mode="fp8")):
        with pytest.raises(ValueError, match=r"exp_fold=True takes the MX dot modes \('bf16', 'scaled'\)"):
            fused_softmax_attention(q, q, q, exp_fold=True, **refused)
    with pytest.raises(TypeError, match="exp_fold must be a bool"):
        fused_softmax_attention(q, q, q, exp_fold="on")
    cu = torch.tensor([0, 8], dtype=torch.int64, device=DEVICE)
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        fused_softmax_attention_varlen(q[0], q[0], q[0], cu, cu, 8, 8)
    with pytest.raises(TypeError, match="cu_seqlens_q"):  # metadata checks stay on without validate
        fused_softmax_attention_varlen(q[0], q[0], q[0], cu, cu, 8, 8, validate=False)
    cu = torch.tensor([0, 8], dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        fused_softmax_attention_varlen(q[0], q[0], q[0], cu, cu, 7, 8)
    with pytest.raises(ValueError, match="cu_seqlens_k must start at 0"):
        fused_softmax_attention_varlen(q[0], q[0], q[0], cu, cu.flip(0), 8, 8)


_SM90_COMPILE = textwrap.dedent(r"""
    import json, re, triton, triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from aiter_fused.kernel import _fused_softmax_attn_fwd as kernel
    pointers = dict(Q="*fp8e4nv", K="*fp8e4nv", V="*fp8e4nv", Q_scale="*u8", K_scale="*u8", V_scale="*u8",
                    Out="*bf16", Lse="*fp32", Recoveries="*i32", cu_seqlens_q="*i32", cu_seqlens_k="*i32",
                    cu_blocks_k="*i32")
    instructions = {}
    for mode in ("fp8", "bf16"):
        constants = dict(GROUP=2, HEAD_DIM=64, BLOCK_M=64, BLOCK_N=64, CAUSAL=True, EXACT=False, DOT_MODE=mode,
                         OPERAND_FORMAT="e4m3", DOT_DTYPE=tl.bfloat16, RETURN_RECOVERIES=True, P_MANTISSA=3,
                         P_MIN_EXPONENT=0, P_MAX_NORMAL=7.5, P_MAX_MANTISSA_BITS=0x700000, P_MAX_EXPONENT=2,
                         KV_TILE_OFFSETS=False, ROW_SUM_GEMM=False, EXP_FOLD=False, P_CONVERT="software")
        signature = {name: pointers.get(name, "constexpr" if name in constants else
                                        "fp32" if name in ("scale_log2", "recovery_threshold") else "i32")
                     for name in kernel.arg_names}
        compiled = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": 4})
        instructions[mode] = sorted(set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.\S+", compiled.asm["ptx"])))
    print(json.dumps(instructions))
""")


def test_kernel_compiles_for_sm90(tmp_path):
    """The CUDA build on the CPU (no GPU needed; Triton ships ptxas): the source compiles for sm_90 with
    no architecture keyword and no plain-float global (the interpreter accepts both), and each mode's
    dots become Hopper wgmma instructions of its operand type: e4m3 x e4m3 -> f32 for "fp8" (QK^T in
    m64n32k32 sub-tiles, P@V m64n64k32), bf16 for "bf16". A subprocess: this module runs Triton in
    interpreter mode."""
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    env.update(TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    result = subprocess.run(
        [sys.executable, "-c", _SM90_COMPILE],
        capture_output=True,
        text=True,
        env=env,
        cwd=Path(__file__).resolve().parent.parent,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    instructions = json.loads(result.stdout.strip().splitlines()[-1])
    assert instructions["fp8"] == [
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3",
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3",
    ], instructions
    assert instructions["bf16"] and all(name.endswith(".f32.bf16.bf16") for name in instructions["bf16"]), instructions


@pytest.mark.gpu
def test_default_dot_mode_and_no_host_sync():
    """FP8 dots by default on Hopper; neither entry reads the GPU back (validate=False for varlen), so
    the calls are CUDA-graph capturable: torch's sync debug mode turns any sync into an error."""
    from aiter_fused.attention import _default_dot_mode
    from aiter_fused.launch import arch_of

    major = torch.cuda.get_device_capability()[0]
    if torch.version.hip is None:
        assert _default_dot_mode(arch_of(torch.device("cuda"))) == {9: "fp8"}.get(
            major, "scaled" if major >= 10 else "bf16"
        )
    gen = torch.Generator().manual_seed(16)
    q, k, v = _randn(2, 100, 4, 64, gen=gen), _randn(2, 90, 2, 64, gen=gen), _randn(2, 90, 2, 64, gen=gen)
    cu_q = torch.tensor([0, 100, 200], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 90, 180], dtype=torch.int32, device=DEVICE)
    for dot_mode in ("bf16", "fp8"):
        fused_softmax_attention(q, k, v, dot_mode=dot_mode)  # compile outside the checked region
        fused_softmax_attention_varlen(
            q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, 100, 90, dot_mode=dot_mode, validate=False
        )
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            dense, _ = fused_softmax_attention(q, k, v, dot_mode=dot_mode)
            packed, _ = fused_softmax_attention_varlen(
                q.flatten(0, 1),
                k.flatten(0, 1),
                v.flatten(0, 1),
                cu_q,
                cu_k,
                100,
                90,
                dot_mode=dot_mode,
                validate=False,
            )
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert torch.equal(dense.flatten(0, 1), packed)
