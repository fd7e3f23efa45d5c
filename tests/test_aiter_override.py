"""The AITER override against the real, installed AITER package (amd-aiter from PyPI) on the CPU.

AITER imports through the documented ROCm stand-ins (tests/aiter_stub/README.md). Only two things are
replaced, both recorded: OUR kernel entry (`aiter_fused.attention.fused_softmax_attention` and its varlen
twin) and the CPU kernels of AITER's compiled forward ops (`torch.ops.aiter.mha_fwd`, ...), which stand
for "AITER's original forward ran". Everything between `aiter.flash_attn_func` and those two ends is
AITER's and this project's real code.
"""

import importlib.metadata
import importlib.util
import inspect
import logging
import math
import os
import tomllib
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # the real kernel runs under Triton's interpreter on a CPU

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("aiter") is None,
    reason="amd-aiter is not installed (scripts/install_aiter_ci.sh installs it with the ROCm stand-ins)",
)

from aiter_stub import stand_ins  # noqa: E402
from aiter_stub.recording_kernel import RecordingKernel, intercept_aiter_ops  # noqa: E402

import aiter_fused  # noqa: E402
from aiter_fused import override, vllm_plugin  # noqa: E402
from fa4_rowmax.reference.fused_softmax import (  # noqa: E402
    fused_softmax_attention_reference,
    fused_softmax_attention_reference_varlen,
    hybrid_format,
)

BF16 = torch.bfloat16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ENV_SWITCHES = (override.DISABLE_ENV, override.FORMAT_ENV, override.EXACT_ENV, vllm_plugin.ENABLE_ENV, override.CK_ENV)


@pytest.fixture(scope="session")
def aiter(tmp_path_factory):
    return stand_ins.import_real_aiter(tmp_path_factory.mktemp("aiter_jit"))


@pytest.fixture(scope="session")
def _aiter_op_log(aiter):
    log = []
    library = intercept_aiter_ops(log)
    yield log
    del library


@pytest.fixture
def aiter_ops(_aiter_op_log):
    """Names of AITER's compiled forward ops reached during the test."""
    _aiter_op_log.clear()
    return _aiter_op_log


@pytest.fixture
def kernel(monkeypatch):
    """OUR kernel entries replaced by recording CPU implementations."""
    return RecordingKernel.patch_entries(monkeypatch)


@pytest.fixture(autouse=True)
def _restore_aiter(aiter, monkeypatch):
    """Each test starts uninstalled with clean switches, and AITER's globals are put back whatever happens."""
    import aiter.ops.mha as mha

    for name in ENV_SWITCHES:
        monkeypatch.delenv(name, raising=False)
    originals = {name: getattr(mha, name) for name in ("_flash_attn_forward", "_flash_attn_varlen_forward")}
    assert not override.is_installed()
    yield
    override._originals.clear()
    for name, function in originals.items():
        setattr(mha, name, function)


def _qkv(batch, seqlen_q, seqlen_k, heads_q, heads_k, head_dim, dtype=BF16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen_q, heads_q, head_dim, generator=generator).to(dtype)
    k = torch.randn(batch, seqlen_k, heads_k, head_dim, generator=generator).to(dtype)
    v = torch.randn(batch, seqlen_k, heads_k, head_dim, generator=generator).to(dtype)
    return q, k, v


