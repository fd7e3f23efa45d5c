"""The Fused-Softmax formats as Hugging Face transformers attention implementations, through the helper of
`fa4_rowmax.hf` (same backends, masks, counters and naming: `"fused_mxfp8"` on the reference,
`"kernel_fused_mxfp8"` on `aiter_fused.attention.fused_softmax_attention`).

    from aiter_fused import hf
    hf.register()                      # or hf.register(["fused_mxfp4"], backend="kernel")
    model.set_attn_implementation("fused_mxfp4")

The kernel reports one counter, its recoveries (rows whose frozen max was exceeded and recomputed).
"""

from __future__ import annotations

from fa4_rowmax import hf as rowmax_hf
from fa4_rowmax.hf import ModeSpec
from fa4_rowmax.reference.fused_softmax import hybrid_format

# Note [Hybrid MX schedule for an LLM]
# The Fused-Softmax paper's hybrid runs MXFP6 for the first and last three of twenty diffusion steps and
# MXFP4 between. A decoder has no denoising steps; the analogue is depth. We run MXFP6 in the first and
# last three layers and MXFP4 in between: the first layers build the attention sinks and positional
# patterns every later layer reads, and the last layers feed the output distribution directly, so an
# error there is not washed out by later layers. For SmolLM2-135M (30 layers) that is 6 MXFP6 layers
# and 24 MXFP4 layers (20% at six bits, against the paper's 6 of 20 steps).
HYBRID_EDGE_LAYERS = 3
FORMATS = ("mxfp8", "mxfp6", "mxfp4")


def hybrid_mx_format(layer_idx: int, num_layers: int) -> str:
    """`mxfp6` in the first and last `HYBRID_EDGE_LAYERS` layers, `mxfp4` between (Note [Hybrid MX schedule])."""
    return hybrid_format(layer_idx, num_layers, edge_steps=HYBRID_EDGE_LAYERS)


def _hybrid_fields(layer_idx: int, num_layers: int) -> dict:
    return {"mx_format": hybrid_mx_format(layer_idx, num_layers)}


def _fused_kernel(spec: ModeSpec):
    from aiter_fused.attention import fused_softmax_attention

    def call(module, q, k, v, causal, scale):
        mx_format = spec.config(module.layer_idx, module.config.num_hidden_layers).mx_format
        out, recoveries = fused_softmax_attention(
            q,
            k,
            v,
            causal=causal,
            softmax_scale=scale,
            mx_format=mx_format,
            return_lse=False,
            return_recoveries=True,
        )
        return out, {"recoveries": int(recoveries.sum())}

    return call


def _mode_table() -> dict[str, ModeSpec]:
    specs = [
        ModeSpec(
            f"fused_{fmt}",
            f"Fused-Softmax, {fmt.upper()} operands",
            {"mode": "fused_softmax", "mx_format": fmt},
            "aiter_fused",
            kernel_factory=_fused_kernel,
        )
        for fmt in FORMATS
    ]
    specs.append(
        ModeSpec(
            "fused_hybrid",
            f"Fused-Softmax, MXFP6 in the first and last {HYBRID_EDGE_LAYERS} layers, MXFP4 between",
            {"mode": "fused_softmax"},
            "aiter_fused",
            layer_fields=_hybrid_fields,
            kernel_factory=_fused_kernel,
        )
    )
    return {s.name: s for s in specs}


MODES: dict[str, ModeSpec] = _mode_table()


def register(modes=None, backend: str = "reference") -> dict[str, str]:
    """Register `modes` (default: every Fused-Softmax mode) with transformers; returns {mode: attention name}."""
    return rowmax_hf.register(modes, backend, table=MODES)


def make_attention_function(mode: str, backend: str = "reference"):
    return rowmax_hf.make_attention_function(mode, backend, MODES)
