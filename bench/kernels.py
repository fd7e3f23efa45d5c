"""The one table of benchmarked kernels.

Every entry knows how to call its kernel on FlashAttention-layout tensors (q (B, S, Hq, D), k/v
(B, S, Hkv, D)) and returns the output in that layout, which shapes and dtypes it cannot run (with the
reason), whether its package is importable here (imported lazily, on first use, so a missing or
half-written backend becomes an "unavailable: <reason>" row instead of a crash), and the tolerance of its
correctness gate.

Note [Gate tolerances]
~~~~~~~~~~~~~~~~~~~~~~
The gate (bench/check.py) compares a kernel's output with an fp32 reference computed from the same
(rounded) inputs, q, k, v ~ N(0, 1), by the relative Frobenius error ||out - ref|| / ||ref||. For such
inputs the output is a weighted mean of V rows, and a per-weight relative error e gives an output error of
about rms(e), so the tolerances follow each method's per-weight error, with ~2x headroom:
  - exact softmax, 16-bit inputs: 1e-2 (FA4 stock measured 2.0-2.3e-3 on the H200: bf16 rounding of P and O);
    FP8 inputs: 8e-2 (e4m3 P and operands, ~2.5% each).
  - Rowmax-H15: 0.2 (log2 error of every weight within [-0.25, +0.335] octave; 8-10% measured on Gaussian
    inputs, notes/rowmax_h15.md); FP8: 0.25.
  - Fused-Softmax and its exact twin, by operand format: mxfp8 and mxfp6 0.12 (5.7% / 6.5% reported vs BF16
    attention), mxfp4 0.4 (20.5% reported).
Garbage stays far above all of them: zeros give 1.0, unrelated values ~1.4, and a kernel that ignores the
scores (uniform weights) ~0.8 for these inputs.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from typing import Callable, Mapping

import torch

Launch = Callable[[], torch.Tensor]

BASELINE = "fa4_stock"
H15_THRESHOLDS = (0.0, 2.0, 4.0, 8.0)
H15_BETAS = (0.0, 0.125, 0.25, 0.375, 0.5, 1.0)
MX_FORMATS = ("mxfp8", "mxfp6", "mxfp4")
FA4_PATCH_KWARGS = ("softmax_mode", "rescale_threshold", "beta")

_EXACT_TOL = {"bf16": 1e-2, "fp16": 1e-2, "fp8": 8e-2}
_H15_TOL = {"bf16": 0.2, "fp16": 0.2, "fp8": 0.25}
_MX_TOL = {"mxfp8": 0.12, "mxfp6": 0.12, "mxfp4": 0.4}
# aiter_fused dot modes timed against the arch default (aiter_fused.attention.DOT_MODES; "fp8" is the sm_90 default)
AITER_DOT_MODE_VARIANTS = ("bf16", "scaled")

# SM90 softmax-stage levers, one entry per variant, called through fa4_rowmax.interface.rowmax_attn_func
# (flash_attn_func does not take anchor_rounding / rescale_vote).
HOPPER_LEVERS = {
    "fa4_h15_fold": {"softmax_mode": "rowmax_h15", "anchor_rounding": "half_octave"},
    "fa4_h15_vote": {"softmax_mode": "rowmax_h15", "rescale_vote": True},
    "fa4_h15_fold_vote": {"softmax_mode": "rowmax_h15", "anchor_rounding": "half_octave", "rescale_vote": True},
    "fa4_h15_fold_vote_t8": {"softmax_mode": "rowmax_h15", "anchor_rounding": "half_octave", "rescale_vote": True,
                             "rescale_threshold": 8.0},
    "fa4_exact_vote": {"softmax_mode": "exact", "rescale_vote": True},
    "fa4_exact_vote_t8": {"softmax_mode": "exact", "rescale_vote": True, "rescale_threshold": 8.0},
}

TORCH_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    name: str
    family: str  # "fa4" | "aiter_fused" | "sdpa"
    mode: str  # the softmax: "exact" | "rowmax_h15" | "fused_softmax"
    knobs: tuple[tuple[str, object], ...]  # what the call passes beyond (q, k, v, causal), for the results
    tolerances: Mapping[str, float]  # per input dtype, Note [Gate tolerances]
    _load: Callable[[], Callable] = dataclasses.field(repr=False)  # the entry point, or raises KernelUnavailable
    _bind: Callable[[Callable, torch.Tensor, torch.Tensor, torch.Tensor, bool], Launch] = dataclasses.field(repr=False)
    _unsupported: Callable[[str, tuple[int, int]], str | None] = dataclasses.field(repr=False)  # (dtype, capability)

    def unavailable_reason(self) -> str | None:
        """None when the entry point imports (and has the needed arguments), else why not."""
        try:
            self._load()
        except KernelUnavailable as exc:
            return str(exc)
        return None

    def unsupported_reason(self, dtype: str, capability: tuple[int, int]) -> str | None:
        if dtype not in self.tolerances:
            return f"{self.name} takes {'/'.join(self.tolerances)} inputs, not {dtype}"
        return self._unsupported(dtype, capability)

    def bind(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> Launch:
        """A zero-argument callable running the kernel on these tensors, returning out (B, S, Hq, D).
        Layout changes (views) happen here, outside the timed call."""
        return self._bind(self._load(), q, k, v, causal)

    def tolerance(self, dtype: str) -> float:
        if dtype not in self.tolerances:
            raise ValueError(f"dtype must be one of {sorted(self.tolerances)} for {self.name}, got {dtype!r}")
        return self.tolerances[dtype]


class KernelUnavailable(RuntimeError):
    pass


def missing_kwargs(fn: Callable, names: tuple[str, ...]) -> list[str]:
    """The keyword arguments among `names` that `fn`'s signature does not declare by name."""
    params = inspect.signature(fn).parameters
    return [name for name in names if name not in params]


