"""Host-side dispatch for the FA4 softmax stage: the one place that maps `softmax_mode` + knobs to a kernel.

The patched `flash_attn.cute.flash_attn_func` / `flash_attn_varlen_func` (patches/*.diff) call
`softmax_stage(...)` with the user's arguments (`softmax_mode` None: the process-wide setting, Note [Process-wide
softmax mode] in process_mode.py). It returns `None` for stock FA4 (`softmax_mode="exact"` and no knob set), which
leaves FA4 byte-for-byte unchanged, or a frozen, hashable `SoftmaxStage`. `_flash_attn_fwd`
resolves the stage for the architecture and dtype (`SoftmaxStage.for_kernel`), puts it in the compile-cache
key and hands it to the kernel, which swaps its `Softmax` / `SoftmaxSm100` for ours
(`SoftmaxStage.sm90` / `.sm100`). The SM90 FP8 forward (`fa4_rowmax.fp8_sm90`, FA4's SM90 FP8 calls routed
to it by patch 0001) takes the same stage through the same two steps, so a knob's path is config ->
`softmax_stage` -> `SoftmaxStage.for_kernel` -> the kernel's softmax class, whichever kernel runs it.

`fa4_backend(...)` wraps the patched FA4 as a gate backend `(q, k, v, causal) -> (out, lse)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch

from fa4_rowmax import process_mode
from fa4_rowmax.config import (
    FP8_MAX_OFFSET,
    FP8_SM90_MODES,
    FP8_TILE_M3_TILE_NS,
    KERNEL_MODES,
    STAGE_KNOBS,
    SoftmaxConfig,
    check_knob,
    check_p_range,
    check_real,
)

APPROXIMATE_MODES = tuple(m for m in KERNEL_MODES if m != "exact")


# Note [Features allowed with a softmax stage]
# A softmax stage (an approximate mode, or exact with a knob) has been checked on the H200 against the
# reference only with: dense batches, causal (bottom-right) and not, GQA, bf16/fp16 inputs, seqlens off the
# tile grid, and NaN/Inf inputs (tests/test_fa4_gpu.py, the gates). The layouts serving engines call
# (SERVING_LAYOUT_FEATURES: varlen and paged KV) change how FA4 loads K/V and bounds a sequence, not the stage;
# tests/test_fa4_varlen_paged.py checks each sequence against the reference on the H200 (passed there), and they
# compile with the stage for SM90 and SM100 on the CPU (Note [Serving layouts on the CPU],
# fa4_rowmax/testing/compile_check.py), so FEATURES_TESTED_16BIT holds them for 16-bit inputs. FP8 inputs keep
# them refused (FA4's SM100 FP8 path has compiled only dense; the SM90 FP8 forward takes varlen but not
# page_table: FP8_SM90_REFUSAL_REASONS). Every other FA4 feature below either changes what the softmax sees
# (sinks fold an exact exp2 into the row sum; softcap, score_mod and mask_mod rewrite the scores; local windows
# and block sparsity skip tiles the running max relies on) or the way partial results combine (split-KV merges
# per-split LSEs that the approximate weights do not define: REFUSAL_REASONS), and none has a gate or
# reference test on the GPU. So each is refused, naming the argument and its stock value. Widen the tested
# sets one feature at a time, with an H200 test for it.
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
SERVING_LAYOUT_FEATURES = ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k", "page_table")
FEATURES_TESTED_16BIT: tuple[str, ...] = SERVING_LAYOUT_FEATURES
# Why a refused feature stays refused, where "no GPU test covers it yet" does not say enough.
REFUSAL_REASONS = {
    "num_splits": (
        " (split-KV serves decode, one query per sequence, which is memory-bound: a cheaper exponential gains "
        "nothing there, and the merge of per-split LSEs is not defined for the approximate weights; a decode "
        "step runs unsplit through the stage; num_splits <= 0, FA4's 'choose', is accepted and runs unsplit)"
    ),
}


# Note [num_splits=0 under a softmax stage]
# FA4 reads num_splits < 1 as "let the split heuristic choose" (interface._tile_size_fwd / num_splits_heuristic),
# and engines pass it that way (SGLang's fa4 prefill passes 0: docs/sglang_fa4_rowmax.md). One split is a choice
# the heuristic itself makes for every prefill-sized call, and the only one a softmax stage supports (split-KV is
# refused above), so under a stage a request to choose is accepted and resolved to 1 (patch 0001 sets it before
# FA4 plans the launch; the SM90 FP8 forward never splits). The mode is unchanged: only the split count is chosen.
# An explicit num_splits > 1 stays refused.
def split_request_runs_unsplit(num_splits) -> bool:
    """True for FA4's "choose" request (num_splits < 1), which a softmax stage resolves to one split
    (Note [num_splits=0 under a softmax stage])."""
    return isinstance(num_splits, int) and not isinstance(num_splits, bool) and num_splits < 1


# The SM90 FP8 forward (fa4_rowmax/fp8_sm90.py) takes FA4's varlen arguments and the descales, each tested on the
# H200 there (tests/test_fp8_sm90_varlen.py, tests/test_fp8_sm90_gpu.py); it refuses every other feature.
FP8_SM90_VARLEN_ARGS = ("cu_seqlens_q", "cu_seqlens_k", "seqused_q", "seqused_k")
FP8_SM90_FEATURES_TESTED = (*FP8_SM90_VARLEN_ARGS, "q_descale", "k_descale", "v_descale")
FP8_SM90_REFUSAL_REASONS = {
    **REFUSAL_REASONS,
    "page_table": (
        " (its V^T pre-pass reads V packed, Note [Varlen V^T] in stage/v_transpose.py; a paged V needs V^T built "
        "inside the kernel, which it does not do yet)"
    ),
}
# The kernels of config.KERNELS, as a refusal names them.
KERNEL_NAMES = {
    "sm90": "SM90 (Hopper) FA4 forward",
    "sm100": "SM100-family FA4 forward",
    "sm90_fp8": "SM90 FP8 forward (fa4_rowmax.fp8_sm90)",
}


def refuse_untested_features(
    features: dict, *, where: str, accepted: str, tested: tuple[str, ...] = (), reasons: Optional[dict] = None
) -> None:
    """Raise ValueError for a feature of `features` (FA4 argument -> value) not in `tested` that is set to
    anything but its stock value (Note [Features allowed with a softmax stage]); `where` names the path
    ("with softmax_mode='rowmax_h15' and its knobs"), `accepted` what the user can do instead, `reasons` why a
    feature is refused where that is more than untested (REFUSAL_REASONS)."""
    reasons = REFUSAL_REASONS if reasons is None else reasons
    unknown = sorted(set(features) - set(FEATURE_STOCK_VALUES))
    if unknown:
        raise TypeError(f"unknown FA4 features {unknown}; known: {sorted(FEATURE_STOCK_VALUES)}")
    for name, value in features.items():
        stock = FEATURE_STOCK_VALUES[name]
        if name in tested or value is stock or (stock is not None and value == stock):
            continue
        if name == "num_splits" and split_request_runs_unsplit(value):
            continue
        reason = reasons.get(name, " (no GPU test covers it yet)")
        raise ValueError(f"{name} is not supported {where}{reason}; accepted: {name}={stock!r}{accepted}")


def check_features(mode: str, features: dict, *, q_dtype: torch.dtype, source: Optional[str] = None) -> None:
    """The features a softmax stage refuses for FA4's own forwards (Note [Features allowed with a softmax stage]):
    the serving layouts pass for 16-bit inputs; `source` names where a process-wide mode comes from
    (Note [Process-wide softmax mode])."""
    accepted = ", or softmax_mode='exact' with rescale_threshold=None and beta=None (stock FA4, every feature)"
    if source is not None:
        accepted += f": {process_mode.remedy(source)}"
    refuse_untested_features(
        features,
        where=f"with {_described('softmax_mode', mode, source)} and its knobs for {q_dtype} inputs",
        tested=FEATURES_TESTED_16BIT if torch.finfo(q_dtype).bits == 16 else (),
        accepted=accepted,
    )


def _described(argument: str, value, source: Optional[str]) -> str:
    """`argument=value`, and where a process-wide value comes from ("softmax_mode='rowmax_h15' from
    FA4_ROWMAX_SOFTMAX_MODE")."""
    return f"{argument}={value!r}" + ("" if source is None else f" from {source}")


def _log2_dtype_max(q_dtype: torch.dtype) -> float:
    """log2 of the largest value of P's dtype, from FA4's own table (flash_fwd_sm100._LOG2_DTYPE_MAX)."""
    from flash_attn.cute.flash_fwd_sm100 import _LOG2_DTYPE_MAX
    from flash_attn.cute.interface import torch2cute_dtype_map

    accepted = [dtype for dtype, cute_dtype in torch2cute_dtype_map.items() if cute_dtype in _LOG2_DTYPE_MAX]
    if q_dtype not in accepted:
        raise ValueError(f"q_dtype must be one of {sorted(map(str, accepted))} for a softmax stage; got {q_dtype}")
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
    """The softmax-stage configuration of one forward kernel (part of its compile-cache key): FA4's SM90 / SM100
    forwards and the SM90 FP8 forward alike.

    The knobs are the user's arguments, one field each under the argument's name (`mode` is `softmax_mode`, the
    name SoftmaxConfig and the kernels use; the others are in config.STAGE_KNOBS, Note [Softmax-stage knobs]).
    `softmax_stage` checks them against each other, `for_kernel` resolves them for an architecture and input
    dtype and fills the fields below the knobs. Before that, `rescale_threshold` None means the architecture's
    stock value (SM90: 0, it always rescales; SM100: 8 for 16-bit inputs, 0 for FP8) and beta None stock
    (`exact`: FA4's tuning, on the SM90 FP8 forward every exp2 on the MUFU; approximate modes: 1, every weight
    built off the MUFU).

    SM90 levers: `anchor_rounding="half_octave"` (rowmax_h15) folds scale, anchor subtraction and round-add into
    one FFMA on an anchor rounded to a half octave (this changes values; the reference takes
    `SoftmaxConfig(anchor_rounding="half_octave")`); `rescale_vote=True` skips the O rescale when no row of a warp
    moved its anchor (changes instructions, never values). SM90 FP8 forward only: `row_sum`, `clamp`,
    `exp2_deleted`, `tile_n`, `tile_m`, `kv_stages`, `scheduler_barrier`, `o_store`, `persistent`, `masked_half`,
    `warpgroup_epilogue` (fa4_rowmax/fp8_sm90.py).
    """

    mode: str = "exact"
    rescale_threshold: Optional[float] = None
    beta: Optional[float] = None
    anchor_rounding: str = STAGE_KNOBS["anchor_rounding"].default
    rescale_vote: bool = STAGE_KNOBS["rescale_vote"].default
    row_sum: str = STAGE_KNOBS["row_sum"].default
    clamp: str = STAGE_KNOBS["clamp"].default
    exp2_deleted: bool = STAGE_KNOBS["exp2_deleted"].default
    tile_n: int = STAGE_KNOBS["tile_n"].default
    tile_m: int = STAGE_KNOBS["tile_m"].default  # Note [Three consumer warpgroups], stage/flash_fwd_sm90_fp8.py
    kv_stages: int = STAGE_KNOBS["kv_stages"].default  # Note [KV stages in shared memory], fp8_sm90.py
    pv_accumulation: str = STAGE_KNOBS["pv_accumulation"].default  # Note [Two-level P.V accumulation]
    intra_wg_overlap: bool = STAGE_KNOBS["intra_wg_overlap"].default
    arrive_after_pv: bool = STAGE_KNOBS["arrive_after_pv"].default  # Note [Scheduler window after the P.V GEMM]
    scheduler_barrier: bool = STAGE_KNOBS["scheduler_barrier"].default  # Note [Three consumer warpgroups]
    o_store: str = STAGE_KNOBS["o_store"].default  # Note [O's tile without the row-sum columns]
    persistent: bool = STAGE_KNOBS["persistent"].default  # Note [Persistent work tiles]
    masked_half: str = STAGE_KNOBS["masked_half"].default  # Note [The masked half of the first KV tile]
    warpgroup_epilogue: str = STAGE_KNOBS["warpgroup_epilogue"].default  # Note [Each warpgroup's own tile boundary]
    # Resolved by for_kernel:
    arch: Optional[int] = None
    q_dtype: Optional[torch.dtype] = None
    max_offset: int = 0
    threshold_from_fa4: bool = False  # rescale_threshold was None: FA4's default, checked at trace time
    has_descale: bool = False  # SM90 FP8: q/k/v descales given (Note [Descales], stage/softmax_sm90_fp8.py)
    # (argument, source) for each argument taken from the process setting (Note [Process-wide softmax mode]): for
    # the errors only, so a stage from the environment equals (and compiles as) the explicit one.
    sources: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)

    def source(self, argument: str) -> Optional[str]:
        """The variable or scope `argument` came from, None when the call passed it (or left it at its default)."""
        return dict(self.sources).get(argument)

    def described(self, argument: str) -> str:
        """`argument=value` and its source, for an error."""
        return _described(
            argument, getattr(self, "mode" if argument == "softmax_mode" else argument), self.source(argument)
        )

    @property
    def kernel(self) -> str:
        """Which kernel this resolved stage compiles into (config.KERNELS)."""
        self._check_resolved()
        if self.arch // 10 == 9:
            return "sm90_fp8" if torch.finfo(self.q_dtype).bits == 8 else "sm90"
        return "sm100"

    def for_kernel(self, *, arch: int, q_dtype: torch.dtype, features: Optional[dict] = None) -> "SoftmaxStage":
        """Resolve the knobs for `arch` (e.g. 90, 100) and the input dtype; refuse untested FA4 features
        (`features`: FA4 argument -> value, Note [Features allowed with a softmax stage]) and knobs the kernel
        does not implement; apply FA4's stock defaults and the range rule."""
        if isinstance(arch, bool) or not isinstance(arch, int):  # 90.0 == 90 would pass the family check
            raise TypeError(
                f"arch must be an int compute capability (major * 10 + minor) such as 90, 100, 103, 110, not a bool, "
                f"float or str; got {arch!r} ({type(arch).__name__})"
            )
        family = arch // 10
        source = self.source("softmax_mode")
        if family not in (9, 10, 11):
            raise ValueError(
                f"{self.described('softmax_mode')} with rescale_threshold/beta needs an SM90 or SM100-family GPU "
                f"(arch 90, 100, 103, 110); got arch {arch}. Accepted on other GPUs: softmax_mode='exact' "
                "with rescale_threshold=None and beta=None"
                + ("." if source is None else f" ({process_mode.remedy(source)}).")
            )
        log2_p_max = _log2_dtype_max(q_dtype)
        features = features or {}
        kernel = replace(self, arch=arch, q_dtype=q_dtype).kernel
        if kernel == "sm90_fp8":
            refuse_untested_features(
                features,
                where="by the SM90 FP8 forward (fa4_rowmax.fp8_sm90)",
                accepted="",
                tested=FP8_SM90_FEATURES_TESTED,
                reasons=FP8_SM90_REFUSAL_REASONS,
            )
        else:
            check_features(self.mode, features, q_dtype=q_dtype, source=source)
        for name, knob in STAGE_KNOBS.items():
            if getattr(self, name) != knob.default and kernel not in knob.kernels:
                raise ValueError(
                    f"{name}={getattr(self, name)!r} is implemented by the "
                    f"{' and the '.join(KERNEL_NAMES[k] for k in knob.kernels)} only; got arch {arch} with {q_dtype} "
                    f"inputs (the {KERNEL_NAMES[kernel]}). Accepted there: {name}={knob.default!r}"
                )
        beta = self.beta
        if kernel == "sm90_fp8":
            beta = _fp8_sm90_beta(self)
            if self.rescale_vote and self.pv_accumulation == "two_level":
                raise ValueError(
                    "rescale_vote=True applies to pv_accumulation='single' only: two-level accumulation promotes every "
                    "tile by an FFMA that carries the rescale, so there is no rescale to skip (Note [Two-level P.V "
                    "accumulation]); accepted with pv_accumulation='two_level': rescale_vote=False"
                )
            if self.persistent and any(features.get(name) is not None for name in FP8_SM90_VARLEN_ARGS):
                raise ValueError(
                    "persistent=True applies to dense batches (Note [Persistent work tiles]): a varlen call runs "
                    "FA4's varlen scheduler; accepted with cu_seqlens_q/k or seqused_q/k: persistent=False"
                )
            o_at_head_dim = self.o_store == "head_dim" or self.row_sum == "fadd"
            if self.warpgroup_epilogue == "own" and not (
                self.persistent and not self.intra_wg_overlap and o_at_head_dim
            ):
                raise ValueError(
                    "warpgroup_epilogue='own' lets each consumer warpgroup end its work tiles alone on the persistent "
                    "grid, in the step without intra-warpgroup overlap, storing O's head_dim columns (Note [Each "
                    f"warpgroup's own tile boundary]); got persistent={self.persistent!r}, "
                    f"intra_wg_overlap={self.intra_wg_overlap!r}, o_store={self.o_store!r} with "
                    f"row_sum={self.row_sum!r}. Accepted: warpgroup_epilogue='own' with persistent=True, "
                    "intra_wg_overlap=False and o_store='head_dim' (or row_sum='fadd'), or warpgroup_epilogue='shared'"
                )
            if self.arrive_after_pv and self.intra_wg_overlap:
                raise ValueError(
                    "arrive_after_pv=True moves the scheduler hand-over of the step without intra-warpgroup overlap "
                    "(Note [Scheduler window after the P.V GEMM]); accepted: arrive_after_pv=True with "
                    "intra_wg_overlap=False, or arrive_after_pv=False"
                )
            if self.masked_half == "skip" and any(features.get(name) is not None for name in FP8_SM90_VARLEN_ARGS):
                raise ValueError(
                    "masked_half='skip' is tested on dense batches only (Note [The masked half of the first KV "
                    "tile]); accepted with cu_seqlens_q/k or seqused_q/k: masked_half='compute'"
                )
            if self.masked_half == "skip" and (
                self.pv_accumulation != "two_level" or self.intra_wg_overlap or (self.tile_n // 2) % 32
            ):
                raise ValueError(
                    "masked_half='skip' runs the first KV tile's GEMMs over its first half in the step without "
                    "intra-warpgroup overlap, under two-level accumulation, in whole k32 steps of keys (Note [The "
                    f"masked half of the first KV tile]); got pv_accumulation={self.pv_accumulation!r}, "
                    f"intra_wg_overlap={self.intra_wg_overlap!r}, tile_n={self.tile_n}. Accepted: masked_half='skip' "
                    "with pv_accumulation='two_level', intra_wg_overlap=False and tile_n 128, 192 or 256, or "
                    "masked_half='compute'"
                )
            if self.tile_m == 192:
                _check_three_warpgroups(self)
            elif self.scheduler_barrier:
                raise ValueError(
                    "scheduler_barrier=True gives three consumer warpgroups (tile_m=192) FA4's round-robin scheduler "
                    "barrier; two warpgroups always take FA4's ping-pong one (Note [Three consumer warpgroups]); "
                    f"got tile_m={self.tile_m}. Accepted: scheduler_barrier=True with tile_m=192, or "
                    "scheduler_barrier=False"
                )
        max_offset = fa4_max_offset(q_dtype)
        threshold = self.rescale_threshold
        if threshold is None:
            threshold = fa4_default_rescale_threshold(arch, q_dtype)
        check_p_range(
            self.mode,
            threshold,
            max_offset,
            log2_p_max,
            name=self.source("rescale_threshold") or "rescale_threshold",
            where=f"{self.described('softmax_mode')} with {q_dtype} inputs",
        )
        has_descale = any(features.get(name) is not None for name in ("q_descale", "k_descale", "v_descale"))
        return replace(
            self,
            rescale_threshold=float(threshold),
            beta=beta,
            arch=arch,
            q_dtype=q_dtype,
            max_offset=max_offset,
            threshold_from_fa4=self.rescale_threshold is None,
            has_descale=has_descale,
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
        must carry the max_offset (and, when the user left it None, the threshold) resolved on the host. FA4's
        SM90 `Softmax` has no max_offset (FA4 has no SM90 FP8 forward): the SM90 FP8 forward's offset is FA4's
        SM100 FP8 rule (`fa4_max_offset`, Note [FP8 max_offset] in stage/softmax_sm90_fp8.py), so there the
        stock object must carry none."""
        stock_offset = getattr(softmax, "max_offset", 0)
        expected_offset = 0 if self.kernel == "sm90_fp8" else self.max_offset
        assert int(stock_offset) == expected_offset, (
            f"FA4 built its softmax with max_offset {stock_offset}; fa4_rowmax expected {expected_offset} "
            "(fa4_max_offset has drifted from FA4's rule)"
        )
        if self.threshold_from_fa4:
            stock_threshold = getattr(softmax, "rescale_threshold", 0.0)
            assert float(stock_threshold) == self.rescale_threshold, (
                f"FA4 built its softmax with rescale_threshold {stock_threshold}; fa4_rowmax resolved "
                f"{self.rescale_threshold} (fa4_default_rescale_threshold has drifted from FA4's rule)"
            )

    def sm90(self, softmax):
        """The SM90 kernel's `Softmax`, replaced by the stage's: `RowmaxSoftmaxSm90` (16-bit inputs) or
        `Fp8SoftmaxSm90` (the SM90 FP8 forward)."""
        self._check_resolved()
        self._check_stock_defaults(softmax)
        if self.kernel == "sm90_fp8":
            from fa4_rowmax.stage.softmax_sm90_fp8 import Fp8SoftmaxSm90

            return Fp8SoftmaxSm90.from_stock(softmax, self)
        from fa4_rowmax.stage.softmax_sm90 import RowmaxSoftmaxSm90

        return RowmaxSoftmaxSm90.from_stock(softmax, self)

    def sm100(self, softmax):
        """The SM100 kernel's `SoftmaxSm100`, replaced by `RowmaxSoftmaxSm100` with this stage's knobs."""
        from fa4_rowmax.stage.softmax_sm100 import RowmaxSoftmaxSm100

        self._check_resolved()
        self._check_stock_defaults(softmax)
        return RowmaxSoftmaxSm100.from_stock(
            softmax, mode=self.mode, beta=self.beta, rescale_threshold=self.rescale_threshold
        )


def _check_three_warpgroups(stage: SoftmaxStage) -> None:
    """tile_m=192 (three consumer warpgroups at 160 registers a thread): without intra-warpgroup overlap, whose S,
    second accumulator and O do not fit, at tile_n <= 160, and arrive_after_pv only with the round-robin scheduler
    barrier (three warpgroups without overlap take none in FA4: Note [Three consumer warpgroups],
    stage/flash_fwd_sm90_fp8.py)."""
    if stage.intra_wg_overlap:
        raise ValueError(
            "tile_m=192 (three consumer warpgroups) needs intra_wg_overlap=False: with the overlap, S, the second "
            "accumulator and O do not fit in 160 registers (Note [Three consumer warpgroups]); accepted: "
            "tile_m=192 with intra_wg_overlap=False, or tile_m=128"
        )
    if stage.tile_n not in FP8_TILE_M3_TILE_NS:
        raise ValueError(
            f"tile_m=192 (three consumer warpgroups) takes tile_n in {FP8_TILE_M3_TILE_NS}, got tile_n={stage.tile_n}: "
            "larger key tiles spill registers (Note [Three consumer warpgroups]); accepted: tile_m=192 with tile_n in "
            f"{FP8_TILE_M3_TILE_NS}, or tile_m=128"
        )
    if stage.arrive_after_pv and not stage.scheduler_barrier:
        raise ValueError(
            "arrive_after_pv=True moves the scheduler hand-over; three warpgroups have one only with FA4's "
            "round-robin (Note [Three consumer warpgroups]); accepted with tile_m=192: arrive_after_pv=True with "
            "scheduler_barrier=True, or arrive_after_pv=False"
        )


def _fp8_sm90_beta(stage: SoftmaxStage) -> Optional[float]:
    """beta on the SM90 FP8 forward (Note [beta on the FP8 exact twin], stage/softmax_sm90_fp8.py): exact keeps a
    share in (0, 1] and maps 0 to None (the unchanged kernel: one stage, one compile key, one SASS); rowmax_h15
    takes None or 1.0 (its weights use no MUFU at all), both None."""
    if stage.mode not in FP8_SM90_MODES:
        source = stage.source("softmax_mode")
        raise ValueError(
            f"softmax_mode must be one of {FP8_SM90_MODES} on the SM90 FP8 path, got {stage.described('softmax_mode')}"
            + ("" if source is None else f"; {process_mode.remedy(source)}")
        )
    if stage.beta is None:
        return None
    if stage.mode == "rowmax_h15":
        if stage.beta != 1.0:
            raise ValueError(
                f"beta must be None or 1.0 with softmax_mode='rowmax_h15' on the SM90 FP8 path, got "
                f"{stage.described('beta')}: "
                "every H15 weight is built by integer ops off the MUFU (Note [H15 e4m3 bytes by integer ops]), so "
                "there is no MUFU share to choose"
            )
        return None
    return stage.beta if stage.beta > 0.0 else None


def softmax_stage(
    softmax_mode: Optional[str] = "exact",
    rescale_threshold: Optional[float] = None,
    beta: Optional[float] = None,
    *,
    requires_grad: bool = False,
    **knobs,
) -> Optional[SoftmaxStage]:
    """Validate the user's softmax arguments; `None` means stock FA4 (every knob at its default). `softmax_mode`
    None takes the process-wide setting, else "exact" (the patched FA4's default; Note [Process-wide softmax mode]).

    `knobs` are config.STAGE_KNOBS by name (keyword-only; anchor_rounding and rescale_vote are the SM90 levers,
    which the patched `flash_attn_func` does not take: use `rowmax_attn_func`; row_sum, clamp, exp2_deleted and
    tile_n belong to the SM90 FP8 forward). Each is checked here against the table and the other knobs; whether
    the kernel implements it is `SoftmaxStage.for_kernel`'s check.

    Raises TypeError/ValueError naming the argument and the accepted values. An approximate mode is
    forward-only (FA4's backward recomputes P with exact exp2), so `requires_grad=True` raises.
    """
    sources: tuple[tuple[str, str], ...] = ()
    if softmax_mode is None:
        softmax_mode, rescale_threshold, beta, sources = process_mode.resolve(rescale_threshold, beta)
    if not isinstance(softmax_mode, str):
        raise TypeError(f"softmax_mode must be a str, one of {KERNEL_MODES}; got {type(softmax_mode).__name__}")
    if softmax_mode not in KERNEL_MODES:
        raise ValueError(f"softmax_mode must be one of {KERNEL_MODES}; got {softmax_mode!r}")
    accepted = "None (the architecture's default) or a finite float >= 0 (log2 units)"
    if rescale_threshold is not None:
        rescale_threshold = check_real("rescale_threshold", rescale_threshold, 0.0, accepted=accepted)
    if beta is not None:
        beta = check_real("beta", beta, 0.0, 1.0, accepted="None or a number in [0, 1]")
    unknown = sorted(set(knobs) - set(STAGE_KNOBS))
    if unknown:
        raise TypeError(f"unknown softmax-stage knobs {unknown}; accepted: {sorted(STAGE_KNOBS)}")
    knobs = {name: check_knob(name, knobs.get(name, knob.default)) for name, knob in STAGE_KNOBS.items()}
    if knobs["anchor_rounding"] != "exact" and softmax_mode != "rowmax_h15":
        raise ValueError(
            f"anchor_rounding={knobs['anchor_rounding']!r} applies to softmax_mode='rowmax_h15' only; got "
            f"softmax_mode={softmax_mode!r} (accepted with it: anchor_rounding='exact')"
        )
    if knobs["clamp"] == "sat" and (softmax_mode != "rowmax_h15" or knobs["anchor_rounding"] != "exact"):
        raise ValueError(
            "clamp='sat' applies to softmax_mode='rowmax_h15' with anchor_rounding='exact' only; got "
            f"softmax_mode={softmax_mode!r}, anchor_rounding={knobs['anchor_rounding']!r} (accepted: clamp='max')"
        )
    if knobs["exp2_deleted"] and softmax_mode != "exact":
        raise ValueError(
            f"exp2_deleted is a cost probe of softmax_mode='exact' only; got softmax_mode={softmax_mode!r} "
            "(accepted: exp2_deleted=False)"
        )
    if knobs["exp2_deleted"] and beta is not None:
        raise ValueError(
            f"beta must be None with exp2_deleted=True, got {beta!r}: the probe computes no exp2 to move off the MUFU"
        )
    mode_source = dict(sources).get("softmax_mode")
    if softmax_mode in APPROXIMATE_MODES and requires_grad:
        raise ValueError(
            f"{_described('softmax_mode', softmax_mode, mode_source)} is forward-only: FA4's backward recomputes P "
            "with exact exp2, so gradients would not match this forward. Run it under torch.no_grad() / "
            "torch.inference_mode() or on inputs that do not require grad; accepted with gradients: "
            "softmax_mode='exact'" + ("" if mode_source is None else f" ({process_mode.remedy(mode_source)})")
        )
    stock = all(value == STAGE_KNOBS[name].default for name, value in knobs.items())
    if softmax_mode == "exact" and rescale_threshold is None and beta is None and stock:
        return None
    return SoftmaxStage(mode=softmax_mode, rescale_threshold=rescale_threshold, beta=beta, sources=sources, **knobs)


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
    """Whether the importable FA4 carries all four patches (patches/*.diff): `flash_attn_func` takes
    `softmax_mode`, both kernel classes have the `softmax_stage` hook and the base kernel the `wait_o_store` seam."""
    import inspect

    from flash_attn.cute import flash_attn_func
    from flash_attn.cute.flash_fwd import FlashAttentionForwardBase
    from flash_attn.cute.flash_fwd_sm90 import FlashAttentionForwardSm90
    from flash_attn.cute.flash_fwd_sm100 import FlashAttentionForwardSm100

    hooks = ("softmax_stage" in vars(cls) for cls in (FlashAttentionForwardSm90, FlashAttentionForwardSm100))
    seam = "wait_o_store" in vars(FlashAttentionForwardBase)
    return "softmax_mode" in inspect.signature(flash_attn_func).parameters and all(hooks) and seam


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
    # softmax_mode always explicit on a patched FA4, so that a process-wide mode (Note [Process-wide softmax mode])
    # never changes a gate backend; an unpatched FA4 takes no softmax_mode and has no process-wide mode.
    knobs = dict(softmax_mode=softmax_mode, rescale_threshold=rescale_threshold, beta=beta)
    if stage is None and not is_fa4_patched():
        knobs = {}

    def backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool):
        with torch.no_grad():
            out, lse = flash_attn_func(q, k, v, softmax_scale=softmax_scale, causal=causal, return_lse=True, **knobs)
        return out, lse

    backend.__name__ = f"fa4_{softmax_mode}"
    return backend
