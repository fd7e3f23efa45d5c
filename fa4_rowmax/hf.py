"""The rowmax, exact and BAPS softmax modes as Hugging Face transformers attention implementations, and the
small helper every package's modes share (`ModeSpec`, `make_attention_function`, `register`); the
Fused-Softmax formats register through the same helper from `aiter_fused.hf`.

`register()` adds one attention function per mode to `transformers.AttentionInterface` (and the matching
mask builder to `transformers.masking_utils.AttentionMaskInterface`, so causality and padding reach the
function), after which `model.set_attn_implementation(name)` runs the model through that mode.

The one switch is `backend`:
- `"reference"` (default): the semantic reference `fa4_rowmax.reference.attention.attention_reference`, on whatever
  device the model is on (CPU here; on CUDA it is the GPU simulation). Registered under the mode's name,
  e.g. `"rowmax_h15_t8"`.
- `"kernel"`: the GPU kernel that implements the mode, BF16 in and out: FA4's patched `flash_attn_func`
  for `exact_bf16p` (stock FA4), Rowmax-PoT and Rowmax-H15, each passing its softmax_mode so that no process-wide
  mode reaches it; `fa4_rowmax.interface.rowmax_attn_func` for the SM90 fold modes `rowmax_h15_fold_*` (Hopper
  only: it raises on other GPUs); the SM90 FP8 forward
  `fa4_rowmax.fp8_sm90.flash_attn_fp8_sm90` for the FP8 modes (`exact_fp8`, `rowmax_h15_fp8`, their `_ksmooth`
  twins and those twins' single-level `_single_acc` kernels: Notes [FP8 modes in the study], [K smoothing for
  FP8], [P.V accumulation in the study]); each `ModeSpec` carries its own kernel factory,
  so `aiter_fused.hf` brings the Fused-Softmax kernel. Registered under `"kernel_" + mode`. Asking for a mode
  that has no kernel, or for kernels without CUDA, raises: a kernel name never silently runs the simulator.

Counters: `attach(model)` gives the model an `AttentionRunState` whose `tally` sums the reference's
counters (tiles, rescales, rescales skipped, BAPS restarts, Fused-Softmax recoveries) over every layer
and call; the quality study reads and resets it per block. Of the kernels only the Fused-Softmax kernel
reports one (its recoveries).
GQA: query heads (B, Hq, L, D) and key/value heads (B, Hkv, L, D) go to the backends unrepeated in FA4
layout; the reference and FA4 handle `Hq % Hkv == 0` themselves.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from fa4_rowmax.config import FP8_MAX_OFFSET, SoftmaxConfig

BACKENDS = ("reference", "kernel")
KERNEL_PREFIX = "kernel_"

# Note [FP8 modes in the study]
# `exact_fp8` and `rowmax_h15_fp8` are what the SM90 FP8 kernel computes: q, k, v cast to e4m3 with a per-tensor
# scale of 1 (no descales), saturating at +-448 as `cvt.rn.satfinite` does; P in e4m3 with FA4's FP8
# max_offset 8 (the reference's Notes [FP8 inputs and descales] and [H15 with FP8 P]). Scale 1 is enough
# here because e4m3 is a floating-point format: its relative precision (2^-4) is the same from 2^-6 to 448,
# so a scale only matters for values outside that range; each call counts the inputs that saturated
# (`fp8_saturated`) and those below 2^-6, where e4m3 has fewer significant bits (`fp8_below_normal`), in the
# run's counters. `exact_fp8_inputs` (e4m3 q/k/v, P in fp32; reference only) separates the operands' share of
# the FP8 cost from P's.
# The reference and the kernel cast the same BF16-rounded values (`AttentionRunState.reference_input_dtype`),
# so the simulator sees the kernel's bytes.
#
# Note [K smoothing for FP8]
# `*_fp8_ksmooth`: k minus its mean over the call's keys (per batch entry and KV head, in fp32) before the e4m3
# cast, SageAttention's "smooth K". Exact for the output: row i's scores all move by the same q_i . mean(k), and
# softmax ignores a row constant, whatever keys the row sees (causal or not); the LSE moves by that constant
# (the study reads no LSE). Why: on Qwen2.5-1.5B layer 0's k is nearly one vector for every token (a ~330 log2-unit
# offset on every score of a row), and e4m3 rounds that offset per key (step 32 between 256 and 448), which is
# where the FP8 and MX operands' cost comes from (docs/quality_notes.md section 5). The mean is over the keys of
# one attention call; the study scores whole blocks without padding, so every key is a real token.
#
# Note [P.V accumulation in the study]
# Every FP8 mode names its kernel's `pv_accumulation` (Note [Two-level P.V accumulation]) instead of taking the
# default: `exact_fp8`, `rowmax_h15_fp8` and their `_ksmooth` twins run two-level, the `*_ksmooth_single_acc`
# twins single-level (the running O as the FP8 MMA's accumulator). The reference has no such knob: its P.V sums
# in fp32, which is what two-level promises, so a single-level twin has the same reference config as its
# two-level twin, and its kernel-minus-simulator gap is the accumulator's cost.
# The simulator runs at the kernel's tile_n for the call's head dim, mask and GQA ratio (Note [Tuned defaults]
# picks it per call, and only for two-level; `simulator_config`): the per-tile running max, which anchors P's e4m3
# rounding and H15's lattice, moves at tile boundaries, so a reference at another tile would compute a different
# function.
# It also sums the row the kernel's way: with row_sum="mma" (every tuned two-level configuration) P after its e4m3
# rounding, as the P V GEMM multiplies it (Note [Row sum by the MMA in the reference]); on Qwen2.5-0.5B the FADD
# order's simulator put the exact twin's O 8.6e-4 low against the kernel (bench/results/h200_2026-12-04_s16/).
E4M3_MAX = 448.0
E4M3_TINY = 2.0**-6  # smallest normal


@dataclass(frozen=True)
class ModeSpec:
    """One softmax mode as the quality study names it."""

    name: str
    description: str
    config_fields: dict  # SoftmaxConfig fields, the same in every layer ...
    kernel: str | None  # "fa4", "fp8_sm90" or "aiter_fused": the GPU kernel that implements it, if any
    kernel_kwargs: dict = field(default_factory=dict)
    # ... updated per layer by layer_fields(layer_idx, num_layers) where a mode changes with depth.
    layer_fields: Callable[[int, int], dict] | None = None
    # kernel_factory(spec) -> call(module, q, k, v, causal, scale) -> (out, counters or None); None: FA4's.
    kernel_factory: Callable | None = None
    # q, k, v cast to e4m3 before the reference (the kernel factory casts its own): Note [FP8 modes in the study].
    fp8_inputs: bool = False
    # k minus its mean over the call's keys before that cast: Note [K smoothing for FP8].
    fp8_k_smoothing: bool = False

    def config(self, layer_idx: int, num_layers: int) -> SoftmaxConfig:
        fields = dict(self.config_fields)
        if self.layer_fields is not None:
            fields.update(self.layer_fields(layer_idx, num_layers))
        return SoftmaxConfig(**fields)


def _fa4_mode(
    name: str, description: str, softmax_mode: str, reference_fields: dict | None = None, **knobs
) -> ModeSpec:
    """A mode FA4's kernel runs: the reference config and the kernel's arguments come from one set of knobs
    (`softmax_mode` plus `rescale_threshold` / `anchor_rounding`), so the two cannot disagree."""
    config_fields = {"mode": softmax_mode, "anchor": "tile", **knobs, **(reference_fields or {})}
    # softmax_mode always passed: the patched FA4's default (None) takes a process-wide mode (Note [Process-wide
    # softmax mode]), which would turn the exact baseline into whatever FA4_ROWMAX_SOFTMAX_MODE names. "exact" with
    # no knob is stock FA4 all the same (no stage, stock compile key).
    kernel_kwargs = {"softmax_mode": softmax_mode, **knobs}
    return ModeSpec(name, description, config_fields, "fa4", kernel_kwargs)


def to_e4m3(x: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """x in e4m3 with scale 1, saturating at +-448 (Note [FP8 modes in the study]), and the counters
    `fp8_saturated` (|x| > 448) and `fp8_below_normal` (0 < |x| < 2^-6)."""
    magnitude = x.abs()
    counts = {
        "fp8_saturated": int((magnitude > E4M3_MAX).sum()),
        "fp8_below_normal": int(((magnitude > 0) & (magnitude < E4M3_TINY)).sum()),
    }
    return x.float().clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), counts


def smooth_k(k: torch.Tensor) -> torch.Tensor:
    """k (batch, seqlen, heads, head_dim) minus its mean over the sequence, in fp32 or wider (Note [K smoothing
    for FP8])."""
    k = k.to(torch.promote_types(k.dtype, torch.float32))
    return k - k.mean(dim=1, keepdim=True)


def _fp8_inputs(q, k, v, k_smoothing: bool = False) -> tuple[list[torch.Tensor], dict]:
    """q, k, v (FA4 layout) through `to_e4m3`, with their counters summed; k smoothed first if asked."""
    if k_smoothing:
        k = smooth_k(k)
    cast = [to_e4m3(t) for t in (q, k, v)]
    totals = {name: sum(counts[name] for _, counts in cast) for name in cast[0][1]}
    return [t for t, _ in cast], totals


def _fp8_sm90_kernel(spec: ModeSpec):
    """The SM90 FP8 forward on the BF16 q, k, v cast to e4m3 (Note [FP8 modes in the study])."""
    from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90

    def call(module, q, k, v, causal, scale):
        (q8, k8, v8), counters = _fp8_inputs(q, k, v, spec.fp8_k_smoothing)
        out, _lse = flash_attn_fp8_sm90(q8, k8, v8, softmax_scale=scale, causal=causal, **spec.kernel_kwargs)
        return out, counters

    return call


def simulator_config(
    spec: ModeSpec, layer_idx: int, num_layers: int, head_dim: int, causal: bool, qhead_per_kvhead: int = 1
) -> SoftmaxConfig:
    """The reference's config for `spec` in this layer; for an FP8 mode at the tile_n its kernel compiles for this
    head dim, mask and GQA ratio (Note [P.V accumulation in the study])."""
    config = spec.config(layer_idx, num_layers)
    if spec.kernel != "fp8_sm90":
        return config
    from fa4_rowmax.fp8_sm90 import call_stage

    stage = call_stage(head_dim=head_dim, causal=causal, qhead_per_kvhead=qhead_per_kvhead, **spec.kernel_kwargs)
    return replace(config, tile_n=stage.tile_n, row_sum=stage.row_sum)


def _fp8_mode(
    name: str,
    description: str,
    softmax_mode: str,
    k_smoothing: bool = False,
    pv_accumulation: str = "two_level",
    **knobs,
) -> ModeSpec:
    """An FP8 mode: e4m3 inputs and P with FA4's FP8 max_offset, one set of knobs for reference and kernel, and the
    kernel's `pv_accumulation` (Note [P.V accumulation in the study])."""
    config_fields = {
        "mode": softmax_mode,
        "anchor": "tile",
        "max_offset": FP8_MAX_OFFSET,
        "p_dtype": torch.float8_e4m3fn,
        **knobs,
    }
    return ModeSpec(
        name,
        description,
        config_fields,
        "fp8_sm90",
        {"softmax_mode": softmax_mode, "pv_accumulation": pv_accumulation, **knobs},
        kernel_factory=_fp8_sm90_kernel,
        fp8_inputs=True,
        fp8_k_smoothing=k_smoothing,
    )