def _varlen_qkv(seqlens_q, seqlens_k, heads_q, heads_k, head_dim, dtype=BF16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(seqlens_q), heads_q, head_dim, generator=generator).to(dtype)
    k = torch.randn(sum(seqlens_k), heads_k, head_dim, generator=generator).to(dtype)
    v = torch.randn(sum(seqlens_k), heads_k, head_dim, generator=generator).to(dtype)
    cu_q = torch.tensor([0, *torch.tensor(seqlens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(seqlens_k).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, cu_q, cu_k


def _assert_equal(actual, expected):
    torch.testing.assert_close(actual, expected, atol=0, rtol=0, equal_nan=True)


# ----------------------------------------------------------------------------------------------------
# Routing.


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_func_reaches_fused_kernel(aiter, kernel, aiter_ops, head_dim, causal):
    # GQA, seqlen_q > seqlen_k (causal leaves the first rows fully masked), lengths off any tile size.
    q, k, v = _qkv(2, 131, 77, heads_q=6, heads_k=2, head_dim=head_dim)
    assert override.install()
    out, lse = aiter.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    assert aiter_ops == []
    assert [call["entry"] for call in kernel.calls] == ["dense"]
    call = kernel.calls[0]
    assert call["causal"] is causal and call["mx_format"] == "mxfp8" and call["exact"] is False
    assert math.isclose(call["softmax_scale"], head_dim**-0.5)
    assert out.shape == q.shape and out.dtype == BF16
    assert lse.shape == (2, 6, 131) and lse.dtype == torch.float32
    expected_out, expected_lse = fused_softmax_attention_reference(q, k, v, causal=causal)
    _assert_equal(out, expected_out.to(BF16))
    _assert_equal(lse, expected_lse)
    if causal:
        masked_rows = 131 - 77
        assert torch.all(out[:, :masked_rows] == 0) and torch.all(lse[..., :masked_rows] == -math.inf)


def test_fused_path_agrees_with_aiter_path(aiter, kernel, aiter_ops):
    """The same supported call, once through the fused hook (exact mode) and once through AITER's
    original: the hook hands the kernel what AITER hands its own op (layout, scale, causal, GQA) and
    returns the result the same way."""
    q, k, v = _qkv(1, 150, 150, heads_q=4, heads_k=1, head_dim=128, seed=1)
    options = dict(softmax_scale=0.07, causal=True, return_lse=True)
    override.install()
    with aiter_fused.use_format(exact=True):
        fused_out, fused_lse = aiter.flash_attn_func(q, k, v, **options)
    override.uninstall()
    aiter_out, aiter_lse = aiter.flash_attn_func(q, k, v, **options)
    assert len(kernel.calls) == 1 and aiter_ops == ["fmha_v3_fwd"]
    torch.testing.assert_close(fused_out, aiter_out, atol=0, rtol=0)
    torch.testing.assert_close(fused_lse, aiter_lse, atol=0, rtol=0)


def test_flash_attn_varlen_func_reaches_fused_kernel_and_fills_out(aiter, kernel, aiter_ops):
    seqlens_q, seqlens_k = [5, 33, 1], [70, 33, 9]
    q, k, v, cu_q, cu_k = _varlen_qkv(seqlens_q, seqlens_k, heads_q=4, heads_k=2, head_dim=128)
    out_buffer = torch.full((q.shape[0], 4, 128), float("nan"), dtype=BF16)  # vLLM passes `out=`
    override.install()
    result, lse = aiter.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k), causal=True, return_lse=True, out=out_buffer
    )
    assert aiter_ops == [] and [call["entry"] for call in kernel.calls] == ["varlen"]
    assert kernel.calls[0]["max_seqlen_q"] == 33 and kernel.calls[0]["max_seqlen_k"] == 70
    assert kernel.calls[0]["validate"] is False  # no host read of cu_seqlens on vLLM's hot path
    assert result.data_ptr() == out_buffer.data_ptr()
    assert lse.shape == (4, q.shape[0])
    expected_out, expected_lse = fused_softmax_attention_reference_varlen(q, k, v, cu_q, cu_k, causal=True)
    _assert_equal(out_buffer, expected_out.to(BF16))
    _assert_equal(lse, expected_lse)


def test_a_strided_out_buffer_is_filled_with_the_values(aiter, kernel, aiter_ops):
    """A caller's `out` in any layout (here every other element of a wider buffer, and a transposed copy) gets
    the values; the kernel writes its own contiguous out and the hook copies it in (Note [Operand layouts] in
    aiter_fused/attention.py)."""
    seqlens_q, seqlens_k = [5, 12], [9, 12]
    q, k, v, cu_q, cu_k = _varlen_qkv(seqlens_q, seqlens_k, heads_q=4, heads_k=2, head_dim=128)
    expected_out, _ = fused_softmax_attention_reference_varlen(q, k, v, cu_q, cu_k, causal=True)
    gapped = torch.full((q.shape[0], 4, 256), float("nan"), dtype=BF16)[..., ::2]
    transposed = torch.full((q.shape[0], 128, 4), float("nan"), dtype=BF16).transpose(1, 2)
    override.install()
    for out_buffer in (gapped, transposed):
        result, _ = aiter.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k), causal=True, return_lse=True, out=out_buffer
        )
        assert result.data_ptr() == out_buffer.data_ptr()
        _assert_equal(out_buffer, expected_out.to(BF16))


