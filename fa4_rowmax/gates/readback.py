"""Reading the normalised probabilities P out of any attention backend, with no debug hooks.

A backend is any callable ``backend(q, k, v, causal) -> (out, lse)`` in FlashAttention's layout
(docs/design.md); it is called with ``causal`` as a keyword, so
``functools.partial(attention_reference, config=...)`` is a backend as it stands. With ``V`` one-hot over
a block of keys, ``out = P @ V`` copies that block of each P row into the output row, so
``ceil(seqlen_k / head_dim_v)`` calls read the whole of P. The LSE the backend
returns gives each row's normaliser, and with it the unnormalised weights.

Note [P readback through one-hot V]
    For key block ``b`` (keys ``j0 = b * D`` to ``j0 + D - 1``, ``D`` = V's head dim) set
    ``V[:, j0 + d, :, d] = 1`` and every other entry 0. Output column ``d`` of query row ``i`` is then
    ``sum_j P[i, j] V[j, d] = P[i, j0 + d]``: a single nonzero product, so no accumulation error enters;
    what comes back is the kernel's P as its output dtype holds it (the kernel's own P rounding, its
    division by the row sum, one rounding to the output dtype). 1.0 is exact in every floating dtype a V
    can have (fp32, bf16, fp16, e4m3, e5m2), so the one-hot V itself adds nothing. The same V serves every
    KV head, so GQA needs nothing special. The LSE does not depend on V: every call returns the same one
    for a deterministic backend; ``lse_spread`` records the largest disagreement seen.

Note [Unnormalised weights from P and the LSE]
    A FlashAttention-style forward keeps, per row, an anchor ``m`` (log2 units) and a row sum ``l`` of the
    weights relative to it, and returns ``lse = ln(l) + m * ln(2)``. So
        ``log2(w_hat_j) = log2(P_j) + lse * log2(e) = log2(w_rel_j) + m``,
    i.e. ``w_hat_j`` is the kernel's weight of key ``j`` on the absolute scale (relative to ``2^0``),
    whatever anchors it used internally. The exact weight on that scale is ``w_j = 2^(x_j)`` with
    ``x_j = s_j * softmax_scale * log2(e)``, so ``log2(w_hat_j / w_j) = log2(P_j) + lse*log2(e) - x_j``.
    For Rowmax-H15 key ``j`` was weighted ``H(x_j - m_t)`` against the anchor ``m_t`` in force when its
    tile was processed, then rescaled by ``2^(m_t - m_final)`` (exact up to fp32 rounding), hence
        ``log2(w_hat_j / w_j) = log2(H(y)) - y``, ``y = x_j - m_t``,  which lies in ``[-0.25, +0.335]``
    for ANY anchor schedule (whole-row max, per-tile running max, stale max under ``rescale_threshold``).
    The paper reads the same quantity differently: it takes the per-row normalisation shift at the row
    max, ``delta_i = log2(P_kernel / P_exact)`` at ``j* = argmax_j x_j``, and recovers
    ``log2(w_hat_j / w_j) ~ log2(P_kernel_j / P_exact_j) - delta_i``. The two views differ by exactly
    ``e* = log2(w_hat_j* / w_j*)``, the kernel's own lattice error at the row max. ``e* = 0`` whenever the
    anchor sits on the row max (threshold 0: the running max always moves onto the row max, and
    ``H(0) = 1``); under a stale max (threshold > 0, row max arriving in a later tile within the threshold)
    ``e*`` is itself a lattice error and the row-max view reports ``e_j - e*``, which lies in
    ``[-0.585, +0.585]`` rather than the envelope. The gates report both views (gates.py).

Note [Underflow of P in the output dtype]
    P is read in the output dtype. bf16 keeps fp32's 8-bit exponent: P is a normal number down to
    ``2^-126`` (subnormal to ``2^-133``), so in practice only weights more than ~126 octaves below the row
    sum are lost, which is also where Rowmax-H15 clamps its argument (-127). fp16 has a 5-bit exponent:
    normal only down to ``2^-14`` (~6.1e-5), subnormal to ``2^-24``; a key 14 octaves below its row sum
    already loses relative precision and 24 octaves below reads 0. In those elements ``log2(P)`` is
    ``-inf`` or off by far more than rounding, which says nothing about the softmax. The readback returns P
    exactly as read (zeros included); ``resolvable`` marks the elements whose expected value is a normal
    number of the output dtype, the only ones a ratio test can judge. The gates check the others in
    absolute terms.
"""

import math
from dataclasses import dataclass
from typing import Callable

import torch

Backend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class ProbabilityReadback:
    """P as one backend computes it, and the LSE it returned (Note [P readback through one-hot V])."""

    p: torch.Tensor  # float64 (batch, heads_q, seqlen_q, seqlen_k): normalised P, as the output dtype holds it
    lse: torch.Tensor  # float64 (batch, heads_q, seqlen_q): the backend's LSE (natural log), first call
    out_dtype: torch.dtype  # dtype of the backend's `out`: it sets the rounding P carries
    lse_spread: float  # largest |LSE difference| between the calls (0.0 for a deterministic backend)
    calls: int  # backend calls made (one per block of head_dim_v keys)

    @property
    def log2_weights(self) -> torch.Tensor:
        """``log2(w_hat)``, the unnormalised weights (Note [Unnormalised weights from P and the LSE])."""
        return unnormalised_log2_weights(self.p, self.lse)