def _mode_table() -> dict[str, ModeSpec]:
    specs = [
        ModeSpec(
            "exact_ref",
            "exact softmax through the reference, P in fp32 (should match sdpa to rounding)",
            {"mode": "exact"},
            None,
        ),
        _fa4_mode(
            "exact_bf16p",
            "exact softmax with P rounded to bf16 before P@V (the floor every kernel pays)",
            "exact",
            reference_fields={"p_dtype": torch.bfloat16},
        ),
        _fa4_mode(
            "rowmax_pot",
            "Rowmax-PoT, K_max 20, per-tile running max, rescale threshold 0",
            "rowmax_pot",
            rescale_threshold=0.0,
        ),
        _fa4_mode(
            "rowmax_h15_t0",
            "Rowmax-H15, per-tile running max, rescale threshold 0",
            "rowmax_h15",
            rescale_threshold=0.0,
        ),
        _fa4_mode(
            "rowmax_h15_t8",
            "Rowmax-H15, per-tile running max, rescale threshold 8 (FA4's 16-bit setting)",
            "rowmax_h15",
            rescale_threshold=8.0,
        ),
        ModeSpec(
            "rowmax_h15_row",
            "Rowmax-H15 anchored at the whole-row max (the control)",
            {"mode": "rowmax_h15", "anchor": "row"},
            None,
        ),
    ]
    # Hopper's fold lever (docs/fa4_notes.md, Lever 1): the lattice anchored at the half octave nearest to the
    # max; its kernel is SM90 only (`interface.rowmax_attn_func` raises elsewhere).
    specs += [
        _fa4_mode(
            f"rowmax_h15_fold_t{t}",
            f"Rowmax-H15, half-octave anchor (SM90 fold), per-tile running max, rescale threshold {t}",
            "rowmax_h15",
            rescale_threshold=float(t),
            anchor_rounding="half_octave",
        )
        for t in (0, 8)
    ]
    specs += [
        _fp8_mode(
            "exact_fp8", "exact softmax on e4m3 q/k/v (scale 1), P in e4m3 with FA4's max_offset 8 (SM90 FP8)", "exact"
        ),
        ModeSpec(
            "exact_fp8_inputs",
            "exact softmax on e4m3 q/k/v (scale 1), P in fp32: the operands' share of the "
            "FP8 cost (control, reference only)",
            {"mode": "exact", "anchor": "tile", "p_dtype": torch.float32},
            None,
            fp8_inputs=True,
        ),
        _fp8_mode(
            "rowmax_h15_fp8",
            "Rowmax-H15 on e4m3 q/k/v, P's e4m3 bytes from the half-octave index (flushed "
            "below 2^-14 of the max), rescale threshold 0 (SM90 FP8)",
            "rowmax_h15",
            rescale_threshold=0.0,
        ),
        _fp8_mode(
            "exact_fp8_ksmooth",
            "exact_fp8 with k minus its mean over the keys before the cast (SageAttention's K smoothing, exact for "
            "the output)",
            "exact",
            k_smoothing=True,
        ),
        _fp8_mode(
            "rowmax_h15_fp8_ksmooth",
            "rowmax_h15_fp8 with k minus its mean over the keys before the cast",
            "rowmax_h15",
            k_smoothing=True,
            rescale_threshold=0.0,
        ),
        _fp8_mode(
            "exact_fp8_ksmooth_single_acc",
            "exact_fp8_ksmooth through the single-level kernel (O as the FP8 MMA's accumulator)",
            "exact",
            k_smoothing=True,
            pv_accumulation="single",
        ),
        _fp8_mode(
            "rowmax_h15_fp8_ksmooth_single_acc",
            "rowmax_h15_fp8_ksmooth through the single-level kernel (O as the FP8 MMA's accumulator)",
            "rowmax_h15",
            k_smoothing=True,
            pv_accumulation="single",
            rescale_threshold=0.0,
        ),
    ]
    specs += [
        ModeSpec(
            f"baps_l{lam}",
            f"BAPS, HiF8 scores and P, restart threshold lambda {lam}",
            {"mode": "baps", "baps_lambda": lam},
            None,
        )
        for lam in (0, 1, 2)
    ]
    return {s.name: s for s in specs}