def _dense_unsupported_cases():
    q, k, v = _qkv(1, 40, 40, heads_q=2, heads_k=2, head_dim=128)
    return {
        "fp16": (lambda: (q.half(), k.half(), v.half()), {}),
        "head_dim_96": (lambda: (q[..., :96], k[..., :96], v[..., :96]), {}),
        "head_dim_q_v_differ": (lambda: (q[..., :64], k[..., :64], v), {}),
        "dropout": (lambda: (q, k, v), dict(dropout_p=0.1)),
        "sliding_window": (lambda: (q, k, v), dict(window_size=(8, 0))),
        "alibi": (lambda: (q, k, v), dict(alibi_slopes=torch.ones(2))),
        "bias": (lambda: (q, k, v), dict(bias=torch.zeros(40, 40, dtype=BF16))),
        "requires_grad": (lambda: (q.clone().requires_grad_(), k, v), dict(return_lse=True)),
    }


@pytest.mark.parametrize("case", sorted(_dense_unsupported_cases()))
def test_unsupported_dense_call_falls_through_to_aiter(aiter, kernel, aiter_ops, case):
    make_inputs, options = _dense_unsupported_cases()[case]
    override.install()
    aiter.flash_attn_func(*make_inputs(), **options)
    assert kernel.calls == []
    assert aiter_ops == ["mha_fwd"]


@pytest.mark.parametrize(
    "options",
    [dict(logits_soft_cap=30.0), dict(window_size=(16, 16)), dict(block_table=torch.zeros(3, 1, dtype=torch.int32))],
    ids=["soft_cap", "sliding_window", "paged_kv"],
)
def test_unsupported_varlen_call_falls_through_to_aiter(aiter, kernel, aiter_ops, options):
    q, k, v, cu_q, cu_k = _varlen_qkv([20, 30, 10], [20, 30, 10], heads_q=2, heads_k=2, head_dim=128)
    override.install()
    aiter.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 30, 30, **options)
    assert kernel.calls == []
    assert len(aiter_ops) == 1 and aiter_ops[0] in ("mha_varlen_fwd", "fmha_v3_varlen_fwd")


def test_uninstall_stops_reaching_fused_kernel(aiter, kernel, aiter_ops):
    import aiter.ops.mha as mha

    originals = (mha._flash_attn_forward, mha._flash_attn_varlen_forward)
    q, k, v = _qkv(1, 200, 200, heads_q=2, heads_k=2, head_dim=128)
    assert override.install() and override.is_installed()
    assert mha._flash_attn_forward is not originals[0]
    aiter.flash_attn_func(q, k, v)
    assert override.uninstall() and not override.is_installed()
    assert (mha._flash_attn_forward, mha._flash_attn_varlen_forward) == originals
    aiter.flash_attn_func(q, k, v)
    assert len(kernel.calls) == 1 and aiter_ops == ["fmha_v3_fwd"]
    assert override.uninstall() is False


def test_install_twice_is_harmless(aiter, kernel, aiter_ops):
    import aiter.ops.mha as mha

    original = mha._flash_attn_forward
    assert override.install() and override.install()
    assert mha._flash_attn_forward.__wrapped__ is original  # hooked once, not a hook of a hook
    q, k, v = _qkv(1, 16, 16, heads_q=2, heads_k=2, head_dim=64)
    aiter.flash_attn_func(q, k, v)
    assert len(kernel.calls) == 1 and aiter_ops == []
    assert override.uninstall()
    assert mha._flash_attn_forward is original


