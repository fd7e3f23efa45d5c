"""`SoftmaxConfig`: which softmax a reference or kernel computes, and its knobs.

One frozen dataclass, validated on construction, shared by the semantic reference
(`reference/attention.py`), the gates and the host-side dispatch (`interface.py`, which takes its mode list
and anchor roundings from here and derives a reference config from a resolved kernel stage:
`SoftmaxStage.reference_config`). Field meanings are in
`docs/design.md` ("`SoftmaxConfig` fields"); every rejected value raises `ValueError`
(or `TypeError` for a value of the wrong type) naming the field and what it accepts.

Also the kernels' softmax-stage knobs (`STAGE_KNOBS`, Note [Softmax-stage knobs]) and the one range rule
(`check_p_range`) that the reference config, the FA4 stage and the SM90 FP8 forward share.
"""

import math
import numbers
from dataclasses import dataclass
from typing import NamedTuple, Optional

import torch

SOFTMAX_MODES = ("exact", "rowmax_pot", "rowmax_h15", "baps", "fused_softmax")
# The modes FA4's softmax stage implements (`softmax_mode` of the patched flash_attn_func); the rest are
# reference-only here (BAPS) or have their own kernel (Fused-Softmax, aiter_fused).
KERNEL_MODES = ("exact", "rowmax_h15", "rowmax_pot")
MX_FORMATS = ("mxfp8", "mxfp6", "mxfp4")
MX_BLOCK = 32
ANCHORS = ("tile", "row")
# How the H15 lattice's anchor is placed: on the running max itself, or rounded to a half octave as the
# SM90 folded FFMA does (fa4_rowmax/stage/softmax_base.py, Note [Folded H15 with a half-octave anchor]).
ANCHOR_ROUNDINGS = ("exact", "half_octave")
# The reference's emulated FP8 MMA accumulator (reference/mma_accumulator.py, Note [Emulated FP8 MMA accumulator]):
# which GEMMs it applies to, and the largest number of fraction bits it keeps (fp32's).
ACCUMULATOR_GEMMS = ("qk_pv", "qk", "pv")
ACCUMULATOR_MAX_BITS = 23
# How the emulated P V accumulator reaches O (Note [Two-level P V accumulation]): "none", O is the wgmma's
# accumulator input on every tile (single-level); "tile", a fresh accumulator per KV tile promoted into the fp32 O
# by one FFMA (two-level). The SM90 FP8 forward's `pv_accumulation` values, in the same order.
ACCUMULATOR_PROMOTIONS = ("none", "tile")
PV_ACCUMULATIONS = ("single", "two_level")
# Modes whose max is FA4's running max, so that a whole-row anchor is a meaningful control.
ANCHORED_MODES = ("exact", "rowmax_pot", "rowmax_h15")
P_DTYPES = (
    torch.float64,
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
)
# HiF8 holds 2**15 at most, and BAPS weights reach 2**lambda.
BAPS_LAMBDA_MAX = 15
RECOVERY_THRESHOLD_LIMIT = 126.0
# 2**-126 is fp32's smallest normal: a larger clamp would flush the clamped weights.
POT_K_MAX_LIMIT = 126
# FA4's max_offset for FP8 inputs (flash_fwd_sm100.py, Note [Low Precision Scaling]): P scaled by 2**8.
FP8_MAX_OFFSET = 8
_FP8_P_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# Note [H15 range with an FP8 P]
# An FP8 Rowmax-H15 P is defined by its bytes (reference/exp_approx.py, Note [H15 weights as e4m3 bytes]), and
# those exist only up to the dtype's max: the largest weight 2**(max_offset + rescale_threshold + the round-up
# log2(1.5) - 1/4) must stay below it (FA4's range rule), or the config has no meaning. (`exact` with an FP8 P
# stays accepted past it: there the saturating convert is a defined behaviour the reference models.)
# Note [P range with a rounded-up weight]
# FA4 requires max_offset + rescale_threshold < log2(max of the P dtype) (Note [Low Precision Scaling] in
# flash_fwd_sm100.py): a stale max lets x reach max_offset + rescale_threshold. Rowmax-H15 rounds x to
# the nearest half octave and then takes S, so log2(H(x)) - x reaches log2(1.5) - 0.25 = 0.335 octaves;
# Rowmax-PoT rounds to the nearest octave, up to 0.5. That headroom must fit too, or the top weights
# saturate in P while the fp32 row sum counts them in full.
LOG2_ROUND_UP = {"exact": 0.0, "rowmax_h15": math.log2(1.5) - 0.25, "rowmax_pot": 0.5}
H15_LOG2_ROUND_UP = LOG2_ROUND_UP["rowmax_h15"]


