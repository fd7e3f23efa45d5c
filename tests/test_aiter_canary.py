"""Canaries: fail loudly when the AITER internals `aiter_fused.override` relies on change.

Each test names one assumption of Note [Hook depth] / Note [AITER forward arguments] in
aiter_fused/override.py. When one fails, re-read the installed AITER's `aiter/ops/mha.py`, adapt the
override, then the expectation here.
"""

import importlib.util
import inspect

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("aiter") is None,
    reason="amd-aiter is not installed (scripts/install_aiter_ci.sh installs it with the ROCm stand-ins)",
)

from aiter_stub import stand_ins  # noqa: E402
from aiter_stub.recording_kernel import AITER_FORWARD_OPS  # noqa: E402

from aiter_fused import override  # noqa: E402

# (public function, autograd Function whose forward calls the hooked global, hooked global, AITER ops it reaches)
ROUTES = [
    ("flash_attn_func", "FlashAttnFunc", "_flash_attn_forward", ("mha_fwd", "fmha_v3_fwd")),
    (
        "flash_attn_varlen_func",
        "FlashAttnVarlenFunc",
        "_flash_attn_varlen_forward",
        ("mha_varlen_fwd", "fmha_v3_varlen_fwd"),
    ),
]
ROUTE_IDS = [route[0] for route in ROUTES]

# The parameters of the hooked functions in amd-aiter 0.1.7.post2.dev18, as audited for the override.
AUDITED_PARAMETERS = {
    "_flash_attn_forward": [
        "q",
        "k",
        "v",
        "dropout_p",
        "softmax_scale",
        "causal",
        "window_size_left",
        "window_size_right",
        "bias",
        "alibi_slopes",
        "return_lse",
        "return_softmax",
        "how_v3_bf16_cvt",
        "cu_seqlens_q",
        "cu_seqlens_kv",
    ],
    "_flash_attn_varlen_forward": [
        "q",
        "k",
        "v",
        "cu_seqlens_q",
        "cu_seqlens_k",
        "cu_seqlens_q_padded",
        "cu_seqlens_k_padded",
        "max_seqlen_q",
        "max_seqlen_k",
        "min_seqlen_q",
        "dropout_p",
        "softmax_scale",
        "causal",
        "logits_soft_cap",
        "window_size_left",
        "window_size_right",
        "bias",
        "alibi_slopes",
        "return_lse",
        "return_softmax",
        "how_v3_bf16_cvt",
        "block_table",
        "out",
        "zero_tensors",
    ],
}


@pytest.fixture(scope="module")
def mha(tmp_path_factory):
    stand_ins.import_real_aiter(tmp_path_factory.mktemp("aiter_jit"))
    import aiter.ops.mha

    return aiter.ops.mha


@pytest.mark.parametrize("route", ROUTES, ids=ROUTE_IDS)
def test_public_function_is_the_one_vllm_imports(mha, route):
    import aiter

    public, _, _, _ = route
    assert getattr(aiter, public) is getattr(mha, public), f"aiter.{public} is no longer aiter.ops.mha.{public}"


@pytest.mark.parametrize("route", ROUTES, ids=ROUTE_IDS)
def test_hooked_global_is_looked_up_at_call_time(mha, route):
    _, function_class, hooked, _ = route
    assert callable(getattr(mha, hooked, None)), f"aiter.ops.mha.{hooked} is gone"
    forward = getattr(mha, function_class).forward
    assert forward.__globals__ is vars(mha), f"{function_class}.forward no longer lives in aiter.ops.mha"
    assert hooked in forward.__code__.co_names, f"{function_class}.forward no longer calls the global {hooked}"
    assert hooked not in forward.__code__.co_freevars and hooked not in inspect.signature(forward).parameters


class _Reached(Exception):
    pass


@pytest.mark.parametrize("route", ROUTES, ids=ROUTE_IDS)
def test_rebinding_the_global_redirects_the_public_function(mha, route, monkeypatch):
    """The behaviour the override relies on, end to end: rebinding the module global redirects
    `aiter.<public function>` at once."""
    public, _, hooked, _ = route

    def sentinel(*args, **kwargs):
        raise _Reached(hooked)

    monkeypatch.setattr(mha, hooked, sentinel)
    q = torch.zeros(1, 4, 1, 64, dtype=torch.bfloat16)
    cu_seqlens = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(_Reached):
        if public == "flash_attn_func":
            getattr(mha, public)(q, q, q)
        else:
            getattr(mha, public)(q[0], q[0], q[0], cu_seqlens, cu_seqlens, 4, 4)


@pytest.mark.parametrize("hooked", sorted(AUDITED_PARAMETERS))
def test_hooked_signature_is_the_audited_one(mha, hooked):
    signature = inspect.signature(getattr(mha, hooked))
    assert list(signature.parameters) == AUDITED_PARAMETERS[hooked], (
        f"aiter.ops.mha.{hooked} changed its parameters: classify new ones in Note [AITER forward arguments]"
    )
    unknown = set(signature.parameters) - override._KNOWN_ARGUMENTS
    assert not unknown, f"parameters {sorted(unknown)} are not classified by aiter_fused.override"
    assert "Tuple" in str(signature.return_annotation) or "tuple" in str(signature.return_annotation)


@pytest.mark.parametrize("route", ROUTES, ids=ROUTE_IDS)
def test_forward_reaches_only_the_named_ops(mha, route):
    """The fall-through tests intercept these ops: the forward must call nothing else that computes."""
    _, _, hooked, ops = route
    called = set(getattr(mha, hooked).__code__.co_names)
    kernels_called = {name for name in called if hasattr(torch.ops.aiter, name)}
    assert kernels_called == set(ops)
    assert set(ops) <= set(AITER_FORWARD_OPS)
    for op in ops:
        schema = getattr(torch.ops.aiter, op).default._schema
        assert [argument.name for argument in schema.arguments[:3]] == ["q", "k", "v"]
        assert len(schema.returns) == 4, f"torch.ops.aiter.{op} no longer returns (out, lse, p, rng_state)"


def test_forward_fake_outputs_keep_their_layout(mha):
    """What the hook returns is modelled on these: (out, lse (batch, heads, seqlen_q) fp32, p, rng_state)."""
    q = torch.empty(2, 5, 4, 64, dtype=torch.bfloat16, device="meta")
    k = torch.empty(2, 7, 2, 64, dtype=torch.bfloat16, device="meta")
    out, lse, p, rng_state = mha.gen_mha_fwd_fake_tensors(q, k, k, 0.0, 0.1, False, -1, -1, True, False)
    assert (out.shape, out.dtype) == (q.shape, q.dtype)
    assert (lse.shape, lse.dtype) == ((2, 4, 5), torch.float32)
    assert p.shape == (0,) and (rng_state.shape, rng_state.dtype) == ((2,), torch.int64)
    qv, kv = q[0], k[0]
    cu = torch.empty(2, dtype=torch.int32, device="meta")
    out, lse, p, rng_state = mha.gen_mha_varlen_fwd_fake_tensor(
        qv, kv, kv, cu, cu, 5, 7, 0, 0.0, 0.1, 0.0, False, False, -1, -1, True, False
    )
    assert (out.shape, lse.shape, lse.dtype) == (qv.shape, (4, 5), torch.float32)