def test_uninstall_refuses_to_drop_someone_elses_hook(aiter):
    import aiter.ops.mha as mha

    override.install()
    ours = mha._flash_attn_forward
    mha._flash_attn_forward = lambda *args, **kwargs: ours(*args, **kwargs)
    with pytest.raises(RuntimeError, match="_flash_attn_forward was rebound"):
        override.uninstall()
    assert override.is_installed()


def test_kill_switch_makes_install_a_logged_no_op(aiter, kernel, aiter_ops, monkeypatch, caplog):
    import aiter.ops.mha as mha

    original = mha._flash_attn_forward
    monkeypatch.setenv(override.DISABLE_ENV, "1")
    with caplog.at_level(logging.INFO, logger="aiter_fused.override"):
        assert override.install() is False
    assert "AITER_FUSED_DISABLE=1" in caplog.text
    assert not override.is_installed() and mha._flash_attn_forward is original
    q, k, v = _qkv(1, 16, 16, heads_q=2, heads_k=2, head_dim=64)
    aiter.flash_attn_func(q, k, v)
    assert kernel.calls == [] and aiter_ops == ["mha_fwd"]


@pytest.mark.parametrize("value", ["yes", "true", "2"])
def test_kill_switch_rejects_unknown_values(aiter, monkeypatch, value):
    monkeypatch.setenv(override.DISABLE_ENV, value)
    with pytest.raises(ValueError, match="AITER_FUSED_DISABLE.*accepted values"):
        override.install()
    assert not override.is_installed()


def test_install_warns_about_unknown_aiter_arguments(aiter, kernel, aiter_ops, monkeypatch, caplog):
    """A newer AITER forward with an argument the override does not know: install warns, calls fall through."""
    import aiter.ops.mha as mha

    original = mha._flash_attn_forward

    def newer_forward(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left,
        window_size_right,
        bias,
        alibi_slopes,
        return_lse,
        return_softmax,
        how_v3_bf16_cvt=1,
        cu_seqlens_q=None,
        cu_seqlens_kv=None,
        new_feature=None,
    ):
        return original(
            q,
            k,
            v,
            dropout_p,
            softmax_scale,
            causal,
            window_size_left,
            window_size_right,
            bias,
            alibi_slopes,
            return_lse,
            return_softmax,
            how_v3_bf16_cvt,
            cu_seqlens_q,
            cu_seqlens_kv,
        )

    monkeypatch.setattr(mha, "_flash_attn_forward", newer_forward)
    with caplog.at_level(logging.WARNING, logger="aiter_fused.override"):
        override.install()
    assert "new_feature" in caplog.text
    q, k, v = _qkv(1, 16, 16, heads_q=2, heads_k=2, head_dim=64)
    aiter.flash_attn_func(q, k, v)
    assert kernel.calls == [] and aiter_ops == ["mha_fwd"]