def check_p_range(mode: str, rescale_threshold: float, max_offset: float, log2_p_max: float, *, name: str, where: str):
    """The range rule (Note [P range with a rounded-up weight], Note [H15 range with an FP8 P]): the largest
    weight, 2**(max_offset + rescale_threshold + the mode's round-up), must stay below P's dtype max. `name` is the
    argument the refusal names, `where` the mode and dtype it holds for. The one copy of the rule: the reference's
    config, the FA4 stage and the SM90 FP8 forward all call it."""
    limit = log2_p_max - max_offset - LOG2_ROUND_UP[mode]
    if rescale_threshold >= limit:
        top = max_offset + rescale_threshold + LOG2_ROUND_UP[mode]
        raise ValueError(
            f"{name}={rescale_threshold} is out of range for {where}: it lets P reach 2**{top:.3f}, and max_offset "
            f"({max_offset}) + rescale_threshold + the mode's round-up ({LOG2_ROUND_UP[mode]:.3f} octaves) must stay "
            f"below log2 of P's dtype max ({log2_p_max:.3f}); accepted: 0 <= rescale_threshold < {limit:.3f}"
        )


# Note [Softmax-stage knobs]
# The knobs of the kernels' softmax stage beyond softmax_mode, rescale_threshold and beta: for each, the values it
# accepts, its default (stock FA4's behaviour, or the FP8 forward's measured choice) and the kernels that
# implement a value other than the default: "sm90" / "sm100" (FA4's forwards with the stage, 16-bit inputs, and
# FA4's own SM100 FP8 path), "sm90_fp8" (the SM90 FP8 forward, fa4_rowmax/fp8_sm90.py). `interface.softmax_stage`
# checks every value against this table (type included: True is not 1, 128.0 is not 128) and
# `SoftmaxStage.for_kernel` refuses a non-default value on a kernel that does not implement it. The stage
# (`interface.SoftmaxStage`) has one field per knob, of the same name, and the kernels' softmax classes read
# fields of those names: a new knob is one entry here, one stage field, and its rules against other knobs in the
# resolution (`interface.softmax_stage` / `SoftmaxStage.for_kernel`).
class Knob(NamedTuple):
    accepted: tuple
    default: object
    kernels: tuple[str, ...]


