"""Closed-form fp64 attention backends for the gate tests (test_gates.py, test_gates_fp8.py): whole-row anchor,
no tiles, written independently of the library's reference so that a bug shared by the two cannot hide; one
correct H15 backend, an exact one, and deliberately wrong ones the gates must fail."""

import functools
import math

import torch


def h15_fp64(y: torch.Tensor, lattice_shift: int = 0) -> torch.Tensor:
    """H(y) = 2^floor(n/2) * (1 + (n mod 2)/2), n = round_half_even(2y) (+ a wrong shift when asked)."""
    n = torch.round(2 * y) + lattice_shift
    return torch.exp2(torch.floor(n / 2)) * (1 + torch.remainder(n, 2) / 2)


def fp64_scores(q, k, v, causal, score_noise=0.0):
    """(x, v64): the log2-domain scores q k^T / sqrt(d) * log2(e) in fp64, (batch, heads_q, seqlen_q, seqlen_k), with
    bottom-right causal masking as -inf, and V in fp64 with its heads repeated for GQA, (batch, heads_q, keys, d)."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    group = heads_q // heads_k
    q64 = q.double().permute(0, 2, 1, 3)
    k64 = k.double().permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
    v64 = v.double().permute(0, 2, 1, 3).repeat_interleave(group, dim=1)
    x = q64 @ k64.transpose(-1, -2) * head_dim**-0.5 * math.log2(math.e)
    if score_noise:
        # Stands for a kernel's own fp32 score rounding: same seed every call, so the LSE agrees.
        generator = torch.Generator().manual_seed(1234)
        x = x + score_noise * (2 * torch.rand(x.shape, generator=generator, dtype=torch.float64) - 1)
    if causal:
        rows = torch.arange(seqlen_q).unsqueeze(1)
        cols = torch.arange(seqlen_k).unsqueeze(0)
        x = x.masked_fill(cols > rows + seqlen_k - seqlen_q, -math.inf)
    return x, v64


def closed_form_attention(q, k, v, causal, *, weights, edit_p=None, score_noise=0.0):
    """out = P @ V in fp64 with P = weights(x - rowmax) normalised; lse consistent with that P."""
    x, v64 = fp64_scores(q, k, v, causal, score_noise)
    m = x.amax(dim=-1, keepdim=True)
    w = torch.where(x == -math.inf, 0.0, weights(x - m))
    if edit_p is not None:
        w = edit_p(w)
    total = w.sum(dim=-1, keepdim=True)
    p = torch.where(total > 0, w / total, 0.0)
    lse = torch.where(total > 0, total.log() + m * math.log(2), -math.inf).squeeze(-1)
    out = (p @ v64).permute(0, 2, 1, 3).to(q.dtype)
    return out, lse.to(torch.float32)


def h15_backend(q, k, v, causal):
    return closed_form_attention(q, k, v, causal, weights=h15_fp64)


def exact_backend(q, k, v, causal):
    return closed_form_attention(q, k, v, causal, weights=torch.exp2)


def shifted_lattice_backend(q, k, v, causal):
    return closed_form_attention(q, k, v, causal, weights=functools.partial(h15_fp64, lattice_shift=1))


def rows_swapped_backend(q, k, v, causal, rows=(10, 20)):
    out, lse = h15_backend(q, k, v, causal)
    a, b = rows
    out[:, [a, b]] = out[:, [b, a]]
    lse[:, :, [a, b]] = lse[:, :, [b, a]]
    return out, lse


class OneOctaveOffBackend:
    """H15 with one weight doubled (P renormalised, LSE kept consistent). The key is the row's median
    weight, so the row-sum change stays small and that element is the worst one."""

    def __init__(self, batch, head, row):
        self.batch, self.head, self.row = batch, head, row
        self.col = None

    def _double_one(self, w):
        row = w[self.batch, self.head, self.row]
        keys = row.nonzero().squeeze(-1)
        self.col = int(keys[row[keys].argsort()[len(keys) // 2]])
        w = w.clone()
        w[self.batch, self.head, self.row, self.col] *= 2
        return w

    def __call__(self, q, k, v, causal):
        return closed_form_attention(q, k, v, causal, weights=h15_fp64, edit_p=self._double_one)