MODES: dict[str, ModeSpec] = _mode_table()


class CounterTally:
    """Reference counters summed over every attention call of one model (and per layer).

    Integer counters are summed. Per-call ratios and extremes (`MAX_COUNTERS`: BAPS `arr`, `prr`, the
    largest P `p_max`) cannot be summed: for those the tally keeps the largest value seen (`maxima`);
    rates over a whole run are recomputed from the summed integer counters by the reader.
    """

    MAX_COUNTERS = ("arr", "prr", "p_max")

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.calls = 0
        self.totals: dict[str, int] = defaultdict(int)
        self.maxima: dict[str, float] = {}
        self.per_layer: dict[int, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def add(self, layer_idx: int | None, counters: dict) -> None:
        self.calls += 1
        for name, value in counters.items():
            value = value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value
            if isinstance(value, torch.Tensor):
                value = value.sum().item()
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"counter {name!r} must be a number or a tensor, got {type(value).__name__}")
            if name in self.MAX_COUNTERS:
                self.maxima[name] = max(self.maxima.get(name, float("-inf")), float(value))
            elif float(value).is_integer():
                self.totals[name] += int(value)
                if layer_idx is not None:
                    self.per_layer[layer_idx][name] += int(value)
            else:
                raise TypeError(f"counter {name!r} must be integer-valued (or one of {self.MAX_COUNTERS}), got {value}")

    def snapshot(self) -> dict:
        return {
            "calls": self.calls,
            "totals": dict(self.totals),
            "maxima": dict(self.maxima),
            "per_layer": {layer: dict(c) for layer, c in sorted(self.per_layer.items())},
        }