def test_upstream_forward_arguments_are_served_or_fall_through(aiter, kernel, aiter_ops, monkeypatch, caplog):
    """The arguments upstream AITER added to `_flash_attn_forward` (Note [Builds that bypass the hook]):
    known to the override (no warning), `out` filled, `num_splits` ignored; a sink or a descale falls
    through to AITER."""
    import aiter.ops.mha as mha

    original = mha._flash_attn_forward

    def upstream_forward(
        q,
        k,
        v,
        dropout_p,
        softmax_scale,
        causal,
        window_size_left,
        window_size_right,
        sink_size,
        bias,
        alibi_slopes,
        q_descale,
        k_descale,
        v_descale,
        return_lse,
        return_softmax,
        how_v3_bf16_cvt=1,
        cu_seqlens_q=None,
        cu_seqlens_kv=None,
        sink_ptr=None,
        out=None,
        num_splits=1,
    ):
        return original(
            q,
            k,
            v,
            dropout_p,
            softmax_scale,
            causal,
            window_size_left,
            window_size_right,
            bias,
            alibi_slopes,
            return_lse,
            return_softmax,
            how_v3_bf16_cvt,
            cu_seqlens_q,
            cu_seqlens_kv,
        )

    monkeypatch.setattr(mha, "_flash_attn_forward", upstream_forward)
    with caplog.at_level(logging.WARNING, logger="aiter_fused.override"):
        override.install()
    assert caplog.text == ""
    q, k, v = _qkv(1, 16, 16, heads_q=2, heads_k=2, head_dim=64)
    neutral = dict(
        dropout_p=0.0,
        softmax_scale=0.125,
        causal=True,
        window_size_left=-1,
        window_size_right=-1,
        sink_size=0,
        bias=None,
        alibi_slopes=None,
        q_descale=None,
        k_descale=None,
        v_descale=None,
        return_lse=True,
        return_softmax=False,
    )
    out = torch.empty_like(q)
    result = mha._flash_attn_forward(q, k, v, **neutral, out=out, num_splits=4)
    assert len(kernel.calls) == 1 and aiter_ops == [] and result[0] is out
    expected_out, _ = fused_softmax_attention_reference(q, k, v, causal=True, softmax_scale=0.125)
    _assert_equal(out, expected_out.to(BF16))
    for change in (dict(sink_size=2), dict(q_descale=torch.ones(1)), dict(sink_ptr=torch.zeros(2))):
        mha._flash_attn_forward(q, k, v, **{**neutral, **change})
    assert len(kernel.calls) == 1 and aiter_ops == ["mha_fwd"] * 3


def test_install_warns_about_builds_that_bypass_the_hook(aiter, monkeypatch, caplog):
    import aiter.ops.mha as mha

    with caplog.at_level(logging.WARNING, logger="aiter_fused.override"):
        override.install()
    assert caplog.text == ""  # the installed AITER routes both public functions through the hooked globals
    override.uninstall()

    def triton_route(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, **kwargs):
        raise AssertionError("not called")

    monkeypatch.setenv(override.CK_ENV, "0")
    monkeypatch.setattr(mha, "flash_attn_varlen_func", triton_route)
    with caplog.at_level(logging.WARNING, logger="aiter_fused.override"):
        assert override.install()
    assert "calls may bypass it: ENABLE_CK=0" in caplog.text
    assert "aiter.ops.mha.flash_attn_varlen_func does not call FlashAttnVarlenFunc.apply" in caplog.text
    assert "flash_attn_func does not" not in caplog.text


# ----------------------------------------------------------------------------------------------------
# End to end with the real Triton kernel: AITER's public functions -> hook -> custom op -> kernel.


def _assert_matches_reference(out, lse, expected_out, expected_lse):
    """To rounding: BF16 output, fp32 scores summed in another order (as tests/test_aiter_fused_kernel.py)."""
    out, expected_out = out.float().cpu(), expected_out.float()
    assert ((out - expected_out).norm() / expected_out.norm()).item() < 6e-3
    finite = torch.isfinite(expected_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite)
    assert (lse.cpu()[finite] - expected_lse[finite]).abs().max() < 1e-3


def _kernel_tile() -> int:
    """The tile the override's calls get (the launch table's, Note [Launch table]): the reference's too."""
    from aiter_fused.launch import launch_for

    return launch_for(torch.device(DEVICE))[1].tile_n


@pytest.fixture
def real_kernel():
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU, and Triton was imported before TRITON_INTERPRET=1 could be set")
    pytest.importorskip("triton")


@pytest.mark.parametrize("mx_format", ["mxfp8", "mxfp4"])
def test_real_kernel_through_flash_attn_func(aiter, aiter_ops, real_kernel, mx_format):
    q, k, v = (t.to(DEVICE) for t in _qkv(1, 37, 83, heads_q=4, heads_k=2, head_dim=64, seed=5))
    override.install()
    with aiter_fused.use_format(mx_format):
        out, lse = aiter.flash_attn_func(q, k, v, causal=True, return_lse=True)
    assert aiter_ops == []
    expected_out, expected_lse = fused_softmax_attention_reference(
        q.cpu(), k.cpu(), v.cpu(), causal=True, mx_format=mx_format, tile_n=_kernel_tile()
    )
    _assert_matches_reference(out, lse, expected_out, expected_lse)


