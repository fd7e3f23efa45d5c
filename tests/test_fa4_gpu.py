"""The patched FA4 kernels on a GPU (SM90/SM100) against the semantic reference; skipped without CUDA.

The full run, with exact == stock FA4 bit for bit, is `scripts/fa4_gate_run.py --out DIR`.
"""

import functools

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def fa4():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability()[0] not in (9, 10, 11):
        pytest.skip("FA4's softmax stage runs on SM90 and SM100-family GPUs")
    from fa4_rowmax.interface import is_fa4_patched

    if not is_fa4_patched():
        pytest.skip("FA4 is not patched: python scripts/fa4_patch.py apply")
    from flash_attn.cute import flash_attn_func

    return flash_attn_func


def _inputs(seed, batch, sq, sk, hq, hk, d=128, q_std=3.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = (torch.randn(batch, sq, hq, d, device="cuda", generator=gen) * q_std).bfloat16()
    k = torch.randn(batch, sk, hk, d, device="cuda", generator=gen).bfloat16()
    v = torch.randn(batch, sk, hk, d, device="cuda", generator=gen).bfloat16()
    return q, k, v


def _default_threshold():
    return 0.0 if torch.cuda.get_device_capability()[0] == 9 else 8.0


@pytest.mark.parametrize("mode", ["rowmax_h15", "rowmax_pot"])
@pytest.mark.parametrize(
    "shape, causal",
    [((1, 128, 128, 1, 1), True), ((2, 509, 300, 8, 2), False), ((1, 509, 300, 2, 1), True), ((1, 300, 509, 4, 2), True)],
)
def test_kernel_matches_reference(fa4, mode, shape, causal):
    from fa4_rowmax.config import SoftmaxConfig
    from fa4_rowmax.reference import attention_reference

    q, k, v = _inputs(0, *shape)
    with torch.no_grad():
        out, lse = fa4(q, k, v, causal=causal, return_lse=True, softmax_mode=mode)
    ref_out, ref_lse = attention_reference(
        q, k, v, SoftmaxConfig(mode=mode, tile_n=128, rescale_threshold=_default_threshold()), causal=causal
    )
    finite = torch.isfinite(ref_lse)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    assert torch.isneginf(lse[~finite]).all()
    assert (lse[finite] - ref_lse[finite]).abs().max() < 1e-2
    row_scale = ref_out.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    err_ulps = ((out.float() - ref_out.float()).abs() / row_scale / torch.finfo(torch.bfloat16).eps).amax(dim=-1)
    assert (err_ulps > 4).float().mean() <= 1e-3, float(err_ulps.max())


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
    from fa4_rowmax.gates import single_tile_gate
    from fa4_rowmax.interface import fa4_backend
    from fa4_rowmax.reference import attention_reference

    reference = functools.partial(attention_reference, config=SoftmaxConfig(mode="rowmax_h15", tile_n=128))
    report = single_tile_gate(fa4_backend("rowmax_h15"), reference, device="cuda", seed=5)
    assert report.passed, str(report)