KERNELS = ("sm90", "sm100", "sm90_fp8")
# The SM90 FP8 forward's modes (rowmax_pot has no e4m3 byte construction there).
FP8_SM90_MODES = ("exact", "rowmax_h15")
# How the FP8 forward adds the row sum: FADDs of the weights, or a column of ones in the PV GEMM
# (Note [Row sum by the MMA], stage/softmax_sm90_fp8.py).
ROW_SUMS = ("fadd", "mma")
# The H15 clamp of the FP8 forward: a max, or the FFMA's saturation (Note [Clamp by saturation]).
CLAMPS = ("max", "sat")
# Keys per tile of the FP8 forward: multiples of 32 (the e4m3 wgmma's K) that fit its registers.
FP8_TILE_NS = (128, 160, 192, 224, 256)
# Query rows per tile of the FP8 forward: 64 per consumer warpgroup, so two or three warpgroups (FA4's register
# split: 240 registers a thread for two, 160 for three). Three fit only without intra-warpgroup overlap and with
# at most 160 keys per tile (Note [Three consumer warpgroups], stage/flash_fwd_sm90_fp8.py).
FP8_TILE_MS = (128, 192)
FP8_TILE_M3_TILE_NS = (128, 160)
# K and V buffers in flight of the FP8 forward (FA4's num_stages): a stage holds one K tile and one V^T tile, so
# how many fit depends on tile_m, tile_n and the head dim (Note [KV stages in shared memory], fp8_sm90.py).
FP8_KV_STAGES = (2, 3, 4, 5)
STAGE_KNOBS = {
    "anchor_rounding": Knob(ANCHOR_ROUNDINGS, "exact", ("sm90", "sm90_fp8")),
    "rescale_vote": Knob((False, True), False, ("sm90", "sm90_fp8")),
    "row_sum": Knob(ROW_SUMS, "fadd", ("sm90_fp8",)),
    "clamp": Knob(CLAMPS, "max", ("sm90_fp8",)),
    "exp2_deleted": Knob((False, True), False, ("sm90_fp8",)),
    "tile_n": Knob(FP8_TILE_NS, 128, ("sm90_fp8",)),
    "tile_m": Knob(FP8_TILE_MS, 128, ("sm90_fp8",)),
    "kv_stages": Knob(FP8_KV_STAGES, 2, ("sm90_fp8",)),
    "pv_accumulation": Knob(PV_ACCUMULATIONS, "two_level", ("sm90_fp8",)),
    # FA4's intra-warpgroup overlap (the next tile's S while this tile's P V runs); off, each warpgroup's S, softmax
    # and P V follow each other and only the other warpgroup's GEMMs overlap them (Note [Two-level P.V
    # accumulation]: fewer live registers, so larger tiles fit).
    "intra_wg_overlap": Knob((True, False), True, ("sm90_fp8",)),
    # Without intra-warpgroup overlap: where a warpgroup hands the tensor cores to the other one. False is FA4's
    # place (after issuing the next tile's S, so the P.V GEMM's wait and the promotion sit inside the window);
    # True hands over as soon as this tile's P.V GEMM has finished (Note [Scheduler window after the P.V GEMM],
    # stage/flash_fwd_sm90_fp8.py).
    "arrive_after_pv": Knob((False, True), False, ("sm90_fp8",)),
    # Three consumer warpgroups (tile_m 192) without overlap: FA4's round-robin scheduler barrier, each warpgroup
    # issuing its P.V and next S GEMM in turn; False is FA4's choice there, no barrier (two warpgroups always take
    # FA4's ping-pong one). Note [Three consumer warpgroups], stage/flash_fwd_sm90_fp8.py.
    "scheduler_barrier": Knob((False, True), False, ("sm90_fp8",)),
    # The columns of O's shared tile and TMA store with row_sum="mma": "pv_columns" stores the P.V GEMM's head_dim + 8
    # (the TMA store clips the row-sum columns at out's edge), "head_dim" the head_dim columns alone. Values are the
    # same; Note [O's tile without the row-sum columns], stage/flash_fwd_sm90_fp8.py. With row_sum="fadd" the two
    # are one kernel.
    "o_store": Knob(("pv_columns", "head_dim"), "pv_columns", ("sm90_fp8",)),
    # A persistent grid for dense batches, one CTA per SM taking work tiles as it frees up, instead of FA4's one CTA
    # per work tile, so that the next tile's loads run under this tile's last GEMM and epilogue (Note [Persistent
    # work tiles], stage/flash_fwd_sm90_fp8.py). Varlen calls keep FA4's varlen scheduler (refused with it).
    "persistent": Knob((False, True), False, ("sm90_fp8",)),
    # A work tile's first KV tile when every key of its second half is masked for every row (the causal diagonal of
    # every other m block at tile_m 128 and tile_n 256): "compute" runs FA4's full GEMMs, "skip" the S and P.V GEMMs
    # over the first half alone (Note [The masked half of the first KV tile], stage/flash_fwd_sm90_fp8.py); two-level
    # accumulation without intra-warpgroup overlap, tile_n 128, 192 or 256, dense batches.
    "masked_half": Knob(("compute", "skip"), "compute", ("sm90_fp8",)),
    # Where a work tile ends on the persistent grid: "shared" is FA4's (every consumer warpgroup meets at the
    # epilogue's barrier and the next tile's slot, one TMA store of O's tile, Q released after the last P.V GEMM),
    # "own" each warpgroup alone (Q released after its last S GEMM, its rows of O stored by its own threads, its own
    # slot barrier). Values are the same; Note [Each warpgroup's own tile boundary], stage/flash_fwd_sm90_fp8.py.
    # "own" needs persistent=True, intra_wg_overlap=False, O at head_dim columns and no packed GQA.
    "warpgroup_epilogue": Knob(("shared", "own"), "shared", ("sm90_fp8",)),
}