def test_real_kernel_through_flash_attn_varlen_func(aiter, aiter_ops, real_kernel):
    seqlens_q, seqlens_k = [9, 40], [30, 17]  # the second sequence has fully masked causal rows
    q, k, v, cu_q, cu_k = (
        t.to(DEVICE) for t in _varlen_qkv(seqlens_q, seqlens_k, heads_q=2, heads_k=1, head_dim=64, seed=6)
    )
    override.install()
    out, lse = aiter.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(seqlens_q), max(seqlens_k), causal=True, return_lse=True
    )
    assert aiter_ops == []
    expected_out, expected_lse = fused_softmax_attention_reference_varlen(
        q.cpu(), k.cpu(), v.cpu(), cu_q.cpu(), cu_k.cpu(), causal=True, tile_n=_kernel_tile()
    )
    _assert_matches_reference(out, lse, expected_out, expected_lse)


# ----------------------------------------------------------------------------------------------------
# Return contract: what our hook returns has the form AITER's forward returns.


@pytest.mark.parametrize("return_lse", [False, True])
def test_hook_returns_aiter_forward_contract(aiter, kernel, return_lse):
    import aiter.ops.mha as mha

    q, k, v = _qkv(2, 9, 12, heads_q=4, heads_k=2, head_dim=64)
    arguments = (q, k, v, 0.0, 0.125, True, -1, -1, None, None, return_lse, False)
    override.install()
    ours = mha._flash_attn_forward(*arguments)
    # AITER's own description of its forward's outputs: the fake (meta) implementation of mha_fwd.
    theirs = mha.gen_mha_fwd_fake_tensors(q, k, v, 0.0, 0.125, True, -1, -1, return_lse, False)
    assert len(kernel.calls) == 1
    assert len(ours) == len(theirs) == 4
    for name, mine, reference in zip(("out", "softmax_lse", "S_dmask", "rng_state"), ours, theirs):
        assert (mine.shape, mine.dtype, mine.device) == (reference.shape, reference.dtype, reference.device), name


# ----------------------------------------------------------------------------------------------------
# Format selection: env default, process setter, scoped override, the hybrid diffusion schedule.


def test_format_from_env_setter_and_scope(aiter, kernel, monkeypatch):
    q, k, v = _qkv(1, 8, 8, heads_q=1, heads_k=1, head_dim=64)
    monkeypatch.setattr(override, "_process_format", None)
    monkeypatch.setenv(override.FORMAT_ENV, "mxfp4")
    override.install()
    aiter.flash_attn_func(q, k, v)
    with aiter_fused.use_format("mxfp6"):
        aiter.flash_attn_func(q, k, v)
        with aiter_fused.use_format(exact=True):
            aiter.flash_attn_func(q, k, v)
        aiter.flash_attn_func(q, k, v)
    aiter_fused.set_format("mxfp8")
    aiter.flash_attn_func(q, k, v)
    seen = [(call["mx_format"], call["exact"]) for call in kernel.calls]
    assert seen == [("mxfp4", False), ("mxfp6", False), ("mxfp6", True), ("mxfp6", False), ("mxfp8", False)]


def test_hybrid_diffusion_schedule(aiter, kernel):
    """The paper's Wan2.2 schedule: MXFP6 for the first and last three of 20 steps, MXFP4 between."""
    schedule = [hybrid_format(step, 20) for step in range(20)]
    assert schedule[:3] == schedule[-3:] == ["mxfp6"] * 3 and set(schedule[3:-3]) == {"mxfp4"}
    q, k, v = _qkv(1, 8, 8, heads_q=2, heads_k=2, head_dim=128)
    override.install()
    for mx_format in schedule:
        with aiter_fused.use_format(mx_format):
            aiter.flash_attn_func(q, k, v)
    assert [call["mx_format"] for call in kernel.calls] == schedule


