"""The patched FA4 kernels on a GPU (SM90/SM100) against the semantic reference; skipped without CUDA.

The full run, with exact == stock FA4 bit for bit, is `scripts/fa4_gate_run.py --out DIR`. Tolerances:
`fa4_rowmax.gates.tolerances` (derived per row from the inputs).
"""

import functools

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def fa4():
    if torch.cuda.get_device_capability()[0] not in (9, 10, 11):
        pytest.skip("FA4's softmax stage runs on SM90 and SM100-family GPUs")
    from fa4_rowmax.interface import is_fa4_patched

    if not is_fa4_patched():
        pytest.skip("FA4 is not patched: python -m fa4_rowmax.patching apply")
    from flash_attn.cute import flash_attn_func

    return flash_attn_func


def _inputs(seed, batch, sq, sk, hq, hk, d=128, q_std=3.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randn(batch, sq, hq, d, device="cuda", generator=gen) * q_std).bfloat16()
    k = torch.randn(batch, sk, hk, d, device="cuda", generator=gen).bfloat16()
    v = torch.randn(batch, sk, hk, d, device="cuda", generator=gen).bfloat16()
    return q, k, v


def _reference_config(mode, **knobs):
    """The reference configuration derived from the stage the kernel resolves on this GPU (one derivation for
    kernel, reference and tests: `SoftmaxStage.reference_config`)."""
    from fa4_rowmax.interface import SoftmaxStage

    major, minor = torch.cuda.get_device_capability()
    stage = SoftmaxStage(mode, **knobs).for_kernel(arch=major * 10 + minor, q_dtype=torch.bfloat16)
    return stage.reference_config(tile_n=128)


def _assert_matches_reference(q, k, v, causal, config, out, lse):
    """Every row within its derived bound of the reference (Note [Kernel vs reference: lattice flips] in
    fa4_rowmax/gates/tolerances.py); -inf LSE exactly on the reference's rows with no key."""
    from fa4_rowmax.gates.tolerances import assert_within_bounds, kernel_bounds
    from fa4_rowmax.reference.attention import attention_reference

    bounds = kernel_bounds(q, k, v, config, causal=causal)
    assert bounds.decision_rows <= 0.01 * bounds.lse.numel(), bounds.decision_rows
    assert_within_bounds(out, lse, *attention_reference(q, k, v, config, causal=causal), bounds)


@pytest.mark.parametrize("mode", ["rowmax_h15", "rowmax_pot"])
@pytest.mark.parametrize(
    "shape, causal",
    [
        ((1, 128, 128, 1, 1), True),
        ((2, 509, 300, 8, 2), False),
        ((1, 509, 300, 2, 1), True),
        ((1, 300, 509, 4, 2), True),
    ],
)
def test_kernel_matches_reference(fa4, mode, shape, causal):
    q, k, v = _inputs(0, *shape)
    with torch.no_grad():
        out, lse = fa4(q, k, v, causal=causal, return_lse=True, softmax_mode=mode)
    _assert_matches_reference(q, k, v, causal, _reference_config(mode), out, lse)


def test_exact_with_a_threshold_of_zero_is_stock_bit_for_bit(fa4):
    """exact through the stage (rescale_threshold=0.0 set, so the stage is used) against stock FA4: on SM90
    stock always rescales, so threshold 0 must change no bit; on SM100 stock's threshold is 8, so the
    stage's 0 must differ from stock (it rescales more often) and match the reference."""
    q, k, v = _inputs(8, 2, 777, 1031, 4, 2)
    with torch.no_grad():
        stock = fa4(q, k, v, causal=True, return_lse=True)
        staged = fa4(q, k, v, causal=True, return_lse=True, softmax_mode="exact", rescale_threshold=0.0)
    if torch.cuda.get_device_capability()[0] == 9:
        assert torch.equal(staged[0], stock[0]) and torch.equal(staged[1], stock[1])
    else:
        _assert_matches_reference(q, k, v, True, _reference_config("exact", rescale_threshold=0.0), *staged)