def check_knob(name: str, value):
    """`value` when it is one of knob `name`'s accepted values, of the default's type (a bool for a flag, an int,
    not a float or a bool, for a count); TypeError or ValueError naming the knob and the accepted values."""
    knob = STAGE_KNOBS[name]
    if isinstance(knob.default, bool):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool; got {value!r} ({type(value).__name__})")
        return value
    integral = isinstance(knob.default, numbers.Integral)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if integral else type(knob.default)):
        kind = "an int" if integral else f"a {type(knob.default).__name__}"
        raise TypeError(f"{name} must be {kind}, one of {knob.accepted}; got {value!r} ({type(value).__name__})")
    if value not in knob.accepted:
        raise ValueError(f"{name} must be one of {knob.accepted}; got {value!r}")
    return value


def _check_int(name: str, value, low: int, high: Optional[int] = None) -> None:
    accepted = f">= {low}" if high is None else f"in [{low}, {high}]"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"SoftmaxConfig.{name} must be an int {accepted}, got {value!r} ({type(value).__name__})")
    if not isinstance(value, numbers.Integral) or value < low or (high is not None and value > high):
        raise ValueError(f"SoftmaxConfig.{name} must be an int {accepted}, got {value!r}")


def check_real(name: str, value, low: float, high: float = math.inf, accepted: Optional[str] = None) -> float:
    """`value` as a float when it is a real number (not a bool), finite and in [low, high]; otherwise TypeError or
    ValueError naming `name` and what it accepts (`accepted`, or the range). An int too large for a float
    (10**400) is out of range, not an OverflowError."""
    shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:20]}... ({len(repr(value))} characters)"
    if accepted is None:
        accepted = f"a finite number {f'>= {low}' if high == math.inf else f'in [{low}, {high}]'}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be {accepted} (a real number), got {shown} ({type(value).__name__})")
    try:
        as_float = float(value)
    except OverflowError:
        as_float = math.inf
    if not math.isfinite(as_float) or as_float < low or as_float > high:
        raise ValueError(f"{name} must be {accepted}, got {shown}")
    return as_float


def _check_real(name: str, value, low: float, high: float = math.inf, integral: bool = False) -> None:
    check_real(f"SoftmaxConfig.{name}", value, low, high)
    if integral and value != int(value):
        raise ValueError(f"SoftmaxConfig.{name} must be a whole number of octaves, got {value}")


def _check_choice(name: str, value, accepted: tuple) -> None:
    if value not in accepted:
        raise ValueError(f"SoftmaxConfig.{name} must be one of {accepted}, got {value!r}")