def test_bad_formats_are_rejected(aiter, monkeypatch):
    with pytest.raises(ValueError, match="mx_format must be one of.*mxfp8.*'mxfp7'"):
        with aiter_fused.use_format("mxfp7"):
            pass
    with pytest.raises(TypeError, match="exact must be a bool"):
        aiter_fused.set_format(exact="yes")
    monkeypatch.setenv(override.FORMAT_ENV, "fp8")
    with pytest.raises(ValueError, match="AITER_FUSED_FORMAT: mx_format must be one of.*mxfp6.*'fp8'"):
        override.install()
    assert not override.is_installed()


# ----------------------------------------------------------------------------------------------------
# The predicate on its own.


def test_supports_predicate():
    q, k, v = _qkv(1, 10, 12, heads_q=4, heads_k=2, head_dim=128)
    assert override.supports(q, k, v, causal=True)
    assert override.unsupported_reason(q, k, v, window_size_left=12, window_size_right=100) is None
    cases = {
        "argument(s) ['sinks_v9'] unknown": dict(sinks_v9=1),
        "dropout_p=0.5": dict(dropout_p=0.5),
        "sink_size=4": dict(sink_size=4),
        "q_descale is set": dict(q_descale=torch.ones(1)),
        "window_size_left=3": dict(window_size_left=3),
        "cu_seqlens_q is set on the dense path": dict(cu_seqlens_q=torch.zeros(2, dtype=torch.int32)),
        "out is not a": dict(out=torch.empty(1, 10, 4, 64, dtype=BF16)),
    }
    for expected, arguments in cases.items():
        assert expected in override.unsupported_reason(q, k, v, **arguments)
    assert "heads q/k/v=3/2/2" in override.unsupported_reason(q[:, :, :3], k, v)
    assert "float32" in override.unsupported_reason(q.float(), k.float(), v.float())
    assert "ranks" in override.unsupported_reason(q[0, 0], k[0, 0], v[0, 0])
    qv, kv, vv, cu_q, cu_k = _varlen_qkv([3, 4], [5, 6], heads_q=2, heads_k=2, head_dim=64)
    varlen = dict(cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=4, max_seqlen_k=6)
    assert override.supports(qv, kv, vv, **varlen)
    assert "int32" in override.unsupported_reason(qv, kv, vv, **{**varlen, "cu_seqlens_k": cu_k.long()})
    assert "cu_seqlens_q is not" in override.unsupported_reason(qv, kv, vv, **{**varlen, "cu_seqlens_q": None})


# ----------------------------------------------------------------------------------------------------
# vLLM plugin.


def test_vllm_entry_point_is_declared():
    pyproject = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())
    target = pyproject["project"]["entry-points"]["vllm.general_plugins"]["aiter_fused"]
    module_name, _, attribute = target.partition(":")
    assert getattr(importlib.import_module(module_name), attribute) is vllm_plugin.register
    assert inspect.signature(vllm_plugin.register).parameters == {}


def _load_declared_entry_point():
    """The plugin as vLLM loads it: the installed package's `vllm.general_plugins` entry point."""
    (entry_point,) = [
        ep for ep in importlib.metadata.entry_points(group="vllm.general_plugins") if ep.name == "aiter_fused"
    ]
    return entry_point.load()


def _assert_aiter_untouched(aiter, kernel, aiter_ops, originals):
    import aiter.ops.mha as mha

    assert not override.is_installed()
    assert {name: getattr(mha, name) for name in originals} == originals
    q, k, v = _qkv(1, 16, 16, heads_q=2, heads_k=2, head_dim=64)
    aiter.flash_attn_func(q, k, v)
    q, k, v, cu_q, cu_k = _varlen_qkv([9, 7], [9, 7], heads_q=2, heads_k=2, head_dim=64)
    aiter.flash_attn_varlen_func(q, k, v, cu_q, cu_k, 9, 9, causal=True)
    assert kernel.calls == [] and aiter_ops == ["mha_fwd", "mha_varlen_fwd"]