@pytest.mark.parametrize("beta", [0.5, 1.0])
@pytest.mark.parametrize("shape, causal", [((2, 509, 300, 8, 2), False), ((1, 300, 509, 4, 2), True)])
def test_exact_with_beta_matches_reference(fa4, beta, shape, causal):
    """exact with a beta builds that share of the weights with FA4's exp2 emulation: its values move, within the
    emulation's term of the bounds (Note [Kernel vs reference: the exp2 emulation], fa4_rowmax/gates/tolerances.py)."""
    q, k, v = _inputs(3, *shape, q_std=1.0)
    with torch.no_grad():
        out, lse = fa4(q, k, v, causal=causal, return_lse=True, softmax_mode="exact", beta=beta)
        stock = fa4(q, k, v, causal=causal, return_lse=True)
    assert not torch.equal(lse, stock[1])  # the emulated share is in use
    _assert_matches_reference(q, k, v, causal, _reference_config("exact", beta=beta), out, lse)


def test_beta_changes_instructions_not_values(fa4):
    q, k, v = _inputs(1, 1, 512, 512, 2, 2)
    with torch.no_grad():
        base = fa4(q, k, v, causal=True, return_lse=True, softmax_mode="rowmax_h15")
        for beta in (0.0, 0.5):
            out, lse = fa4(q, k, v, causal=True, return_lse=True, softmax_mode="rowmax_h15", beta=beta)
            assert torch.equal(out, base[0]) and torch.equal(lse, base[1]), beta


def test_gradients_are_refused_for_approximate_modes(fa4):
    q, k, v = _inputs(2, 1, 128, 128, 1, 1)
    with pytest.raises(ValueError, match="forward-only"):
        fa4(q.requires_grad_(), k, v, causal=True, softmax_mode="rowmax_h15")


def test_single_tile_gate(fa4):
    from fa4_rowmax.config import SoftmaxConfig
    from fa4_rowmax.gates.gates import single_tile_gate
    from fa4_rowmax.interface import fa4_backend
    from fa4_rowmax.reference.attention import attention_reference

    reference = functools.partial(attention_reference, config=SoftmaxConfig(mode="rowmax_h15", tile_n=128))
    report = single_tile_gate(fa4_backend("rowmax_h15"), reference, device="cuda", seed=5)
    assert report.passed, str(report)


# --- SM90 levers (fa4_rowmax.interface.rowmax_attn_func): docs/fa4_notes.md, "Hopper variants" ---------------


@pytest.fixture(scope="module")
def rowmax_attn(fa4):
    """The SM90 levers' entry; the tests that take it carry gpu(arch="sm90") (Note [GPU tests])."""
    from fa4_rowmax.interface import rowmax_attn_func

    return rowmax_attn_func


@pytest.mark.gpu(arch="sm90")
@pytest.mark.parametrize("threshold", [0.0, 8.0])
@pytest.mark.parametrize("vote", [False, True])
@pytest.mark.parametrize(
    "shape, causal", [((1, 128, 128, 1, 1), True), ((2, 509, 300, 8, 2), False), ((1, 300, 1100, 4, 2), True)]
)
def test_folded_h15_matches_the_half_octave_reference(rowmax_attn, shape, causal, vote, threshold):
    q, k, v = _inputs(3, *shape)
    with torch.no_grad():
        out, lse = rowmax_attn(
            q,
            k,
            v,
            causal=causal,
            return_lse=True,
            softmax_mode="rowmax_h15",
            anchor_rounding="half_octave",
            rescale_vote=vote,
            rescale_threshold=threshold,
        )
    config = _reference_config("rowmax_h15", rescale_threshold=threshold, anchor_rounding="half_octave")
    _assert_matches_reference(q, k, v, causal, config, out, lse)


@pytest.mark.gpu(arch="sm90")
@pytest.mark.parametrize("mode, anchor", [("rowmax_h15", "exact"), ("rowmax_h15", "half_octave"), ("exact", "exact")])
@pytest.mark.parametrize("threshold", [0.0, 8.0])
def test_rescale_vote_changes_instructions_not_values(rowmax_attn, mode, anchor, threshold):
    q, k, v = _inputs(4, 2, 1024, 1024, 4, 2)
    with torch.no_grad():
        knobs = dict(softmax_mode=mode, anchor_rounding=anchor, rescale_threshold=threshold, return_lse=True)
        base = rowmax_attn(q, k, v, causal=True, rescale_vote=False, **knobs)
        voted = rowmax_attn(q, k, v, causal=True, rescale_vote=True, **knobs)
    assert torch.equal(voted[0], base[0]) and torch.equal(voted[1], base[1])