def _import_failure(what: str, exc: BaseException) -> KernelUnavailable:
    return KernelUnavailable(f"cannot import {what}: {type(exc).__name__}: {exc}")


@functools.cache
def _lookup(module: str, name: str) -> tuple[Callable | None, str | None]:
    """`module.name`, imported once; (None, why) when the import fails."""
    try:
        return getattr(importlib.import_module(module), name), None
    except Exception as exc:  # any import-time failure (no CUDA DSL, wrong torch, no Triton) makes it unavailable
        return None, str(_import_failure(f"{module}.{name}", exc))


def _load(module: str, name: str) -> Callable:
    fn, reason = _lookup(module, name)
    if fn is None:
        raise KernelUnavailable(reason)
    return fn


def _load_fa4() -> Callable:
    return _load("flash_attn.cute", "flash_attn_func")


def _load_fa4_patched() -> Callable:
    fn = _load_fa4()
    missing = missing_kwargs(fn, FA4_PATCH_KWARGS)
    if missing:
        raise KernelUnavailable(f"flash_attn_func has no {', '.join(missing)} argument "
                                "(the Rowmax-H15 patch set is not applied to the installed flash-attn-4)")
    return fn


def _load_aiter() -> Callable:
    return _load("aiter_fused.attention", "fused_softmax_attention")


def _load_sdpa() -> Callable:
    return torch.nn.functional.scaled_dot_product_attention


def _first(result) -> torch.Tensor:
    return result[0] if isinstance(result, (tuple, list)) else result


def _fa4_binder(knobs: dict) -> Callable:
    def bind(fn, q, k, v, causal):
        return lambda: _first(fn(q, k, v, causal=causal, **knobs))
    return bind


def _load_rowmax_levers() -> Callable:
    _load_fa4_patched()
    return _load("fa4_rowmax.interface", "rowmax_attn_func")


def _rowmax_levers_unsupported(dtype: str, capability: tuple[int, int]) -> str | None:
    if capability[0] != 9:
        return (f"anchor_rounding / rescale_vote are SM90 (Hopper) levers (fa4_rowmax.interface.SoftmaxStage); "
                f"this GPU is sm_{capability[0]}{capability[1]}")
    return _fa4_unsupported(dtype, capability)


def _aiter_binder(mx_format: str, exact: bool, dot_mode: str | None = None) -> Callable:
    def bind(fn, q, k, v, causal):
        return lambda: _first(fn(q, k, v, causal=causal, mx_format=mx_format, exact=exact, dot_mode=dot_mode))
    return bind


def _sdpa_binder(backend_name: str) -> Callable:
    def bind(fn, q, k, v, causal):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D) views, no copy
        gqa = q.shape[2] != k.shape[2]

        def launch():
            with sdpa_kernel(backend):
                return fn(qt, kt, vt, is_causal=causal, enable_gqa=gqa).transpose(1, 2)
        return launch
    return bind