def test_vllm_plugin_without_opt_in_leaves_aiter_untouched(aiter, kernel, aiter_ops, monkeypatch, caplog):
    """Installing the package, importing it and running its entry point as vLLM does, with no opt-in:
    AITER's globals stay AITER's own functions and both public functions reach AITER's own ops, on a
    ROCm torch as on any other (Note [Opt-in, never silent]). The decision is logged."""
    import aiter.ops.mha as mha

    originals = {name: getattr(mha, name) for name in ("_flash_attn_forward", "_flash_attn_varlen_forward")}
    register = _load_declared_entry_point()
    for hip in (None, "6.4.0-standin"):
        monkeypatch.setattr(torch.version, "hip", hip)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="aiter_fused"):
            register()
            register()  # every vLLM process (and its argument parser) calls it
        assert "AITER_FUSED_ENABLE is not set to 1, AITER is left untouched" in caplog.text
        _assert_aiter_untouched(aiter, kernel, aiter_ops, originals)
        aiter_ops.clear()
    monkeypatch.setenv(override.FORMAT_ENV, "mxfp4")  # a format alone is no opt-in
    monkeypatch.setenv(vllm_plugin.ENABLE_ENV, "0")
    register()
    _assert_aiter_untouched(aiter, kernel, aiter_ops, originals)


@pytest.mark.parametrize("numerics", [{"AITER_FUSED_FORMAT": "mxfp6"}, {"AITER_FUSED_EXACT": "1"}])
def test_vllm_plugin_opt_in_installs_and_logs(aiter, kernel, aiter_ops, monkeypatch, caplog, numerics):
    monkeypatch.setattr(override, "_process_format", None)
    monkeypatch.setenv(vllm_plugin.ENABLE_ENV, "1")
    for name, value in numerics.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level(logging.INFO, logger="aiter_fused"):
        _load_declared_entry_point()()
    assert override.is_installed()
    assert "AITER_FUSED_ENABLE=1: AITER override installed" in caplog.text
    q, k, v = _qkv(1, 16, 16, heads_q=2, heads_k=2, head_dim=64)
    aiter.flash_attn_func(q, k, v)
    expected = ("mxfp6", False) if "AITER_FUSED_FORMAT" in numerics else ("mxfp8", True)
    assert [(call["mx_format"], call["exact"]) for call in kernel.calls] == [expected] and aiter_ops == []


def test_vllm_plugin_opt_in_needs_the_numerics_named(aiter, monkeypatch):
    monkeypatch.setenv(vllm_plugin.ENABLE_ENV, "1")
    with pytest.raises(
        ValueError, match="AITER_FUSED_ENABLE=1 needs.*AITER_FUSED_FORMAT.*'mxfp8'.*AITER_FUSED_EXACT=1"
    ):
        vllm_plugin.register()
    assert not override.is_installed()


@pytest.mark.parametrize(
    "name, value, accepted",
    [
        ("AITER_FUSED_ENABLE", "true", "accepted values are '0', '1' or unset"),
        ("AITER_FUSED_ENABLE", "yes", "accepted values are '0', '1' or unset"),
        ("AITER_FUSED_DISABLE", "2", "accepted values are '0', '1' or unset"),
        ("AITER_FUSED_EXACT", "on", "accepted values are '0', '1' or unset"),
        ("AITER_FUSED_FORMAT", "mxfp9", "mx_format must be one of .*'mxfp8', 'mxfp6', 'mxfp4'"),
    ],
)
def test_vllm_plugin_rejects_unknown_switch_values(aiter, monkeypatch, name, value, accepted):
    """Without the opt-in too: a typo must not leave the user on stock numerics believing otherwise."""
    import aiter.ops.mha as mha

    original = mha._flash_attn_forward
    monkeypatch.setattr(override, "_process_format", None)
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name}.*{accepted}"):
        vllm_plugin.register()
    assert not override.is_installed() and mha._flash_attn_forward is original


def test_vllm_plugin_kill_switch_wins_over_opt_in(aiter, monkeypatch, caplog):
    monkeypatch.setenv(vllm_plugin.ENABLE_ENV, "1")
    monkeypatch.setenv(override.FORMAT_ENV, "mxfp8")
    monkeypatch.setenv(override.DISABLE_ENV, "1")
    with caplog.at_level(logging.INFO, logger="aiter_fused"):
        vllm_plugin.register()
    assert not override.is_installed() and "AITER_FUSED_DISABLE=1" in caplog.text