@dataclass(frozen=True)
class SoftmaxConfig:
    mode: str = "exact"
    tile_n: int = 128
    tile_m: int = 128
    rescale_threshold: float = 0.0
    max_offset: float = 0.0
    p_dtype: Optional[torch.dtype] = None
    anchor: str = "tile"
    pot_k_max: int = 20
    beta: Optional[float] = None
    baps_lambda: int = 1
    baps_critical_tiles: int = 1
    mx_format: str = "mxfp8"
    recovery_threshold: float = 8.0
    anchor_rounding: str = "exact"
    accumulator_mantissa_bits: Optional[int] = None
    accumulator_gemms: str = "qk_pv"
    accumulator_promotion: str = "none"
    # How the row sum adds P (Note [Row sum by the MMA in the reference], reference/attention.py): "fadd", the float
    # weights before P's rounding (FA4's order); "mma", the rounded P as the P V GEMM multiplies it (a ones column of
    # V, through the emulated accumulator when there is one): the SM90 FP8 forward's row_sum="mma".
    row_sum: str = "fadd"

    def __post_init__(self) -> None:
        _check_choice("mode", self.mode, SOFTMAX_MODES)
        _check_int("tile_n", self.tile_n, 1)
        _check_int("tile_m", self.tile_m, 1)
        _check_real("rescale_threshold", self.rescale_threshold, 0.0)
        # FA4 declares max_offset an int; a whole number also keeps the H15 and PoT
        # lattices anchored on the row max.
        _check_real("max_offset", self.max_offset, 0.0, integral=True)
        if self.p_dtype is not None and self.p_dtype not in P_DTYPES:
            raise ValueError(f"SoftmaxConfig.p_dtype must be None or one of {P_DTYPES}, got {self.p_dtype!r}")
        _check_choice("anchor", self.anchor, ANCHORS)
        if self.anchor == "row" and self.mode not in ANCHORED_MODES:
            raise ValueError(f"SoftmaxConfig.anchor='row' applies to modes {ANCHORED_MODES}, not mode={self.mode!r}")
        _check_int("pot_k_max", self.pot_k_max, 0, POT_K_MAX_LIMIT)
        if self.beta is not None:
            _check_real("beta", self.beta, 0.0, 1.0)
        _check_int("baps_lambda", self.baps_lambda, 0, BAPS_LAMBDA_MAX)
        _check_int("baps_critical_tiles", self.baps_critical_tiles, 0)
        _check_choice("mx_format", self.mx_format, MX_FORMATS)
        # P = 2**(x - m) with x - m up to the threshold must stay below BF16's infinity.
        _check_real("recovery_threshold", self.recovery_threshold, 0.0, RECOVERY_THRESHOLD_LIMIT)
        _check_choice("anchor_rounding", self.anchor_rounding, ANCHOR_ROUNDINGS)
        if self.anchor_rounding != "exact" and self.mode != "rowmax_h15":
            raise ValueError(
                f"SoftmaxConfig.anchor_rounding={self.anchor_rounding!r} applies to mode 'rowmax_h15' only, "
                f"not mode={self.mode!r} (accepted there: 'exact')"
            )
        if self.accumulator_mantissa_bits is not None:
            _check_int("accumulator_mantissa_bits", self.accumulator_mantissa_bits, 1, ACCUMULATOR_MAX_BITS)
            if self.mode not in KERNEL_MODES:
                raise ValueError(
                    f"SoftmaxConfig.accumulator_mantissa_bits applies to modes {KERNEL_MODES} (FP8 inputs), "
                    f"not mode={self.mode!r} (accepted there: None)"
                )
        _check_choice("accumulator_gemms", self.accumulator_gemms, ACCUMULATOR_GEMMS)
        _check_choice("accumulator_promotion", self.accumulator_promotion, ACCUMULATOR_PROMOTIONS)
        if self.accumulator_promotion != "none" and (
            self.accumulator_mantissa_bits is None or self.accumulator_gemms == "qk"
        ):
            raise ValueError(
                f"SoftmaxConfig.accumulator_promotion={self.accumulator_promotion!r} applies to the emulated P V "
                f"accumulator (accumulator_mantissa_bits set, accumulator_gemms 'qk_pv' or 'pv'), not "
                f"accumulator_mantissa_bits={self.accumulator_mantissa_bits!r} with "
                f"accumulator_gemms={self.accumulator_gemms!r} (accepted there: 'none')"
            )
        _check_choice("row_sum", self.row_sum, ROW_SUMS)
        if self.row_sum != "fadd" and self.mode not in KERNEL_MODES:
            raise ValueError(
                f"SoftmaxConfig.row_sum={self.row_sum!r} applies to modes {KERNEL_MODES}, not mode={self.mode!r} "
                "(accepted there: 'fadd')"
            )
        if self.mode == "rowmax_h15" and self.p_dtype in _FP8_P_DTYPES:
            check_p_range(
                self.mode,
                self.rescale_threshold,
                self.max_offset,
                math.log2(torch.finfo(self.p_dtype).max),
                name="SoftmaxConfig.rescale_threshold",
                where=f"mode 'rowmax_h15' with p_dtype={self.p_dtype}",
            )
        if self.mode == "fused_softmax" and self.tile_n % MX_BLOCK:
            raise ValueError(
                f"SoftmaxConfig.tile_n must be a multiple of {MX_BLOCK} for mode 'fused_softmax' "
                f"(P's MX blocks must not straddle tiles), got {self.tile_n}"
            )
        if self.mode == "fused_softmax" and self.p_dtype is not None:
            raise ValueError(
                "SoftmaxConfig.p_dtype must be None for mode 'fused_softmax' (P takes the MX format "
                f"mx_format selects), got {self.p_dtype!r}"
            )