def _fa4_unsupported(dtype: str, capability: tuple[int, int]) -> str | None:
    if dtype == "fp8" and capability[0] != 10:
        return (f"FA4 FP8 is SM100-only (flash_attn/cute/interface.py asserts compute capability 10.x); "
                f"this GPU is sm_{capability[0]}{capability[1]}")
    return None


def _always_supported(dtype: str, capability: tuple[int, int]) -> str | None:
    return None


def _build_table() -> dict[str, KernelSpec]:
    specs = [KernelSpec(BASELINE, "fa4", "exact", (), _EXACT_TOL, _load_fa4, _fa4_binder({}), _fa4_unsupported),
             KernelSpec("fa4_h15", "fa4", "rowmax_h15", (("softmax_mode", "rowmax_h15"),), _H15_TOL,
                        _load_fa4_patched, _fa4_binder({"softmax_mode": "rowmax_h15"}), _fa4_unsupported)]
    for threshold in H15_THRESHOLDS:
        for beta in H15_BETAS:
            knobs = {"softmax_mode": "rowmax_h15", "rescale_threshold": threshold, "beta": beta}
            specs.append(KernelSpec(h15_map_name(threshold, beta), "fa4", "rowmax_h15", tuple(knobs.items()),
                                    _H15_TOL, _load_fa4_patched, _fa4_binder(knobs), _fa4_unsupported))
    for name, knobs in HOPPER_LEVERS.items():  # docs/fa4_notes.md, "Hopper variants"
        tol = _H15_TOL if knobs["softmax_mode"] == "rowmax_h15" else _EXACT_TOL
        specs.append(KernelSpec(name, "fa4", knobs["softmax_mode"], tuple(knobs.items()), tol, _load_rowmax_levers,
                                _fa4_binder(knobs), _rowmax_levers_unsupported))
    aiter_tol = {fmt: {"bf16": tol} for fmt, tol in _MX_TOL.items()}  # BF16 in/out (docs/design.md)
    for fmt in MX_FORMATS:
        for exact in (False, True):
            specs.append(KernelSpec(f"aiter_{fmt}" + ("_exact" if exact else ""), "aiter_fused",
                                    "exact" if exact else "fused_softmax",
                                    (("mx_format", fmt), ("exact", exact)), aiter_tol[fmt], _load_aiter,
                                    _aiter_binder(fmt, exact), _always_supported))
    for dot_mode in AITER_DOT_MODE_VARIANTS:  # the arch default (aiter_mxfp8) against the other dot modes
        specs.append(KernelSpec(f"aiter_mxfp8_{dot_mode}", "aiter_fused", "fused_softmax",
                                (("mx_format", "mxfp8"), ("exact", False), ("dot_mode", dot_mode)), aiter_tol["mxfp8"],
                                _load_aiter, _aiter_binder("mxfp8", False, dot_mode), _always_supported))
    sdpa_tol = {d: t for d, t in _EXACT_TOL.items() if d != "fp8"}  # SDPA takes no FP8 inputs
    specs += [KernelSpec("sdpa_cudnn", "sdpa", "exact", (("backend", "CUDNN_ATTENTION"),), sdpa_tol, _load_sdpa,
                         _sdpa_binder("CUDNN_ATTENTION"), _always_supported),
              KernelSpec("sdpa_flash", "sdpa", "exact", (("backend", "FLASH_ATTENTION"),), sdpa_tol, _load_sdpa,
                         _sdpa_binder("FLASH_ATTENTION"), _always_supported)]
    return {spec.name: spec for spec in specs}


def h15_map_name(threshold: float, beta: float) -> str:
    return f"fa4_h15_t{threshold:g}_b{beta:g}"


KERNELS: dict[str, KernelSpec] = _build_table()
MAP_KERNELS = tuple(h15_map_name(t, b) for t in H15_THRESHOLDS for b in H15_BETAS)
# Opt-in rows (`--kernels 'aiter_mxfp8_*'`): one format is enough, the dot mode's cost is format-independent.
DOT_MODE_KERNELS = tuple(f"aiter_mxfp8_{mode}" for mode in AITER_DOT_MODE_VARIANTS)
DEFAULT_KERNELS = tuple(name for name in KERNELS if name not in MAP_KERNELS + DOT_MODE_KERNELS)
QUICK_KERNELS = (BASELINE, "fa4_h15", "aiter_mxfp8", "sdpa_cudnn")
