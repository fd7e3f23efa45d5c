"""Host-side dispatch for the FA4 softmax stage: the one place that maps `softmax_mode` + knobs to a kernel.

The patched `flash_attn.cute.flash_attn_func` / `flash_attn_varlen_func` (patches/*.diff) call
`softmax_stage(...)` with the user's arguments. It returns `None` for stock FA4 (`softmax_mode="exact"` and
no knob set), which leaves FA4 byte-for-byte unchanged, or a frozen, hashable `SoftmaxStage`. `_flash_attn_fwd`
resolves the stage for the architecture and dtype (`SoftmaxStage.for_kernel`), puts it in the compile-cache
key and hands it to the kernel, which swaps its `Softmax` / `SoftmaxSm100` for ours
(`SoftmaxStage.sm90` / `.sm100`).

`fa4_backend(...)` wraps the patched FA4 as a gate backend `(q, k, v, causal) -> (out, lse)`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch

from fa4_rowmax.config import ANCHOR_ROUNDINGS, FP8_MAX_OFFSET, KERNEL_MODES, LOG2_ROUND_UP, SoftmaxConfig

APPROXIMATE_MODES = tuple(m for m in KERNEL_MODES if m != "exact")


# Note [Features allowed with a softmax stage]
# A softmax stage (an approximate mode, or exact with a knob) has been checked on the H200 against the
# reference only with: dense batches, causal (bottom-right) and not, GQA, bf16/fp16 inputs, seqlens off the
# tile grid, and NaN/Inf inputs (tests/test_fa4_gpu.py, the gates). Every other FA4 feature below either
# changes what the softmax sees (sinks fold an exact exp2 into the row sum; softcap, score_mod and mask_mod
# rewrite the scores; local windows and block sparsity skip tiles the running max relies on) or the way
# partial results combine (split-KV merges per-split LSEs that the approximate weights do not define), and
# none has a gate or reference test on the GPU. So each is refused, naming the argument and its stock value.
# Widen `FEATURES_TESTED` one feature at a time, with an H200 test for that feature.
FEATURE_STOCK_VALUES = {
    "qv": None,
    "cu_seqlens_q": None,
    "cu_seqlens_k": None,
    "seqused_q": None,
    "seqused_k": None,
    "page_table": None,
    "softcap": None,
    "window_size_left": None,
    "window_size_right": None,
    "learnable_sink": None,
    "num_splits": 1,
    "score_mod": None,
    "mask_mod": None,
    "block_sparse_tensors": None,
    "aux_tensors": None,
    "q_descale": None,
    "k_descale": None,
    "v_descale": None,
    "gather_kv_indices": None,
    "scheduler_metadata": None,
    "seqlen_k_per_split": None,
}
FEATURES_TESTED: tuple[str, ...] = ()


def refuse_untested_features(features: dict, *, where: str, accepted: str, tested: tuple[str, ...] = ()) -> None:
    """Raise ValueError for a feature of `features` (FA4 argument -> value) not in `tested` that is set to
    anything but its stock value (Note [Features allowed with a softmax stage]); `where` names the path
    ("with softmax_mode='rowmax_h15' and its knobs"), `accepted` what the user can do instead."""
    unknown = sorted(set(features) - set(FEATURE_STOCK_VALUES))
    if unknown:
        raise TypeError(f"unknown FA4 features {unknown}; known: {sorted(FEATURE_STOCK_VALUES)}")
    for name, value in features.items():
        stock = FEATURE_STOCK_VALUES[name]
        if name in tested or value is stock or (stock is not None and value == stock):
            continue
        raise ValueError(
            f"{name} is not supported {where} (no GPU test covers it yet); accepted: {name}={stock!r}{accepted}"
        )


def check_features(mode: str, features: dict) -> None:
    """The features a softmax stage refuses (Note [Features allowed with a softmax stage])."""
    refuse_untested_features(
        features,
        where=f"with softmax_mode={mode!r} and its knobs",
        tested=FEATURES_TESTED,
        accepted=", or softmax_mode='exact' with rescale_threshold=None and beta=None (stock FA4, every feature)",
    )


def _log2_dtype_max(q_dtype: torch.dtype) -> float:
    """log2 of the largest value of P's dtype, from FA4's own table (flash_fwd_sm100._LOG2_DTYPE_MAX)."""
    from flash_attn.cute.flash_fwd_sm100 import _LOG2_DTYPE_MAX
    from flash_attn.cute.interface import torch2cute_dtype_map

    if q_dtype not in torch2cute_dtype_map or torch2cute_dtype_map[q_dtype] not in _LOG2_DTYPE_MAX:
        raise ValueError(
            f"q dtype must be one of {sorted(map(str, torch2cute_dtype_map))} for a softmax stage; got {q_dtype}"
        )
    return _LOG2_DTYPE_MAX[torch2cute_dtype_map[q_dtype]]


def fa4_default_rescale_threshold(arch: int, q_dtype: torch.dtype) -> float:
    """The threshold stock FA4 uses: SM90 always rescales (0); SM100 keeps a max 8 octaves stale for 16-bit
    inputs and 0 for FP8 (flash_fwd_sm100.py, `rescale_threshold = 8.0 if q_dtype.width == 16 else 0.0`).
    The stage checks at trace time that the stock softmax object FA4 built carries this value
    (`SoftmaxStage.sm90` / `.sm100`), so a change in FA4's rule fails the compile instead of drifting."""
    return 8.0 if (arch // 10 != 9 and torch.finfo(q_dtype).bits == 16) else 0.0


def fa4_max_offset(q_dtype: torch.dtype) -> int:
    """FA4's FP8 P offset (Note [Low Precision Scaling]): 8 for 8-bit inputs, else 0; checked at trace time
    against the stock softmax object, as the threshold is."""
    return FP8_MAX_OFFSET if torch.finfo(q_dtype).bits == 8 else 0


@dataclass(frozen=True)
class SoftmaxStage:
    """The softmax-stage configuration of one FA4 forward kernel (part of FA4's compile-cache key).

    `rescale_threshold` and `beta` are `None` until `for_kernel` resolves them for an architecture:
    threshold `None` means the architecture's stock value (SM90: 0, it always rescales; SM100: 8 for 16-bit
    inputs, 0 for FP8), beta `None` means stock (`exact`: FA4's tuning; approximate modes: 1, every weight
    built off the MUFU).

    SM90-only levers (ValueError elsewhere): `anchor_rounding="half_octave"` (rowmax_h15) folds scale,
    anchor subtraction and round-add into one FFMA on an anchor rounded to a half octave (this changes
    values; the reference takes `SoftmaxConfig(anchor_rounding="half_octave")`); `rescale_vote=True` skips
    the O rescale when no row of a warp moved its anchor (changes instructions, never values).
    """

    mode: str = "exact"
    rescale_threshold: Optional[float] = None
    beta: Optional[float] = None
    arch: Optional[int] = None
    max_offset: int = 0
    anchor_rounding: str = "exact"
    rescale_vote: bool = False
    q_dtype: Optional[torch.dtype] = None
    threshold_from_fa4: bool = False  # rescale_threshold was None: FA4's default, checked at trace time

    def for_kernel(self, *, arch: int, q_dtype: torch.dtype, features: Optional[dict] = None) -> "SoftmaxStage":
        """Resolve the knobs for `arch` (e.g. 90, 100) and the input dtype; refuse untested FA4 features
        (`features`: FA4 argument -> value, Note [Features allowed with a softmax stage]); check the P range."""
        family = arch // 10
        if family not in (9, 10, 11):
            raise ValueError(
                f"softmax_mode={self.mode!r} with rescale_threshold/beta needs an SM90 or SM100-family GPU "
                f"(arch 90, 100, 103, 110); got arch {arch}. Accepted on other GPUs: softmax_mode='exact' "
                "with rescale_threshold=None and beta=None."
            )
        check_features(self.mode, features or {})
        if family != 9 and (self.anchor_rounding != "exact" or self.rescale_vote):
            raise ValueError(
                f"anchor_rounding={self.anchor_rounding!r} / rescale_vote={self.rescale_vote} are SM90 (Hopper) "
                f"levers; got arch {arch}. Accepted there: anchor_rounding='exact', rescale_vote=False"
            )
        max_offset = fa4_max_offset(q_dtype)
        threshold = self.rescale_threshold
        if threshold is None:
            threshold = fa4_default_rescale_threshold(arch, q_dtype)
        bound = _log2_dtype_max(q_dtype)
        if max_offset + threshold + LOG2_ROUND_UP[self.mode] >= bound:
            raise ValueError(
                f"rescale_threshold={threshold} is too large for {q_dtype} inputs in softmax_mode="
                f"{self.mode!r}: max_offset ({max_offset}) + rescale_threshold + the mode's round-up "
                f"({LOG2_ROUND_UP[self.mode]:.3f} octaves) must stay below log2 of the P dtype's max "
                f"({bound:.3f}); accepted: rescale_threshold < {bound - max_offset - LOG2_ROUND_UP[self.mode]:.3f}"
            )
        return replace(
            self,
            rescale_threshold=float(threshold),
            arch=arch,
            max_offset=max_offset,
            q_dtype=q_dtype,
            threshold_from_fa4=self.rescale_threshold is None,
        )

    def reference_config(self, *, tile_n: int) -> SoftmaxConfig:
        """The semantic reference's configuration for this resolved stage: the values the kernel computes
        with (mode, the resolved threshold, FA4's max_offset, P in the input dtype, the anchor rounding);
        `tile_n` is the kernel's key-block size (128 for FA4's SM90/SM100 forward at head dim <= 128)."""
        self._check_resolved()
        return SoftmaxConfig(
            mode=self.mode,
            tile_n=tile_n,
            rescale_threshold=self.rescale_threshold,
            max_offset=self.max_offset,
            p_dtype=self.q_dtype,
            beta=self.beta,
            anchor_rounding=self.anchor_rounding,
        )

    @property
    def ldred_row_max_nan(self) -> bool:
        """SM103's tcgen05.ld.red row max takes `.NaN` in the approximate modes (Note [NaN rows in the
        approximate modes on SM100], stage/softmax_sm100.py); exact keeps stock's NaN-quiet reduction."""
        return self.mode in APPROXIMATE_MODES

    def _check_resolved(self) -> None:
        assert self.arch is not None, "SoftmaxStage.for_kernel must run before the kernel is traced"

    def _check_stock_defaults(self, softmax) -> None:
        """FA4's own rule is the source of the defaults: the stock softmax object FA4 built for this kernel
        must carry the max_offset (and, when the user left it None, the threshold) resolved on the host."""
        stock_offset = getattr(softmax, "max_offset", 0)
        assert int(stock_offset) == self.max_offset, (
            f"FA4 built its softmax with max_offset {stock_offset}; fa4_rowmax resolved {self.max_offset} "
            "(fa4_max_offset has drifted from FA4's rule)"
        )
        if self.threshold_from_fa4:
            stock_threshold = getattr(softmax, "rescale_threshold", 0.0)
            assert float(stock_threshold) == self.rescale_threshold, (
                f"FA4 built its softmax with rescale_threshold {stock_threshold}; fa4_rowmax resolved "
                f"{self.rescale_threshold} (fa4_default_rescale_threshold has drifted from FA4's rule)"
            )

    def sm90(self, softmax):
        """The SM90 kernel's `Softmax`, replaced by `RowmaxSoftmaxSm90` with this stage's knobs."""
        from fa4_rowmax.stage.softmax_sm90 import RowmaxSoftmaxSm90

        self._check_resolved()
        self._check_stock_defaults(softmax)
        return RowmaxSoftmaxSm90.from_stock(
            softmax,
            mode=self.mode,
            beta=self.beta,
            rescale_threshold=self.rescale_threshold,
            anchor_rounding=self.anchor_rounding,
            rescale_vote=self.rescale_vote,
        )

    def sm100(self, softmax):
        """The SM100 kernel's `SoftmaxSm100`, replaced by `RowmaxSoftmaxSm100` with this stage's knobs."""
        from fa4_rowmax.stage.softmax_sm100 import RowmaxSoftmaxSm100

        self._check_resolved()
        self._check_stock_defaults(softmax)
        return RowmaxSoftmaxSm100.from_stock(
            softmax, mode=self.mode, beta=self.beta, rescale_threshold=self.rescale_threshold
        )


def softmax_stage(
    softmax_mode: str = "exact",
    rescale_threshold: Optional[float] = None,
    beta: Optional[float] = None,
    *,
    requires_grad: bool = False,
    anchor_rounding: str = "exact",
    rescale_vote: bool = False,
) -> Optional[SoftmaxStage]:
    """Validate the user's softmax arguments; `None` means stock FA4.

    `anchor_rounding` and `rescale_vote` are the SM90 levers of `SoftmaxStage` (keyword-only; the patched
    `flash_attn_func` does not take them: use `rowmax_attn_func`).

    Raises TypeError/ValueError naming the argument and the accepted values. An approximate mode is
    forward-only (FA4's backward recomputes P with exact exp2), so `requires_grad=True` raises.
    """
    if not isinstance(softmax_mode, str):
        raise TypeError(f"softmax_mode must be a str, one of {KERNEL_MODES}; got {type(softmax_mode).__name__}")
    if softmax_mode not in KERNEL_MODES:
        raise ValueError(f"softmax_mode must be one of {KERNEL_MODES}; got {softmax_mode!r}")
    if rescale_threshold is not None:
        if isinstance(rescale_threshold, bool) or not isinstance(rescale_threshold, (int, float)):
            raise TypeError(
                "rescale_threshold must be None (the architecture's default) or a finite float >= 0 "
                f"(log2 units); got {type(rescale_threshold).__name__}"
            )
        if not math.isfinite(rescale_threshold) or rescale_threshold < 0:
            raise ValueError(
                "rescale_threshold must be None (the architecture's default) or a finite float >= 0 "
                f"(log2 units); got {rescale_threshold}"
            )
        rescale_threshold = float(rescale_threshold)
    if beta is not None:
        if isinstance(beta, bool) or not isinstance(beta, (int, float)):
            raise TypeError(f"beta must be None (stock) or a float in [0, 1]; got {type(beta).__name__}")
        if not (0.0 <= beta <= 1.0):
            raise ValueError(f"beta must be None (stock) or a float in [0, 1]; got {beta}")
        beta = float(beta)
    if not isinstance(anchor_rounding, str) or anchor_rounding not in ANCHOR_ROUNDINGS:
        raise ValueError(f"anchor_rounding must be one of {ANCHOR_ROUNDINGS}; got {anchor_rounding!r}")
    if anchor_rounding != "exact" and softmax_mode != "rowmax_h15":
        raise ValueError(
            f"anchor_rounding={anchor_rounding!r} applies to softmax_mode='rowmax_h15' only; got "
            f"softmax_mode={softmax_mode!r} (accepted with it: anchor_rounding='exact')"
        )
    if not isinstance(rescale_vote, bool):
        raise TypeError(f"rescale_vote must be a bool; got {type(rescale_vote).__name__}")
    if softmax_mode in APPROXIMATE_MODES and requires_grad:
        raise ValueError(
            f"softmax_mode={softmax_mode!r} is forward-only: FA4's backward recomputes P with exact exp2, "
            "so gradients would not match this forward. Run it under torch.no_grad() / "
            "torch.inference_mode() or on inputs that do not require grad; accepted with gradients: "
            "softmax_mode='exact'"
        )
    if softmax_mode == "exact" and rescale_threshold is None and beta is None and not rescale_vote:
        return None
    return SoftmaxStage(
        mode=softmax_mode,
        rescale_threshold=rescale_threshold,
        beta=beta,
        anchor_rounding=anchor_rounding,
        rescale_vote=rescale_vote,
    )


def rowmax_attn_func(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    softmax_scale: Optional[float] = None,
    softmax_mode: str = "rowmax_h15",
    rescale_threshold: Optional[float] = None,
    beta: Optional[float] = None,
    anchor_rounding: str = "exact",
    rescale_vote: bool = False,
    return_lse: bool = False,
):
    """Forward-only FA4 attention with every softmax-stage knob, the SM90 levers included.

    q (batch, seqlen_q, heads_q, head_dim), k/v (batch, seqlen_k, heads_k, head_dim), as `flash_attn_func`.
    Returns `out`, or `(out, lse)` with `return_lse`. Calls the patched FA4's `_flash_attn_fwd` with the
    stage (the patched `flash_attn_func` takes only softmax_mode / rescale_threshold / beta). Inputs that
    require grad raise: this entry has no backward.
    """
    if any(t.requires_grad for t in (q, k, v)) and torch.is_grad_enabled():
        raise ValueError("rowmax_attn_func is forward-only: call it under torch.no_grad() or on inputs without grad")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool; got {type(causal).__name__}")
    stage = softmax_stage(
        softmax_mode, rescale_threshold, beta, anchor_rounding=anchor_rounding, rescale_vote=rescale_vote
    )
    if not is_fa4_patched():
        raise RuntimeError(
            "rowmax_attn_func needs the patched FlashAttention-4: run `python -m fa4_rowmax.patching apply`"
        )
    from flash_attn.cute.interface import _flash_attn_fwd

    out, lse, *_ = _flash_attn_fwd(
        q, k, v, softmax_scale=softmax_scale, causal=causal, return_lse=return_lse, softmax_stage=stage
    )
    return (out, lse) if return_lse else out


def is_fa4_patched() -> bool:
    """Whether the importable FA4 carries all three patches (patches/*.diff): `flash_attn_func` takes
    `softmax_mode` and both kernel classes have the `softmax_stage` hook."""
    import inspect

    from flash_attn.cute import flash_attn_func
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
    from flash_attn.cute.flash_fwd_sm100 import FlashAttentionForwardSm100

    hooks = ("softmax_stage" in vars(cls) for cls in (FlashAttentionForwardSm90, FlashAttentionForwardSm100))
    return "softmax_mode" in inspect.signature(flash_attn_func).parameters and all(hooks)


def fa4_backend(
    softmax_mode: str = "exact",
    *,
    rescale_threshold: Optional[float] = None,
    beta: Optional[float] = None,
    softmax_scale: Optional[float] = None,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor]]:
    """A gate backend running FA4's forward kernel: `(q, k, v, causal) -> (out, lse)`.

    `softmax_mode="exact"` with no knob runs stock FA4 (patched or not). Any other setting needs the
    patched FA4 (`python -m fa4_rowmax.patching apply`) and raises RuntimeError without it. Arguments are
    validated here, before any kernel runs.
    """
    stage = softmax_stage(softmax_mode, rescale_threshold, beta)
    from flash_attn.cute import flash_attn_func

    if stage is not None and not is_fa4_patched():
        raise RuntimeError(
            f"softmax_mode={softmax_mode!r} (rescale_threshold={rescale_threshold}, beta={beta}) needs the "
            "patched FlashAttention-4: run `python -m fa4_rowmax.patching apply`"
        )
    knobs = {} if stage is None else dict(softmax_mode=softmax_mode, rescale_threshold=rescale_threshold, beta=beta)

    def backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
        with torch.no_grad():
            out, lse = flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, return_lse=True, **knobs)
        return out, lse

    backend.__name__ = f"fa4_{softmax_mode}"
    return backend