@pytest.mark.gpu(arch="sm90")
def test_exact_vote_without_threshold_equals_stock(rowmax_attn, fa4):
    q, k, v = _inputs(5, 1, 1000, 1000, 4, 4)
    with torch.no_grad():
        stock = fa4(q, k, v, causal=False, return_lse=True)
        voted = rowmax_attn(q, k, v, causal=False, return_lse=True, softmax_mode="exact", rescale_vote=True)
    # Skipping a multiply by exactly 1.0 changes no bit.
    assert torch.equal(voted[0], stock[0]) and torch.equal(voted[1], stock[1])


@pytest.mark.gpu(arch="sm90")
def test_lever_arguments_are_validated(rowmax_attn):
    q, k, v = _inputs(6, 1, 128, 128, 1, 1)
    with pytest.raises(ValueError, match="anchor_rounding"):
        rowmax_attn(q, k, v, softmax_mode="rowmax_pot", anchor_rounding="half_octave")
    with pytest.raises(TypeError, match="rescale_vote"):
        rowmax_attn(q, k, v, softmax_mode="rowmax_h15", rescale_vote=1)


# --- NaN and Inf inputs: the approximate modes poison the same rows as stock FA4 ---------------------------


def _poison(q, k, v, where):
    q, k, v = q.clone(), k.clone(), v.clone()
    if where == "q_nan":
        q[0, 200, 1, 7] = float("nan")
    elif where == "k_nan":
        k[0, 300, 0, 3] = float("nan")
    elif where == "v_nan":
        v[0, 300, 0, 3] = float("nan")
    elif where == "q_inf":
        q[0, 200, 1, :] = float("inf")
    return q, k, v


@pytest.mark.parametrize("where", ["q_nan", "k_nan", "v_nan", "q_inf"])
@pytest.mark.parametrize(
    "knobs",
    [
        dict(softmax_mode="rowmax_h15"),
        dict(softmax_mode="rowmax_pot"),
        dict(softmax_mode="rowmax_h15", anchor_rounding="half_octave", rescale_vote=True, rescale_threshold=8.0),
    ],
    ids=["h15", "pot", "h15_fold_vote_t8"],
)
@pytest.mark.parametrize("causal", [False, True])
def test_nan_and_inf_inputs_poison_the_rows_stock_poisons(fa4, knobs, where, causal):
    from fa4_rowmax.interface import rowmax_attn_func

    capability = torch.cuda.get_device_capability()
    if capability not in ((9, 0), (10, 0), (10, 3)):
        pytest.skip(
            f"NaN rows are implemented in the SM90 and SM100/SM103 stages, this GPU is "
            f"sm_{capability[0]}{capability[1]}"
        )
    if capability[0] != 9 and "anchor_rounding" in knobs:
        pytest.skip("anchor_rounding / rescale_vote are SM90 levers")
    q, k, v = _poison(*_inputs(7, 1, 640, 640, 2, 1), where)
    with torch.no_grad():
        stock_out, stock_lse = fa4(q, k, v, causal=causal, return_lse=True)
        out, lse = rowmax_attn_func(q, k, v, causal=causal, return_lse=True, **knobs)
    stock_bad = torch.isnan(stock_out).any(dim=-1)
    assert stock_bad.any()  # the poisoned input reaches stock's output
    assert torch.equal(torch.isnan(out).any(dim=-1), stock_bad)
    assert torch.isfinite(out[~stock_bad]).all()
    # The LSE too: -inf where stock's row sum is NaN (Note [NaN rows in the approximate modes]), finite elsewhere.
    assert torch.equal(lse.isneginf(), stock_lse.isneginf()) and torch.equal(lse.isnan(), stock_lse.isnan())
    assert torch.isfinite(lse[~(stock_lse.isneginf() | stock_lse.isnan())]).all()