def _check_qk(q: torch.Tensor, k: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(
                f"{name} must be 4-D (batch, seqlen, heads, head_dim) in FlashAttention's layout, "
                f"got shape {tuple(t.shape)}"
            )
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch, got {q.shape[0]} and {k.shape[0]}")
    if q.shape[2] % k.shape[2] != 0:
        raise ValueError(f"heads_q ({q.shape[2]}) must be a multiple of heads_k ({k.shape[2]}) (GQA)")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q and k must have the same head_dim, got {q.shape[3]} and {k.shape[3]}")


def one_hot_value_block(k: torch.Tensor, block: int, head_dim_v: int) -> torch.Tensor:
    """V of k's batch, seqlen, heads, dtype and device: identity over keys ``block * head_dim_v ...``."""
    batch, seqlen_k, heads_k, _ = k.shape
    first_key = block * head_dim_v
    if not 0 <= first_key < seqlen_k:
        raise ValueError(f"block must be in [0, {math.ceil(seqlen_k / head_dim_v)}), got {block}")
    # Built in float32, then converted (0 and 1 are exact in every dtype): the indexed store then needs no
    # FP8 kernel on any device.
    v = torch.zeros(batch, seqlen_k, heads_k, head_dim_v, dtype=torch.float32, device=k.device)
    keys = torch.arange(first_key, min(first_key + head_dim_v, seqlen_k), device=k.device)
    v[:, keys, :, keys - first_key] = 1
    return v.to(k.dtype)


def read_probabilities(
    backend: Backend, q: torch.Tensor, k: torch.Tensor, *, causal: bool, head_dim_v: int | None = None
) -> ProbabilityReadback:
    """Read the full normalised P of ``backend`` on ``(q, k)`` with one backend call per block of keys.

    ``head_dim_v`` is V's head dim, the number of keys read per call (default: k's head_dim).
    """
    if not callable(backend):
        raise TypeError(f"backend must be a callable (q, k, v, causal) -> (out, lse), got {type(backend).__name__}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    _check_qk(q, k)
    head_dim_v = k.shape[3] if head_dim_v is None else head_dim_v
    if not isinstance(head_dim_v, int) or head_dim_v < 1:
        raise ValueError(f"head_dim_v must be a positive int, got {head_dim_v!r}")
    batch, seqlen_q, heads_q, _ = q.shape
    seqlen_k = k.shape[1]
    p = torch.empty(batch, heads_q, seqlen_q, seqlen_k, dtype=torch.float64, device=q.device)
    lse_first, out_dtype, lse_spread = None, None, 0.0
    calls = math.ceil(seqlen_k / head_dim_v)
    for block in range(calls):
        # causal by keyword: `functools.partial(attention_reference, config=...)` takes it keyword-only.
        result = backend(q, k, one_hot_value_block(k, block, head_dim_v), causal=causal)
        if not (isinstance(result, tuple) and len(result) == 2):
            raise TypeError(f"backend must return a tuple (out, lse), got {type(result).__name__}")
        out, lse = result
        if tuple(out.shape) != (batch, seqlen_q, heads_q, head_dim_v):
            raise ValueError(
                f"backend returned out of shape {tuple(out.shape)}, expected "
                f"{(batch, seqlen_q, heads_q, head_dim_v)} (q's shape with V's head dim)"
            )
        if tuple(lse.shape) != (batch, heads_q, seqlen_q):
            raise ValueError(f"backend returned lse of shape {tuple(lse.shape)}, expected {(batch, heads_q, seqlen_q)}")
        first_key = block * head_dim_v
        n_keys = min(head_dim_v, seqlen_k - first_key)
        p[..., first_key : first_key + n_keys] = out[..., :n_keys].permute(0, 2, 1, 3).to(torch.float64)
        lse = lse.to(torch.float64)
        if lse_first is None:
            lse_first, out_dtype = lse, out.dtype
        else:
            # Equal infinities (fully masked rows) agree; NaN anywhere counts as disagreement.
            differs = (lse != lse_first) | lse.isnan() | lse_first.isnan()
            if differs.any():
                lse_spread = max(lse_spread, (lse - lse_first)[differs].abs().nan_to_num(nan=math.inf).max().item())
    return ProbabilityReadback(p=p, lse=lse_first, out_dtype=out_dtype, lse_spread=lse_spread, calls=calls)


def unnormalised_log2_weights(p: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """``log2(w_hat) = log2(P) + lse * log2(e)`` in float64 (Note [Unnormalised weights from P and the LSE]).

    ``p`` (..., seqlen_q, seqlen_k), ``lse`` (..., seqlen_q). Elements with ``P = 0`` give ``-inf``.
    """
    if p.shape[:-1] != lse.shape:
        raise ValueError(
            f"lse shape {tuple(lse.shape)} must equal p's shape without its last dim {tuple(p.shape[:-1])}"
        )
    return p.to(torch.float64).log2() + lse.to(torch.float64).unsqueeze(-1) * math.log2(math.e)


def resolvable(p_expected: torch.Tensor, dtype: torch.dtype, *, headroom_log2: float = 0.0) -> torch.Tensor:
    """Elements whose expected P, and any P up to ``headroom_log2`` octaves below it, is a normal number of
    ``dtype`` (Note [Underflow of P in the output dtype])."""
    return p_expected >= torch.finfo(dtype).tiny * 2.0**headroom_log2


def unit_roundoff(dtype: torch.dtype) -> float:
    """Largest relative error of rounding to nearest in ``dtype`` (half its machine epsilon)."""
    return torch.finfo(dtype).eps / 2