@dataclass
class AttentionRunState:
    """What one model's attention calls share: the counter tally and the reference's input dtype.

    `reference_input_dtype=torch.bfloat16` rounds q, k, v to bf16 before the reference, so the simulator
    sees exactly the inputs a BF16 kernel sees (the kernel-vs-simulator comparison needs that).
    """

    tally: CounterTally = field(default_factory=CounterTally)
    reference_input_dtype: torch.dtype | None = None


STATE_ATTRIBUTE = "_lowprec_softmax_state"


def attach(model: torch.nn.Module, *, reference_input_dtype: torch.dtype | None = None) -> AttentionRunState:
    """Give every attention module of `model` one shared `AttentionRunState`; returns it."""
    if reference_input_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(
            "reference_input_dtype must be None, torch.float32, torch.bfloat16 or torch.float16, "
            f"got {reference_input_dtype}"
        )
    state = AttentionRunState(reference_input_dtype=reference_input_dtype)
    attention_modules = [m for m in model.modules() if hasattr(m, "num_key_value_groups")]
    if not attention_modules:
        raise ValueError("model has no attention modules (modules with `num_key_value_groups`)")
    for module in attention_modules:
        setattr(module, STATE_ATTRIBUTE, state)
    return state


# ---------------------------------------------------------------------------------------------------------
# Masks


