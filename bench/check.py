"""Benchmark inputs, the fp32 reference and the correctness gate a kernel must pass before its time counts.

The gate checks one (or two) batch entries, every head, against attention computed in fp32 by PyTorch's
math SDPA backend from the very tensors the kernel read (so input rounding is not counted as kernel
error). Tolerances are per kernel and dtype: bench/kernels.py, Note [Gate tolerances].
"""

from __future__ import annotations

import dataclasses
import math

import torch

from bench.kernels import TORCH_DTYPES
from bench.sweep import Shape


def make_inputs(
    shape: Shape, n_sets: int, device: torch.device | str, seed: int
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """`n_sets` independent (q, k, v) triples, entries N(0, 1) rounded to the shape's dtype."""
    if n_sets < 1:
        raise ValueError(f"n_sets must be >= 1, got {n_sets}")
    generator = torch.Generator(device=device).manual_seed(seed)
    dtype = TORCH_DTYPES[shape.dtype]
    # FP8 has no randn: draw in bf16 and round (values beyond e4m3's 448 cannot occur for N(0, 1) draws).
    draw_dtype = torch.bfloat16 if shape.dtype == "fp8" else dtype

    def draw(heads):
        x = torch.randn(
            shape.batch, shape.seqlen, heads, shape.head_dim, device=device, dtype=draw_dtype, generator=generator
        )
        return x.to(dtype)

    return [(draw(shape.heads_q), draw(shape.heads_kv), draw(shape.heads_kv)) for _ in range(n_sets)]


def reference_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    batch_indices: list[int] | None = None,
    softmax_scale: float | None = None,
) -> torch.Tensor:
    """fp32 attention in FlashAttention layout, (len(batch_indices), seqlen_q, heads_q, head_dim).

    One (batch, head) at a time so a 32K x 32K score matrix is the largest temporary (4 GiB). GQA: query
    head h reads kv head h // (heads_q // heads_kv). Causal is aligned bottom-right (query i sees keys
    j <= i + seqlen_k - seqlen_q); a fully masked row gives 0 (FA4's convention; SDPA would give NaN).
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError("q, k, v must be 4-D (batch, seqlen, heads, head_dim)")
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    if heads_q % heads_kv:
        raise ValueError(f"heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv})")
    batch_indices = list(range(batch)) if batch_indices is None else batch_indices
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    group = heads_q // heads_kv
    mask = None
    if causal and seqlen_q != seqlen_k:
        rows = torch.arange(seqlen_q, device=q.device)[:, None]
        mask = torch.arange(seqlen_k, device=q.device)[None, :] <= rows + (seqlen_k - seqlen_q)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = torch.empty(len(batch_indices), seqlen_q, heads_q, v.shape[-1], device=q.device, dtype=torch.float32)
    precision = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # no TF32 in the reference
    try:
        with sdpa_kernel(SDPBackend.MATH):
            for i, b in enumerate(batch_indices):
                for h in range(heads_q):
                    o = torch.nn.functional.scaled_dot_product_attention(
                        q[b, :, h].float()[None],
                        k[b, :, h // group].float()[None],
                        v[b, :, h // group].float()[None],
                        attn_mask=mask,
                        is_causal=causal and mask is None,
                        scale=scale,
                    )[0]
                    out[i, :, h] = o
    finally:
        torch.set_float32_matmul_precision(precision)
    if mask is not None:
        out[:, ~mask.any(dim=1)] = 0.0
    return out


def check_batches(batch: int) -> list[int]:
    """The batch entries the gate looks at: the first and the last (catches batch-stride mistakes)."""
    return [0] if batch == 1 else [0, batch - 1]


@dataclasses.dataclass(frozen=True)
class CheckResult:
    passed: bool
    rel_err: float | None
    max_abs_err: float | None
    tolerance: float
    reason: str  # empty when passed

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def relative_frobenius_error(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """(||out - ref||_F / ||ref||_F, max |out - ref|), both in fp64; the ratio is inf when ref is all zeros.
    Shapes must match."""
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"out shape {tuple(out.shape)} != reference shape {tuple(ref.shape)}")
    diff = out.double() - ref.double()
    diff_norm = float(torch.linalg.vector_norm(diff))
    ref_norm = float(torch.linalg.vector_norm(ref.double()))
    rel_err = diff_norm / ref_norm if ref_norm > 0 else math.inf
    return rel_err, float(diff.abs().max()) if diff.numel() else 0.0


def check_output(out: torch.Tensor, ref: torch.Tensor, tolerance: float) -> CheckResult:
    """Pass when `out` is finite and ||out - ref||_F / ||ref||_F <= tolerance."""
    if not tolerance > 0:
        raise ValueError(f"tolerance must be > 0, got {tolerance!r}")
    if tuple(out.shape) != tuple(ref.shape):
        return CheckResult(False, None, None, tolerance, f"shape {tuple(out.shape)} != reference {tuple(ref.shape)}")
    bad = int((~torch.isfinite(out.double())).sum())
    if bad:
        return CheckResult(False, None, None, tolerance, f"{bad} non-finite output values")
    rel_err, max_abs = relative_frobenius_error(out, ref)
    if not rel_err <= tolerance:
        return CheckResult(
            False, rel_err, max_abs, tolerance, f"relative error {rel_err:.3g} > tolerance {tolerance:g}"
        )
    return CheckResult(True, rel_err, max_abs, tolerance, "")
