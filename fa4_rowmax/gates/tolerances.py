"""How far an FA4 kernel may sit from the semantic reference, per row, derived from the inputs (the home of every
FA4 kernel-vs-reference tolerance; `aiter_fused/tolerances.py` is the Fused-Softmax kernel's).

Note [Kernel vs reference: lattice flips]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The kernel and the reference compute the same function of the same inputs; they differ only in rounding:
the score GEMM sums in another order, and the kernel's one FFMA `y = s * scale_log2 + bias` is a
multiply-then-add in the reference. In exact mode that moves every weight by a factor 2^(+-delta) with delta
the error of y. Rowmax-H15 and -PoT are step functions of y, so an element whose y lies within delta of a
step (H15: y = 0.25 mod 0.5; PoT: y = 0.5 mod 1) may take the neighbouring weight in one and not the other:
a *flip*. Adjacent weights differ by a factor r at most (H15 1.5; PoT 2), so a flip of element j moves the
row sum by at most (r - 1) p_j and the output by at most (r - 1) p_j |v_j - O| / L <= (r - 1) (p_j / L) 2 max|v|.
The approximate weight over the exact one lies in [2^-down, 2^up] (H15 up = log2(1.5) - 0.25, down = 0.25;
PoT 0.5 and 0.5), so p_j / L <= 2^(up + down) pi_j with pi the exact softmax (fp64). Hence, per row,
    |O_kernel - O_ref|_inf <= (r - 1) 2^(up+down) (sum of pi_j over fragile j) 2 max|v|     (flips)
                              + ln2 delta 2 max|v|                                       (smooth drift; exact)
                              + gamma_n max|v| + 2 ulp_out(max|O_ref|)                  (PV sums, rounding)
and |LSE_kernel - LSE_ref| <= (r - 1) 2^(up+down) sum_fragile pi_j + ln2 delta + 4 ulp32(|LSE|).
delta per row is 2 scale_log2 gamma_D max_j sum_i |q_i k_ij| (the GEMM error of the score and of the row
max the anchor sits on) plus 8 fp32 ulps of the largest |y| terms (the FFMA against mul + add), with
gamma_D = D u / (1 - D u), u = 2^-24.

A row whose running max meets `rescale_threshold` within delta (keep the stale max or move it), or, with the
SM90 fold's half-octave anchor, lies within delta of a quarter octave (round the anchor up or down), may take a
different anchor in the two: its weights then sit on two lattices that both approximate the exact softmax, so
its output differs by at most 2 max|v| (2^(up+down) - 1) and its LSE by ln2 (up + down). These rows are
counted (`decision_rows`) so a test can require them to be rare.
The bounds are capped: no row may exceed 2 max|v| (output) or ln2 (up + down) (LSE), whatever its flips.

Note [Kernel vs reference: the exp2 emulation]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
In exact mode a `beta` builds that share of the weights with FA4's `utils.ex2_emulation` instead of MUFU.EX2
(SM90 BF16 through our stage; SM100 FA4's own), and the reference keeps exp2: those weights are off by up to
EX2_EMULATION_REL_ERROR relative (Note [exp2 emulation error]), as if their y moved by EX2_EMULATION_LOG2_ERROR
octaves. Which elements are emulated depends on the thread's column layout, so every element is charged: delta
gains that term in exact's smooth drift of out and the LSE (not in the threshold decisions, which read the scores).
Below 2^-126 the emulation is off by at most 2^-126 absolute per weight, against a row sum >= 1 (the anchor's
element): under 2^-126 L_k relative, not added. Rowmax-H15/PoT need nothing: their ALU and MUFU builders give the
same bits (Note [beta selects instructions]).

Note [Kernel vs reference: P's rounding]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
In exact mode both sides round the weights to P's dtype (BF16/FP16) for P V, and exact's smooth drift (ln2
delta) is far below one step of that rounding: a weight within `weight_error` (log2) of a rounding midpoint may
round to the neighbouring value on one side, a change of one ulp, ulp_j / p_j relative (at most 2^-7 for BF16
normals; `weight_error` includes both sides' fp32 exp2 error, EXP2_FP32_LOG2_ERROR, which delta does not cover at
small scores).
The row sum adds the fp32 weights, so only P V moves: out by at most sum over those j of pi_j (ulp_j / p_j) 2
max|v| (pi the exact softmax; the weights' own drift is second order). The LSE is untouched. `fragile_elements`
counts them. H15 and PoT weights are exact in BF16/FP16 (1 or 1.5 times a power of two): no such term. Without it
a row whose output nearly cancels (O near 0, where the output rounding term vanishes) could exceed the bound by
10x (tests/test_kernel_bounds.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fa4_rowmax.config import FP8_MAX_OFFSET, PV_ACCUMULATIONS, SoftmaxConfig
from fa4_rowmax.reference.attention import p_dtype_for
from fa4_rowmax.reference.mma_accumulator import FP8_MMA_K, exponent_fields, min_normal_exponent

UNIT_ROUNDOFF_FP32 = 2.0**-24
# (step ratio r, log2 up, log2 down) of each lattice mode: Note [Kernel vs reference: lattice flips].
LATTICE = {
    "rowmax_h15": (1.5, math.log2(1.5) - 0.25, 0.25),
    "rowmax_pot": (2.0, 0.5, 0.5),
}
# Where a lattice steps, in y: y = offset (mod period).
STEPS = {"rowmax_h15": (0.5, 0.25), "rowmax_pot": (1.0, 0.5)}


@dataclass
class KernelBounds:
    out: torch.Tensor  # (batch, seqlen_q, heads_q, 1): per-row bound on |out_kernel - out_ref|
    lse: torch.Tensor  # (batch, heads_q, seqlen_q): per-row bound on |lse_kernel - lse_ref|
    fragile_elements: int  # elements within delta of a lattice step (exact: of a rounding midpoint of P's dtype)
    decision_rows: int  # rows whose keep-or-move decision met the threshold within delta


def _gamma(n: int) -> float:
    return n * UNIT_ROUNDOFF_FP32 / (1 - n * UNIT_ROUNDOFF_FP32)


def kernel_bounds(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    config: SoftmaxConfig,
    *,
    causal: bool,
    softmax_scale: float | None = None,
    out_dtype: torch.dtype | None = None,
) -> KernelBounds:
    """Per-row bounds on how far a kernel computing `config` may be from `attention_reference(..., config)`.

    Dense FA4 layout: q (B, Lq, Hq, D), k/v (B, Lk, Hk, D), causal bottom-right. `out_dtype` is the output's
    dtype (default q's), whose rounding both sides pay. Only the FA4 modes (exact, rowmax_h15, rowmax_pot)
    with the tile anchor; other modes raise ValueError."""
    if config.mode not in ("exact", *LATTICE) or config.anchor != "tile":
        raise ValueError(
            f"kernel_bounds covers modes exact/rowmax_h15/rowmax_pot with anchor='tile'; got "
            f"{config.mode!r}, {config.anchor!r}"
        )
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    group = heads_q // heads_k
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    scale_log2 = scale * math.log2(math.e)
    qf = q.double().transpose(1, 2)  # (B, Hq, Lq, D)
    kf = k.double().transpose(1, 2).repeat_interleave(group, dim=1)
    vf = v.double().transpose(1, 2).repeat_interleave(group, dim=1)
    x = (qf @ kf.transpose(-1, -2)) * scale_log2  # (B, Hq, Lq, Lk), log2 units
    abs_dot = qf.abs() @ kf.abs().transpose(-1, -2)
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)
    if causal:
        visible = torch.tril(visible, diagonal=seqlen_k - seqlen_q)
    x = x.masked_fill(~visible, -math.inf)
    has_key = visible.any(-1)  # (Lq,)

    # The anchor of each key's tile: the running max FA4 keeps, tiles in descending order.
    tile_n = config.tile_n
    n_tiles = -(-seqlen_k // tile_n)
    anchor = torch.full_like(x, -math.inf)
    running = torch.full(x.shape[:-1], -math.inf, dtype=x.dtype, device=x.device)
    decision_gap = torch.full_like(running, math.inf)
    for t in range(n_tiles - 1, -1, -1):
        cols = slice(t * tile_n, min((t + 1) * tile_n, seqlen_k))
        tile_max = x[..., cols].amax(-1)
        candidate = torch.maximum(running, tile_max)
        step = running - candidate  # <= 0: log2 factor of the O rescale
        if config.rescale_threshold > 0:
            keep = step >= -config.rescale_threshold
            seen = torch.isfinite(running) & torch.isfinite(candidate)
            decision_gap = torch.where(
                seen, torch.minimum(decision_gap, (step + config.rescale_threshold).abs()), decision_gap
            )
            running = torch.where(keep & torch.isfinite(running), running, candidate)
        else:
            running = candidate
        if config.anchor_rounding == "half_octave":
            # The SM90 fold anchors on the half octave nearest the max: a max within delta of a quarter
            # octave may round the other way (a decision, like the threshold's).
            twice = running * 2 - 0.5
            gap = (twice - torch.round(twice)).abs() / 2
            decision_gap = torch.where(torch.isfinite(running), torch.minimum(decision_gap, gap), decision_gap)
            anchor[..., cols] = (torch.round(running * 2) / 2)[..., None]
        else:
            anchor[..., cols] = running[..., None]

    y = x - anchor + config.max_offset
    finite_anchor = torch.isfinite(anchor)
    magnitude = (x.abs() + anchor.abs()).where(finite_anchor & torch.isfinite(x), 0.0).amax(-1)
    delta = (
        2 * scale_log2 * _gamma(head_dim) * abs_dot.where(visible, 0.0).amax(-1) + 8 * UNIT_ROUNDOFF_FP32 * magnitude
    )  # (B, Hq, Lq)

    pi = torch.softmax(x * math.log(2.0), dim=-1).nan_to_num(0.0)  # exact, fp64; 0 on rows with no key
    v_max = vf.abs().amax(dim=(-1, -2))[..., None]  # (B, Hq, 1)
    o_ref = pi @ vf
    out_ulp = torch.finfo(out_dtype or q.dtype).eps if (out_dtype or q.dtype).is_floating_point else 0.0
    rounding = _gamma(seqlen_k) * v_max + 2 * out_ulp * o_ref.abs().amax(-1)

    if config.mode == "exact":
        # Note [Kernel vs reference: the exp2 emulation]: the emulated weights, as a move of y (beta None is FA4's
        # stock tuning, which emulates a share on SM100: charged too).
        emulated = config.beta is None or config.beta > 0
        weight_error = delta + EXP2_FP32_LOG2_ERROR + (EX2_EMULATION_LOG2_ERROR if emulated else 0.0)
        # Note [Kernel vs reference: P's rounding]: a weight within weight_error of a rounding midpoint of P's dtype.
        p = torch.exp2(y.where(torch.isfinite(y), -math.inf))
        distance, ulp_share = rounding_midpoint_distance(p, p_dtype_for(config, q.dtype))
        fragile = (distance <= weight_error[..., None]) & torch.isfinite(y)
        p_flips = (pi * ulp_share * fragile).sum(-1)
        out_bound = (math.log(2.0) * weight_error + p_flips) * 2 * v_max + rounding
        lse_bound = math.log(2.0) * weight_error
        fragile_count = int(fragile.sum())
        envelope = 0.0
    else:
        ratio, up, down = LATTICE[config.mode]
        period, offset = STEPS[config.mode]
        distance = ((y - offset) / period - torch.round((y - offset) / period)).abs() * period
        fragile = (distance < delta[..., None]) & torch.isfinite(y)
        fragile_mass = (pi * fragile).sum(-1)
        envelope = up + down
        out_bound = (ratio - 1) * 2**envelope * fragile_mass * 2 * v_max + math.log(2.0) * delta * 2 * v_max + rounding
        lse_bound = (ratio - 1) * 2**envelope * fragile_mass + math.log(2.0) * delta
        fragile_count = int(fragile.sum())
    lse_ref = torch.logsumexp(x * math.log(2.0), dim=-1)
    lse_bound = lse_bound + 4 * UNIT_ROUNDOFF_FP32 * lse_ref.abs().nan_to_num(0.0, posinf=0.0, neginf=0.0)

    decision = decision_gap < delta
    if config.mode != "exact" or config.rescale_threshold > 0 or config.anchor_rounding != "exact":
        cap_out = 2 * v_max * (2 ** max(envelope, 0.0) - 1 if envelope else 1.0)
        out_bound = torch.where(decision, torch.maximum(out_bound, cap_out), out_bound)
        lse_bound = torch.where(
            decision, torch.maximum(lse_bound, torch.full_like(lse_bound, math.log(2.0) * envelope)), lse_bound
        )
    out_bound = torch.minimum(out_bound, 2 * v_max)
    if envelope:
        lse_bound = torch.minimum(lse_bound, torch.full_like(lse_bound, math.log(2.0) * envelope))
    out_bound = out_bound.where(has_key, 0.0)
    lse_bound = lse_bound.where(has_key, 0.0)
    return KernelBounds(
        out=out_bound.transpose(1, 2)[..., None].float(),
        lse=lse_bound.float(),
        fragile_elements=fragile_count,
        decision_rows=int(decision.sum()),
    )


def assert_within_bounds(
    out: torch.Tensor, lse: torch.Tensor, ref_out: torch.Tensor, ref_lse: torch.Tensor, bounds: KernelBounds
) -> None:
    """The kernel's output and LSE within `bounds` of the reference's in every row; rows with no key give -inf
    LSE in both; nothing NaN where the reference is finite."""
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "rows with no key differ"
    assert not torch.isnan(lse[finite]).any() and torch.isfinite(out[torch.isfinite(ref_out)]).all()
    lse_err = (lse[finite].float() - ref_lse[finite].float()).abs()
    worst = int(torch.argmax(lse_err - bounds.lse.to(lse.device)[finite])) if lse_err.numel() else 0
    assert (lse_err <= bounds.lse.to(lse.device)[finite]).all(), (
        f"LSE off by {float(lse_err[worst]):.3g} where the bound is "
        f"{float(bounds.lse.to(lse.device)[finite][worst]):.3g}"
    )
    out_err = (out.float() - ref_out.float()).abs().amax(-1, keepdim=True)
    excess = out_err - bounds.out.to(out.device)
    assert (excess <= 0).all(), (
        f"output off by up to {float(out_err.max()):.3g}; the worst row exceeds its bound by {float(excess.max()):.3g}"
    )


# Note [FP8 kernel vs reference bounds]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# As Note [Kernel vs reference: lattice flips] above, with FP8's own roundings:
# - The score GEMM: Hopper's FP8 accumulation (Note [Hopper FP8 accumulation] below) leaves score s_j off by at
#   most eps_j (`fp8_score_error_bound`, score units; err_j = scale_log2 eps_j + 8 ulp32(|y|), the FFMA against
#   mul + add, in log2 units). The reference's scores are the exact sums (Note [FP8 inputs and descales],
#   reference/attention.py). The kernel's running max at a tile is the score of some key seen so far that can
#   reach the exact max m minus the error of the key holding it (s_i + eps_i >= m - eps_top): it is off by at
#   most the largest err among those keys, a_j for the keys of that tile (`anchor_err`). y_j = (s_j - m)
#   scale_log2 + max_offset is off by at most delta_j = err_j + a_j.
# - A weight is a step function of y: rowmax_h15 steps at y = 0.25 mod 0.5 (ratio 1.5), and the e4m3 rounding
#   of exact's exp2(y) steps at the midpoints between e4m3 values (ratio 1 + 2^-3 for normals). An element
#   within delta of a step (`fragile`) may round the other way: out moves by at most (r - 1) 2^env pi_j 2 max|v|,
#   the LSE by (r - 1) 2^env pi_j (pi the exact fp64 softmax, env = log2 of the weight's envelope: H15
#   log2(1.5), exact 2^-4 for the e4m3 rounding).
# - Between steps: exact's row sum adds 2^(scores) (its anchors cancel), so L'/L and L/L' are at most
#   S = sum_j pi_j 2^err_j, while P V's e4m3 weights (at most (1 + 2^-4) pi_j L + 2^-10, against L >= 2^8) move
#   with their tile's anchor, 2^(+-a_j): out moves by at most sum_j ((1 + 2^-4) pi_j + 2^-18) (2^a_j S - 1) max|v|.
#   H15's row sum adds the very P of P V, both moving with the tile's anchor: sum |pi' - pi| <= 2 (2^a - 1) 2^a,
#   a = max_j a_j, times max|v|.
# - The LSE: exact's is log sum_j 2^(scores), off by at most log S. H15's weights are constant between steps, so
#   its LSE carries its anchors whole: ln2 (a + 8 ulp32(|y|)), besides the flips. H15's FADD row sum carries
#   2^-120 (Note [H15 e4m3 bytes by integer ops]), so its finalize adds log2(sum) ~ -112 to the anchor in fp32: one
#   more rounding, 2^-24 (|anchor| + 112).
# - Hopper's FP8 wgmma sums P V (and with row_sum="mma" the row sum itself) by the same rule: per k-block each
#   of the 33 terms loses less than 2^-13 of the largest magnitude among them and the result less than 2^-13 of
#   itself, all at most the row's final sum. So a sum over L_k keys is off by at most A = ceil(L_k / 32) 34 2^-13
#   of the row sum (a worst case; measured errors are far smaller): out moves by A max|v|, and with the MMA row
#   sum also the normaliser, by A (out: A max|v|, LSE: A). The MMA row sum adds the e4m3 P where the reference
#   adds the fp32 weights (exact mode): up to 2^-4 more, relative. Both sides round out to BF16. That is
#   single-level accumulation (`pv_accumulation="single"`, O the wgmma's accumulator input on every tile); the
#   two-level kernel's term is per tile instead (Note [Two-level P V accumulation bound] below).
# - beta (exact): the emulated exponentials (Note [exp2 emulation error] below) are off by up to
#   EX2_EMULATION_REL_ERROR relative, as if y moved by EX2_EMULATION_LOG2_ERROR = -log2(1 - 8.8e-5) = 1.27e-4
#   octaves. err_j gains that term, for every element of the row (which elements the emulation takes depends on
#   the thread's column layout; not modelled), and with it the fragile set (e4m3 roundings that may flip), exact's
#   smooth drift of out and the LSE (the FADD row sum adds the emulated fp32 weights). It is added rather than
#   charged to the score GEMM's term of delta (far larger at the GPU tests' N(0, 1) shapes): that term bounds
#   another rounding and shrinks with the scores (tests/test_kernel_bounds.py's case that needs the emulation
#   term). Below 2^-126 the emulation is off by 2^-126 absolute per weight, against a row sum >= 2^8 (the running
#   max's element carries 2^max_offset): under 2^-134 L_k relative, not added.
# - rowmax_h15's byte-4 rule (Note [H15 e4m3 bytes by integer ops], stage/softmax_sm90_fp8.py): for y in
#   [-6.75, -6.25) the H15 weight is 1.5 * 2^-7, below e4m3's normals; the kernel writes byte 4 (2^-7) and adds
#   it to the row sum, where the reference flushes it to 0. Per element that is 2^-7 <= 2^-0.25 2^y of extra
#   weight, against an H15 row sum >= 2^-0.25 of the exact one, so the row sum moves by at most the exact
#   softmax mass `band` of those elements (LSE: band; out: band 2 max|v|). The term is 0 on the row of Note
#   [Hopper FP8 accumulation]'s case.
#
# Note [Hopper FP8 accumulation]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# The rule (MMA-Sim's bit-accurate Hopper model, github.com/microsoft/MMA-Sim, `nv_fused_dot_add` with 13
# fraction bits and an e8m13 output; DeepSeek-V3 report 3.3.2: "about 14 bits"): one e4m3 wgmma (k = 32, so
# head_dim / 32 of them per score) writes each product a_i b_i = s_a s_b 2^(e_a + e_b) (the inputs' exponent
# fields, subnormals at -6) and the accumulator c = s_c 2^e_c, aligns all 33 to the largest exponent E among them
# and truncates each to 13 fraction bits there (units g = 2^(E - 13)), adds them exactly, and truncates the sum
# to 13 fraction bits of its own leading bit. Hence, with P_b the exact partial sum after k-block b:
# - s_a s_b has 6 fraction bits, so a product with e_a + e_b >= E - 7 is exact; a smaller one loses less than
#   min(|a_i b_i|, g). c (13 fraction bits at e_c) loses less than min(|c|, g) (nothing when e_c = E); the block's
#   result less than 2^-13 of itself. 2^E <= max(|c|, max_i 2^(e_a + e_b)) and |c| <= |P_{b-1}| + eps_{b-1}.
# - eps_j = sum over blocks of [sum of min(|p|, g) over the products that can be cut + min(|c|, g) + 2^-13
#   (|P_b| + eps_b)], with g and the cut from the upper bound of E (`fp8_score_error_bound`; each loss capped at
#   the magnitude of its term). Truncation is toward zero, every loss against its term's sign: a large score
#   (mostly same-sign products, the accumulator near the score itself, so a coarse g) loses many units of g
#   in one direction, far more than the 2^-13 sum_i |q_i k_ij| of a 14-bit rounding (2.6 times that on some
#   elements of the case below, whose largest errors use about half eps_j).
#   The rule runs as the reference's emulated accumulator (SoftmaxConfig.accumulator_mantissa_bits = 13, Note
#   [Emulated FP8 MMA accumulator], reference/mma_accumulator.py): tests/test_kernel_bounds.py checks eps and
#   these bounds against it.
# - The case: test_descales_match_reference[14-rowmax_h15] (GQA 7 with descales) on the H200 leaves a bound built on
#   the 14-bit-rounding delta on one row by 9.26e-5 (docs/ledger/fp8_sm90.md). The CPU replay
#   (studies/fp8_qk_truncation/replay.py: the test's inputs from torch's CUDA Philox stream, the scores by this
#   rule, a model of the H15 kernel's softmax and finalize) finds exactly that row (batch 1, q head 11, row 34: 35
#   keys, max score 30.51, scale_log2 x descales 0.0637), and no exact-mode row (the H200 passed exact). The row
#   max's score loses 0.0263 (1.09 times the 14-bit-rounding delta), which H15's LSE carries whole; exact's LSE
#   averages the errors over the row's softmax.
FP8_ACCUMULATOR_BITS = 14  # Hopper's FP8 wgmma keeps 14 significant bits (13 fraction bits), truncated

# Note [Two-level P V accumulation bound]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
# With `pv_accumulation="two_level"` (Note [Two-level P V accumulation], reference/mma_accumulator.py) each KV
# tile's P V starts from a fresh accumulator and is promoted into the fp32 O by O = fma(O, c_t, acc_t). Per output
# element d, with U_t = sum over the tile's keys of p_j |v_jd| (p the kernel's e4m3 weights in its scale there):
# - The tile's sum runs nb = ceil(n_t / 32) k-blocks (n_t <= tile_n keys). In each, every term (the 32 products,
#   and c from the second block on, a partial sum of the tile) is at most U_t in magnitude (every truncation is
#   toward zero, so no computed partial sum exceeds the sum of its terms' magnitudes), so the alignment grid is at
#   most 2^-13 U_t: the products lose less than 32 grid units, c less than one, the block's result less than 2^-13
#   of itself: |acc_t - exact| <= A_t U_t with A_t = nb 34 2^-13 (Note [Hopper FP8 accumulation]'s count, per
#   tile instead of per row).
# - The promotion rounds once (to nearest), by at most 2^-24 of the new O, <= (1 + T 2^-24) times the sum of
#   p |v_d| so far; the first adds to O = 0 and is exact. The factors c_t <= 1 only shrink what came before, so
#   over the T = ceil(L_k / tile_n) tiles, in the final scale, the tile errors sum to at most A_t U and the
#   promotions to (T - 1) 2^-24 (1 + T 2^-24) U, U = sum_j p_j |v_jd| over the row: `fp8_pv_sum_error(L_k,
#   "two_level", tile_n)` of U, independent of L_k but for the promotions (A_t = 0.0166 at tile_n 128, 0.0291
#   at 224). Single-level's count is that of one "tile" of L_k keys (capped at 1), at least two-level's for every
#   L_k, and is charged against L max|v| (the bound above).
# - The reference's own fp32 P V (its rescale multiply and add, 2 roundings per tile, and its fp32 matmul over a
#   tile, gamma_(n_t)) adds (2 T 2^-24 + gamma_(tile_n)) U. Single-level's A grows by 34 2^-13 per k-block and
#   dwarfs that term, so the single-level bound leaves it out.
# - out = acc / L moves by the above times U / L = sum_j w_j |v_jd| with w_j >= p_j / L per key
#   (`_two_level_weight_bound`): exact, FADD row sum of the fp32 weights: ((1 + 2^-4) pi_j (+ 2^-18 2^delta_max
#   where the weight can be an e4m3 subnormal, y_j + delta_j < -6)) 2^a_j S, as in the smooth drift above; H15, whose
#   row sum adds the very P: pi_j 2^(log2(1.5) + delta_j + delta_max) / (1 - the mass that may be flushed). With the
#   MMA row sum (a ones column of the same GEMM, promoted the same way) L is off by r = `fp8_pv_sum_error` toward
#   zero, so w_j gains 1 / (1 - r), and exact's ones column adds the e4m3 P where the reference adds the fp32
#   weights (1 / (1 - 2^-4 - the subnormals' rounding) more in w; up to 2^-4 in L): out moves by at most
#   r' / (1 - r') max|v| and the LSE by -log(1 - r) (-log(1 - 2^-4) more in exact), r' = r (+ 2^-4 in exact).
# - The rescale factors: the kernel's c_t (MUFU ex2 of its FFMA'd max difference) and the reference's (fp32
#   exp2 of its own) differ by up to e = EXP2_FP32_LOG2_ERROR + 8 ulp32(|y| terms) octaves each, and O and the row
#   sum take the same c_t, so the tiles are reweighted by at most 2^(T e) each way: out moves by (2^(2 T e) - 1)
#   max|v| (under 1e-3 max|v| at 128K keys), the LSE by ln2 T e. (Both schemes have this; the single-level bound
#   does not charge it: its out term is orders larger, and its LSE share is below 1e-3 nats at 128K keys.)
# So on diffuse rows over V of mean 1 (O ~ 1, U / L ~ E|v| = 1.2) the two-level P V term is about 0.02 at any
# length, where single-level's is capped at max|v|.

# Note [exp2 emulation error]
# ~~~~~~~~~~~~~~~~~~~~~~~~~~~
# FA4's `utils.ex2_emulation(y)` (the beta share of the exact modes; Note [beta on the FP8 exact twin],
# stage/softmax_sm90_fp8.py) returns 2^floor(y) * p(f): f = y - floor(y) in [0, 1), exact in fp32 except for
# -1 < y < 0 where fl(1 + y) rounds f by up to 2^-24 (a factor 2^(2^-24), 4.2e-8); p is POLY_EX2's degree 3
# (fp32 coefficients) by three FMA; floor(y) enters the exponent bits by an integer add (exact while 2^y is a
# normal). Relative to 2^f: the polynomial's own error max |p(f) / 2^f - 1| = 8.763e-5 (fp64 on a 2^20-point grid
# of [0, 1], plus spacing x max |d/df| = 2.3e-3 x 2^-20: 2e-9), the FMA roundings u (|t0| + f |t1| + f^2 |t2|) / 2^f
# <= 9.9e-8 (t_i the Horner partial results, u = 2^-24), the fraction's 4.2e-8: 8.78e-5 in all, 8.8e-5 rounded up.
# tests/test_kernel_bounds.py recomputes it from FA4's coefficients and checks an fp32 model of the emulation.
EX2_EMULATION_REL_ERROR = 8.8e-5
EX2_EMULATION_LOG2_ERROR = -math.log2(1.0 - EX2_EMULATION_REL_ERROR)
# Note [Kernel vs reference: P's rounding]: the MUFU's `ex2.approx.f32` is within a few fp32 ulps of 2^y (the PTX
# ISA gives no bits; Note [PTX interpreter] in testing/ptx_interp.py), charged as 4 ulps (2^-21), and the reference's
# fp32 exp2 within 1 ulp: 5 ulps relative, in log2 units.
EXP2_FP32_LOG2_ERROR = -math.log2(1.0 - 5 * 2.0**-23)


_NO_EXPONENT = -(2**20)  # the exponent of 0: below every other, 2^it is 0


def rounding_midpoint_distance(p: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """For weights p >= 0 (fp64) rounded to `dtype`: the distance from each to the nearest rounding midpoint of
    `dtype`, in log2 units of y = log2 p, and ulp / p (the relative size of one rounding step there). Subnormals
    of `dtype` keep the smallest normal's ulp; p = 0 is infinitely far."""
    finfo = torch.finfo(dtype)
    mantissa_bits = round(-math.log2(finfo.eps))
    exponent = torch.floor(torch.log2(p.clamp(min=finfo.tiny)))
    ulp = torch.exp2(exponent - mantissa_bits)
    below = (torch.floor(p / ulp - 0.5) + 0.5) * ulp  # the grid's midpoints on either side of p
    # Past the binade's top the next midpoint is the upper binade's, half its ulp (= ulp) above 2^(e+1); just
    # below 2^e it is the lower binade's, ulp / 4 below (the smallest normal binade shares its ulp with the
    # subnormals under it, so its own grid holds there).
    top = torch.exp2(exponent + 1)
    above = torch.where(below + ulp > top, top + ulp, below + ulp)
    edge = torch.where(exponent > math.log2(finfo.tiny), torch.exp2(exponent) - ulp / 4, -1.0)
    log2_p = torch.log2(p)
    distance = torch.full_like(p, math.inf)
    for midpoint in (below, above, edge):
        distance = torch.minimum(distance, torch.where(midpoint > 0, (log2_p - torch.log2(midpoint)).abs(), math.inf))
    distance = torch.where(p > 0, distance, math.inf)
    return distance, torch.where(p > 0, ulp / p.clamp(min=2.0**-1000), 0.0)


def _exponent(x: torch.Tensor) -> torch.Tensor:
    """floor(log2 x) for x > 0, _NO_EXPONENT for 0 (int64)."""
    _, e = torch.frexp(x)
    return torch.where(x > 0, e.long() - 1, _NO_EXPONENT)


def _score_blocks(q64: torch.Tensor, k64: torch.Tensor):
    """(k-block slice, row slices) for the per-product work of the bound: rows chunked to ~2^24 products."""
    rows = max(1, 2**24 // max(1, k64.shape[-2] * FP8_MMA_K * math.prod(q64.shape[:-2])))
    blocks = [slice(k0, k0 + FP8_MMA_K) for k0 in range(0, q64.shape[-1], FP8_MMA_K)]
    return blocks, [slice(r, r + rows) for r in range(0, q64.shape[-2], rows)]


def fp8_score_error_bound(q64: torch.Tensor, k64: torch.Tensor, dtype: torch.dtype = torch.float8_e4m3fn):
    """eps (..., Lq, Lk): a bound on |Hopper's FP8 q k^T - the exact one| per score (Note [Hopper FP8 accumulation]).

    q64 (..., Lq, D), k64 (..., Lk, D): fp64 holding `dtype` values."""
    bits = FP8_ACCUMULATOR_BITS - 1
    exact_span = bits - 2 * round(-math.log2(torch.finfo(dtype).eps))  # products within it of E are exact
    eq, ek = (exponent_fields(t, min_normal_exponent(dtype)).long() for t in (q64, k64))
    eps = q64.new_zeros(q64.shape[:-1] + (k64.shape[-2],))
    partial = torch.zeros_like(eps)
    blocks, row_chunks = _score_blocks(q64, k64)
    for b, cols in enumerate(blocks):
        carry = partial.abs() + eps  # |c| of this block's accumulator input
        loss = torch.empty_like(eps)
        for rows in row_chunks:
            p = (q64[..., rows, None, cols] * k64[..., None, :, cols]).abs()
            e_p = torch.where(p > 0, eq[..., rows, None, cols] + ek[..., None, :, cols], _NO_EXPONENT)
            e_top = torch.maximum(e_p.amax(-1), _exponent(carry[..., rows, :]))  # >= E
            grid = torch.exp2((e_top - bits).double())
            cut = e_p < (e_top - exact_span)[..., None]
            loss[..., rows, :] = torch.minimum(p, grid[..., None]).where(cut, 0.0).sum(-1)
            loss[..., rows, :] += torch.minimum(carry[..., rows, :], grid) if b else 0.0
        partial = partial + q64[..., cols] @ k64[..., cols].transpose(-1, -2)
        eps = eps + loss
        eps = eps + 2.0**-bits * (partial.abs() + eps)  # the block's result, to 13 fraction bits
    return eps


def _check_pv_accumulation(pv_accumulation) -> None:
    if pv_accumulation not in PV_ACCUMULATIONS:
        raise ValueError(f"pv_accumulation must be one of {PV_ACCUMULATIONS}, got {pv_accumulation!r}")


def fp8_pv_sum_error(keys: int, pv_accumulation: str, tile_n: int) -> float:
    """A bound on how far Hopper's FP8 wgmma sum of p_j v_j over `keys` keys (p_j >= 0, each tile's sum promoted
    into fp32 under `pv_accumulation="two_level"`) may be from the exact one, relative to sum_j p_j max|v|
    (Note [FP8 kernel vs reference bounds], Note [Two-level P V accumulation bound]). `tile_n` is the kernel's KV
    tile; single-level does not depend on it."""
    _check_pv_accumulation(pv_accumulation)
    grid = 34 * 2.0 ** (1 - FP8_ACCUMULATOR_BITS)  # per k-block: 32 products, c and the result, 2^-13 each
    if pv_accumulation == "single":
        return min(1.0, -(-keys // FP8_MMA_K) * grid)
    per_tile = -(-min(tile_n, keys) // FP8_MMA_K) * grid
    promotions = (-(-keys // tile_n) - 1) * UNIT_ROUNDOFF_FP32  # the first adds to O = 0: exact
    return min(1.0, per_tile + promotions * (1 + promotions))


def _two_level_weight_bound(mode, pi, y, delta, anchor_drift, err, finite, row_sum_by_mma):
    """Per key, an upper bound on the kernel's e4m3 weight over its row sum (Note [Two-level P V accumulation
    bound]); pi the exact softmax, y the reference's log2 weights in their tile's scale, delta their errors."""
    delta_max = delta.amax(-1, keepdim=True)
    if mode == "exact":
        # e4m3 P <= (1 + 2^-4) p for normals, p + 2^-10 below 2^-6, against an fp32 row sum >= 2^(8 - delta)
        subnormal = finite & (y + delta < -6)
        sum_drift = (pi * torch.exp2(err.where(finite, 0.0))).sum(-1, keepdim=True)
        extra = torch.where(subnormal, 2.0**-18 * torch.exp2(delta_max), 0.0)
        weight = ((1 + 2.0**-4) * pi + extra) * torch.exp2(anchor_drift) * sum_drift
        if row_sum_by_mma:  # the ones column adds the e4m3 P: its sum >= (1 - 2^-4) L minus the subnormals' rounding
            weight = weight / (1 - 2.0**-4 - subnormal.sum(-1, keepdim=True) * 2.0**-18 * torch.exp2(delta_max))
        return weight
    # rowmax_h15: H(y) / 2^y in [2^-0.25, 2^0.335] and y off by delta; flushed weights (y < -6.25) leave the sum
    flushed = (pi * (finite & (y - delta < -6.25))).sum(-1, keepdim=True)
    return pi * torch.exp2(math.log2(1.5) + delta + delta_max) / (1 - flushed)


def fp8_kernel_bounds(
    q,
    k,
    v,
    config: SoftmaxConfig,
    causal: bool,
    descales=None,
    row_sum_by_mma=False,
    *,
    pv_accumulation: str = "single",
):
    """Per-row bounds (out: (B, Lq, Hq, 1), lse: (B, Hq, Lq)) of the SM90 FP8 forward against
    `attention_reference` with FP8 inputs (Note [FP8 kernel vs reference bounds]). `pv_accumulation` is the
    kernel's ("single": O the P V wgmma's accumulator input; "two_level": a fresh accumulator per KV tile of
    `config.tile_n` keys, promoted in fp32, Note [Two-level P V accumulation bound])."""
    _check_pv_accumulation(pv_accumulation)
    if q.dtype != torch.float8_e4m3fn:  # the steps below are e4m3's (ratio 1 + 2^-3); the SM90 FP8 path is e4m3-only
        raise ValueError(f"fp8_kernel_bounds derives e4m3's rounding steps; q.dtype must be float8_e4m3fn: {q.dtype}")
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_k = k.shape[1], k.shape[2]
    group = heads_q // heads_k
    scale_log2 = head_dim**-0.5 * math.log2(math.e)
    qf = q.double().transpose(1, 2)
    kf = k.double().transpose(1, 2).repeat_interleave(group, dim=1)
    vf = v.double().transpose(1, 2).repeat_interleave(group, dim=1)
    qk_scale = torch.ones(batch, heads_q, 1, 1, dtype=torch.float64, device=q.device)
    v_scale = torch.ones_like(qk_scale)
    if descales is not None:
        dq, dk, dv = (d.double().repeat_interleave(group, dim=1)[..., None, None] for d in descales)
        qk_scale, v_scale = dq * dk, dv
    x = (qf @ kf.transpose(-1, -2)) * scale_log2 * qk_scale
    visible = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device)
    if causal:
        visible = torch.tril(visible, diagonal=seqlen_k - seqlen_q)
    x = x.masked_fill(~visible, -math.inf)
    # Note [Hopper FP8 accumulation]: each score's error, in log2 units
    err = (fp8_score_error_bound(qf, kf, q.dtype) * scale_log2 * qk_scale).where(visible, 0.0)
    has_key = visible.any(-1)
    tile_n = config.tile_n
    anchor = torch.full_like(x, -math.inf)
    anchor_err = torch.zeros_like(x)  # per key: how far the kernel's running max of its tile may be off (log2)
    running = torch.full(x.shape[:-1], -math.inf, dtype=x.dtype, device=x.device)
    for t in range(-(-seqlen_k // tile_n) - 1, -1, -1):
        cols = slice(t * tile_n, min((t + 1) * tile_n, seqlen_k))
        running = torch.maximum(running, x[..., cols].amax(-1))
        rounded = torch.round(running * 2) / 2 if config.anchor_rounding == "half_octave" else running
        anchor[..., cols] = rounded[..., None]
        # The kernel's running max is the score of a key seen so far that may reach the exact max minus the error
        # of the key holding it: off by at most the largest error among those keys.
        seen, seen_err = x[..., t * tile_n :], err[..., t * tile_n :]
        top_err = seen_err.gather(-1, seen.argmax(-1, keepdim=True))
        candidate = seen + seen_err >= running[..., None] - top_err
        anchor_err[..., cols] = seen_err.where(candidate, 0.0).amax(-1)[..., None]
    y = x - anchor + FP8_MAX_OFFSET
    finite = torch.isfinite(y)
    magnitude = (x.abs() + anchor.abs()).where(finite, 0.0).amax(-1)
    rounding = 8 * 2.0**-24 * magnitude
    if config.mode == "exact":
        rounding = rounding + EXP2_FP32_LOG2_ERROR  # MUFU ex2.approx and the reference's exp2
    if config.mode == "exact" and config.beta:  # the SM90 FP8 host maps beta 0 to None: no emulated share either way
        rounding = rounding + EX2_EMULATION_LOG2_ERROR  # the emulated share (beta)
    err = err + rounding[..., None]
    delta = (err + anchor_err).where(finite, 0.0)  # y = (s - m) scale_log2: the errors of s and of the running max
    if config.mode == "rowmax_h15":
        ratio, envelope = 1.5, math.log2(1.5)
        distance = ((y - 0.25) / 0.5 - torch.round((y - 0.25) / 0.5)).abs() * 0.5
        # The flush: H15's normal range ends at y = -6.25 (n = -12.5 between bytes 8 and 4).
        distance = torch.minimum(distance, (y + 6.25).abs())
    else:
        ratio, envelope = 1.0 + 2.0**-3, 2.0**-4
        distance, _ = rounding_midpoint_distance(torch.exp2(y.where(finite, -math.inf)), p_dtype_for(config, q.dtype))
    fragile = (distance <= delta) & finite
    pi = torch.softmax(x * math.log(2.0), dim=-1).nan_to_num(0.0)
    fragile_mass = (pi * fragile).sum(-1)
    v_max = (vf.abs() * v_scale).amax(dim=(-1, -2))[..., None]
    o_ref = pi @ (vf * v_scale)
    accumulation = fp8_pv_sum_error(seqlen_k, pv_accumulation, tile_n)
    e4m3_sum = 2.0**-4 if config.mode == "exact" else 0.0  # exact's MMA row sum adds e4m3 P, the reference fp32
    mma_sum = accumulation + e4m3_sum if row_sum_by_mma else 0.0
    flips = (ratio - 1) * 2**envelope * fragile_mass
    if config.mode == "rowmax_h15":
        # the byte-4 band (Note [FP8 kernel vs reference bounds]): the kernel's 2^-7 where the reference has 0
        flips = flips + (pi * (finite & (y >= -6.75) & (y < -6.25))).sum(-1)
    # Between steps (Note [FP8 kernel vs reference bounds]), as |dO| <= smooth 2 max|v|.
    anchor_drift = anchor_err.where(finite, 0.0)
    if config.mode == "exact":
        # P V's weights move with their tile's anchor, the row sum's with the scores (its anchors cancel)
        sum_drift = (pi * torch.exp2(err.where(finite, 0.0))).sum(-1, keepdim=True)  # >= L' / L and >= L / L'
        share = ((1 + 2.0**-4) * pi + 2.0**-18).where(finite, 0.0)  # e4m3 P / the row sum, per key
        smooth = (share * (torch.exp2(anchor_drift) * sum_drift - 1)).sum(-1) / 2
    else:
        # the row sum adds the very P of P V: both move with the tile's anchor
        worst = anchor_drift.amax(-1)
        smooth = torch.exp2(worst) * torch.expm1(worst * math.log(2.0))
    out_bound = (flips + smooth) * 2 * v_max + 2 * 2.0**-8 * o_ref.abs().amax(-1)
    if pv_accumulation == "single":
        out_bound = out_bound + accumulation * v_max + mma_sum * v_max
    else:  # Note [Two-level P V accumulation bound]
        tiles = -(-seqlen_k // tile_n)
        reference_pv = 2 * tiles * UNIT_ROUNDOFF_FP32 + _gamma(min(tile_n, seqlen_k))
        weight = _two_level_weight_bound(config.mode, pi, y, delta, anchor_drift, err, finite, row_sum_by_mma)
        pv_abs = (weight @ (vf.abs() * v_scale)).amax(-1)  # the sum the accumulator truncates, per output element
        if row_sum_by_mma:  # the MMA row sum is short by up to `accumulation` of itself (vacuous at 1: capped below)
            pv_abs = pv_abs / (1 - accumulation) if accumulation < 1 else torch.full_like(pv_abs, math.inf)
        rescale_log2 = tiles * (EXP2_FP32_LOG2_ERROR + 8 * 2.0**-24 * magnitude)
        rescale_drift = torch.expm1(2 * rescale_log2 * math.log(2.0))
        out_bound = out_bound + (accumulation + reference_pv) * pv_abs + rescale_drift * v_max
        out_bound = out_bound + (mma_sum / (1 - mma_sum) if mma_sum < 1 else math.inf) * v_max
    # The LSE: exact's is log sum 2^(scores), off by at most log sum pi 2^err; H15's carries its anchors whole (its
    # weights are constant between steps): the largest anchor error, and the flips. H15's FADD row sum carries
    # 2^-120, so its finalize rounds anchor - 112 in fp32.
    if config.mode == "exact":
        lse_bound = flips + torch.log((pi * torch.exp2(err.where(finite, 0.0))).sum(-1).clamp(min=1.0))
    else:
        lse_bound = flips + math.log(2.0) * (anchor_err.where(finite, 0.0).amax(-1) + rounding)
    if not row_sum_by_mma:
        lse_bound = lse_bound + 2.0**-20
    elif pv_accumulation == "single":
        lse_bound = lse_bound + math.log1p(mma_sum)
    else:  # the ones column loses toward zero, by up to `accumulation` of itself
        lse_bound = lse_bound + (-math.log1p(-accumulation) if accumulation < 1 else math.inf) - math.log1p(-e4m3_sum)
    if pv_accumulation == "two_level":  # the rescale factors reweight the row sum's tiles too
        lse_bound = lse_bound + math.log(2.0) * rescale_log2
    if config.mode == "rowmax_h15" and not row_sum_by_mma:
        anchor_log2 = anchor.where(finite, 0.0).abs().amax(-1)
        lse_bound = lse_bound + math.log(2.0) * 2.0**-24 * (anchor_log2 + 112)
    lse_ref = torch.logsumexp(x * math.log(2.0), dim=-1)
    lse_bound = lse_bound + 4 * 2.0**-24 * lse_ref.abs().nan_to_num(0.0, posinf=0.0, neginf=0.0)
    out_bound = torch.minimum(out_bound, 2 * v_max).where(has_key, 0.0)
    lse_bound = lse_bound.where(has_key, 0.0)
    return out_bound.transpose(1, 2)[..., None].float(), lse_bound.float()