def _causal_from_mask(attention_mask: torch.Tensor | None, is_causal: bool, seqlen_q: int, seqlen_k: int):
    """Turn what transformers passes into (causal, per-batch valid query/key positions or None).

    transformers' sdpa mask builder hands over `None` when the mask is plain causal (or full) and a 4-D
    boolean (B, 1, Lq, Lk) mask when there is padding. The backends take only a causal flag, so a mask
    is accepted only when it is causal (bottom-right aligned) or full over the non-padded positions; then
    the valid positions are returned and the call runs on the compacted, unpadded sequences.
    """
    if attention_mask is None:
        return is_causal, None
    if attention_mask.ndim != 4 or attention_mask.shape[1] != 1 or attention_mask.shape[-2:] != (seqlen_q, seqlen_k):
        raise ValueError(
            f"attention_mask must be None or (batch, 1, {seqlen_q}, {seqlen_k}), got {tuple(attention_mask.shape)}"
        )
    allowed = attention_mask[:, 0] if attention_mask.dtype == torch.bool else attention_mask[:, 0] == 0
    valid = []
    for b in range(allowed.shape[0]):
        # Padding is a property of positions: the queries are the last Lq positions of the key sequence.
        # (A right-padded query row still sees the real keys; its output is discarded, so it stays zero.)
        k_valid = allowed[b].any(dim=0)
        q_valid = k_valid[seqlen_k - seqlen_q :]
        nq, nk = int(q_valid.sum()), int(k_valid.sum())
        expected = torch.ones(nq, nk, dtype=torch.bool, device=allowed.device)
        if is_causal:
            expected = torch.tril(expected, diagonal=nk - nq)
        got = allowed[b][q_valid][:, k_valid]
        if not torch.equal(got, expected):
            raise ValueError(
                "attention_mask must be causal (bottom-right aligned) or full over the non-padded positions; "
                "other patterns (sliding windows, packed sequences, custom masks) are not supported"
            )
        valid.append((q_valid, k_valid))
    return is_causal, valid


# ---------------------------------------------------------------------------------------------------------
# Backends: (q, k, v) in FA4 layout (B, L, H, D) -> out (B, Lq, Hq, D)


def _reference_backend(spec: ModeSpec):
    from fa4_rowmax.reference.attention import attention_reference

    def run(module, q, k, v, causal: bool, scale: float, state: AttentionRunState | None):
        layers, ratio = module.config.num_hidden_layers, q.shape[2] // k.shape[2]
        config = simulator_config(spec, module.layer_idx, layers, q.shape[-1], causal, ratio)
        in_dtype = state.reference_input_dtype if state is not None else None
        out_dtype = q.dtype
        if in_dtype is not None:
            q, k, v = q.to(in_dtype), k.to(in_dtype), v.to(in_dtype)
        fp8_counters = {}
        if spec.fp8_inputs:
            (q, k, v), fp8_counters = _fp8_inputs(q, k, v, spec.fp8_k_smoothing)
        out, _lse, counters = attention_reference(
            q, k, v, config, causal=causal, softmax_scale=scale, compute_dtype=torch.float32, return_counters=True
        )
        counters.update(fp8_counters)
        if state is not None:
            state.tally.add(module.layer_idx, counters)
        return out.to(out_dtype)

    return run


