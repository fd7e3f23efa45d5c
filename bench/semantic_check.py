"""The benchmark's gate for FA4 kernels with a softmax stage (rowmax_h15, rowmax_pot, exact with knobs): the
kernel's output against the semantic reference of the same stage, within the per-row bounds of
`fa4_rowmax.gates.tolerances` (Note [Kernel vs reference: lattice flips]), instead of a relative error against
exact attention (which an approximate mode misses by design, so its tolerance had to be loose enough for a
wrong kernel to pass).

To stay cheap at 32K tokens, the check takes the last `rows` query rows of batch entry 0 (every head): with
causal masks aligned bottom-right, row i sees keys j <= i + seqlen_k - seqlen_q, which is the same set for the
sliced query block, and FA4's per-row running state is independent of the other rows, so the slice is exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CHECK_ROWS = 256
FA4_TILE_N = 128  # FA4's SM90 and SM100 forward key-block size at head dim <= 128


@dataclass
class SemanticCheck:
    passed: bool
    worst_excess: float  # max over rows of (error - bound); <= 0 passes
    max_error: float
    fragile_elements: int
    decision_rows: int
    rows: int
    reason: str

    def as_dict(self) -> dict:
        return {
            "kind": "semantic",
            "passed": self.passed,
            "worst_excess": self.worst_excess,
            "max_abs_err": self.max_error,
            "fragile_elements": self.fragile_elements,
            "decision_rows": self.decision_rows,
            "rows": self.rows,
            "reason": self.reason,
        }


def stage_config(knobs: dict, q: torch.Tensor, arch: int | None = None):
    """The reference configuration of the stage these FA4 keyword arguments select on `arch` (default: q's GPU)."""
    from fa4_rowmax.interface import SoftmaxStage, softmax_stage

    knobs = dict(knobs)
    stage = (
        softmax_stage(
            knobs.pop("softmax_mode", "exact"),
            knobs.pop("rescale_threshold", None),
            knobs.pop("beta", None),
            anchor_rounding=knobs.pop("anchor_rounding", "exact"),
            rescale_vote=knobs.pop("rescale_vote", False),
        )
        or SoftmaxStage()
    )
    if knobs:
        raise ValueError(f"unknown FA4 stage arguments {sorted(knobs)}")
    if arch is None:
        major, minor = torch.cuda.get_device_capability(q.device)
        arch = 10 * major + minor
    return stage.for_kernel(arch=arch, q_dtype=q.dtype).reference_config(tile_n=FA4_TILE_N)


def semantic_check(
    knobs: dict,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    out: torch.Tensor,
    rows: int = CHECK_ROWS,
    arch: int | None = None,
) -> SemanticCheck:
    """`out` (the kernel's, (B, Sq, Hq, D)) against the reference of its stage on the last `rows` rows of entry 0."""
    from fa4_rowmax.gates.tolerances import kernel_bounds
    from fa4_rowmax.reference.attention import attention_reference

    config = stage_config(knobs, q, arch)
    rows = min(rows, q.shape[1])
    q_rows, k0, v0 = q[:1, -rows:], k[:1], v[:1]
    ref_out, _ = attention_reference(q_rows, k0, v0, config, causal=causal)
    bounds = kernel_bounds(q_rows, k0, v0, config, causal=causal, out_dtype=out.dtype)
    got = out[:1, -rows:].float()
    if not torch.isfinite(got).all():
        return SemanticCheck(
            False, float("inf"), float("inf"), bounds.fragile_elements, bounds.decision_rows, rows, "non-finite output"
        )
    error = (got - ref_out.float()).abs().amax(-1, keepdim=True)
    excess = float((error - bounds.out.to(error.device)).max())
    passed = excess <= 0 and bounds.decision_rows <= 0.01 * bounds.lse.numel()
    reason = (
        ""
        if passed
        else (
            f"a row exceeds its bound by {excess:.3g}"
            if excess > 0
            else f"{bounds.decision_rows} rows at a threshold decision"
        )
    )
    return SemanticCheck(
        passed, excess, float(error.max()), bounds.fragile_elements, bounds.decision_rows, rows, reason
    )