def _fa4_kernel(spec: ModeSpec):
    """FA4's patched flash_attn_func, or rowmax_attn_func for the SM90 levers the public call lacks."""
    if "anchor_rounding" in spec.kernel_kwargs:
        from fa4_rowmax.interface import rowmax_attn_func

        def call(module, q, k, v, causal, scale):
            return rowmax_attn_func(q, k, v, softmax_scale=scale, causal=causal, **spec.kernel_kwargs), None

        return call
    from flash_attn.cute import flash_attn_func

    def call(module, q, k, v, causal, scale):
        result = flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, **spec.kernel_kwargs)
        return (result[0] if isinstance(result, tuple) else result), None

    return call


def _kernel_backend(spec: ModeSpec, modes: dict[str, ModeSpec]):
    if spec.kernel is None:
        raise ValueError(
            f"mode {spec.name!r} has no GPU kernel; modes with kernels: "
            f"{sorted(n for n, s in modes.items() if s.kernel)} (use backend='reference' for the others)"
        )
    if not torch.cuda.is_available():
        raise RuntimeError(f"backend='kernel' needs CUDA (mode {spec.name!r}); use backend='reference' on CPU")
    call = (spec.kernel_factory or _fa4_kernel)(spec)

    def run(module, q, k, v, causal: bool, scale: float, state: AttentionRunState | None):
        if q.device.type != "cuda":
            raise ValueError(f"backend='kernel' needs CUDA tensors, got query on {q.device}")
        out_dtype = q.dtype
        q, k, v = (t.to(torch.bfloat16).contiguous() for t in (q, k, v))
        out, counters = call(module, q, k, v, causal, scale)
        if state is not None and counters is not None:
            state.tally.add(module.layer_idx, counters)
        return out.to(out_dtype)

    return run


def make_attention_function(mode: str, backend: str = "reference", modes: dict[str, ModeSpec] = MODES) -> Callable:
    """The transformers attention function for `mode` (a name in `modes`) on `backend` (module docstring)."""
    if mode not in modes:
        raise ValueError(f"mode must be one of {sorted(modes)}, got {mode!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    spec = modes[mode]
    run = _reference_backend(spec) if backend == "reference" else _kernel_backend(spec, modes)

    def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if dropout:
            raise ValueError(f"dropout must be 0 ({mode} is inference-only), got {dropout}")
        for unsupported in ("softcap", "sliding_window", "s_aux"):
            if kwargs.get(unsupported) is not None:
                raise ValueError(
                    f"{unsupported} must be None for attention mode {mode!r} (not supported), "
                    f"got {kwargs[unsupported]!r}"
                )
        is_causal = kwargs.get("is_causal")
        is_causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
        state = getattr(module, STATE_ATTRIBUTE, None)
        # transformers: query (B, Hq, Lq, D), key/value (B, Hkv, Lk, D); FA4 layout is (B, L, H, D).
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        causal, valid = _causal_from_mask(attention_mask, is_causal, q.shape[1], k.shape[1])
        scale = scaling if scaling is not None else q.shape[-1] ** -0.5
        if valid is None:
            out = run(module, q, k, v, causal, scale, state)
        else:
            out = torch.zeros_like(q)
            for b, (q_valid, k_valid) in enumerate(valid):
                if q_valid.any() and k_valid.any():
                    out[b, q_valid] = run(
                        module,
                        q[b : b + 1, q_valid],
                        k[b : b + 1, k_valid],
                        v[b : b + 1, k_valid],
                        causal,
                        scale,
                        state,
                    )[0]
        return out, None

    attention_forward.__name__ = f"{mode}_{backend}_attention"
    return attention_forward


def attention_name(mode: str, backend: str = "reference") -> str:
    return mode if backend == "reference" else KERNEL_PREFIX + mode


def register(modes=None, backend: str = "reference", table: dict[str, ModeSpec] = MODES) -> dict[str, str]:
    """Register `modes` (names in `table`, default: all of it) with transformers; returns {mode: attention name}.

    `table` is this module's `MODES` or another package's (`aiter_fused.hf.MODES`), or a union of them."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    modes = list(table) if modes is None else list(modes)
    names = {}
    for mode in modes:
        function = make_attention_function(mode, backend, table)
        name = attention_name(mode, backend)
        AttentionInterface.register(name, function)
        # sdpa's mask builder: None for plain causal/full attention, a boolean mask when there is padding.
        AttentionMaskInterface.register(name, sdpa_mask)
        names[mode] = name
    return names
