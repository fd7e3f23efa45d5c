"""`torch.ops.aiter_fused.fwd` / `fwd_varlen`: registration, fake implementations, tracing with
`torch.compile(fullgraph=True)` on the CPU, and the contract with the kernel entries they call.

The kernel entries are replaced by the recording CPU stand-in (tests/aiter_stub/recording_kernel.py),
which runs the project's semantic reference; nothing here needs a GPU, Triton kernels or AITER.
"""

import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from aiter_stub.recording_kernel import RecordingKernel
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from fa4_rowmax.reference.fused_softmax import fused_softmax_attention_reference

BF16 = torch.bfloat16


@pytest.fixture
def kernel(monkeypatch):
    return RecordingKernel.patch_entries(monkeypatch)


def _dense(seed=0, batch=2, seqlen_q=37, seqlen_k=45, heads_q=4, heads_k=2, head_dim=64):
    generator = torch.Generator().manual_seed(seed)
    shapes = [
        (batch, seqlen_q, heads_q, head_dim),
        (batch, seqlen_k, heads_k, head_dim),
        (batch, seqlen_k, heads_k, head_dim),
    ]
    return [torch.randn(shape, generator=generator).to(BF16) for shape in shapes]


def _varlen(seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(12, 4, 64, generator=generator).to(BF16)
    k = torch.randn(30, 2, 64, generator=generator).to(BF16)
    v = torch.randn(30, 2, 64, generator=generator).to(BF16)
    cu_q = torch.tensor([0, 5, 12], dtype=torch.int32)
    cu_k = torch.tensor([0, 21, 30], dtype=torch.int32)
    return q, k, v, cu_q, cu_k


def test_ops_are_registered_with_their_schema():
    import aiter_fused.ops  # noqa: F401  (importing the module registers the ops; run alone, nothing else has)

    dense = torch.ops.aiter_fused.fwd.default._schema
    varlen = torch.ops.aiter_fused.fwd_varlen.default._schema
    assert [a.name for a in dense.arguments] == [
        "q",
        "k",
        "v",
        "causal",
        "softmax_scale",
        "mx_format",
        "exact",
        "recovery_threshold",
    ]
    assert [a.name for a in varlen.arguments][:7] == [
        "q",
        "k",
        "v",
        "cu_seqlens_q",
        "cu_seqlens_k",
        "max_seqlen_q",
        "max_seqlen_k",
    ]
    assert len(dense.returns) == len(varlen.returns) == 2
    assert not any(a.alias_info for a in (*dense.arguments, *varlen.arguments))  # pure: mutates nothing


def test_real_impl_calls_the_kernel_entry(kernel):
    q, k, v = _dense()
    out, lse = torch.ops.aiter_fused.fwd(q, k, v, True, 0.2, "mxfp6", False)
    (call,) = kernel.calls
    assert (call["entry"], call["causal"], call["softmax_scale"], call["mx_format"], call["exact"]) == (
        "dense",
        True,
        0.2,
        "mxfp6",
        False,
    )
    expected_out, expected_lse = fused_softmax_attention_reference(
        q, k, v, causal=True, softmax_scale=0.2, mx_format="mxfp6"
    )
    torch.testing.assert_close(out, expected_out.to(BF16), atol=0, rtol=0)
    torch.testing.assert_close(lse, expected_lse, atol=0, rtol=0, equal_nan=True)


def test_fake_impls_give_shapes_without_running_the_kernel(kernel):
    with FakeTensorMode():
        q = torch.empty(3, 17, 8, 128, dtype=BF16)
        k = torch.empty(3, 29, 2, 128, dtype=BF16)
        out, lse = torch.ops.aiter_fused.fwd(q, k, k, False, None, "mxfp8", False)
        assert (out.shape, out.dtype) == ((3, 17, 8, 128), BF16)
        assert (lse.shape, lse.dtype) == ((3, 8, 17), torch.float32)
        cu = torch.empty(4, dtype=torch.int32)
        out, lse = torch.ops.aiter_fused.fwd_varlen(q[0], k[0], k[0], cu, cu, 9, 11, True, None, "mxfp4", True)
        assert (out.shape, lse.shape) == ((17, 8, 128), (8, 17))
        with pytest.raises(ValueError, match="q must be a 4-D tensor"):
            torch.ops.aiter_fused.fwd(q[0], k, k, False, None, "mxfp8", False)
    assert kernel.calls == []


def test_opcheck_dense_and_varlen(kernel):
    q, k, v = _dense()
    torch.library.opcheck(torch.ops.aiter_fused.fwd.default, (q, k, v, True, None, "mxfp8", False))
    qv, kv, vv, cu_q, cu_k = _varlen()
    torch.library.opcheck(
        torch.ops.aiter_fused.fwd_varlen.default, (qv, kv, vv, cu_q, cu_k, 7, 21, True, 0.1, "mxfp4", False)
    )
    assert kernel.calls


def _attention_block(q, k, v):
    out, lse = torch.ops.aiter_fused.fwd(q * 2, k, v, True, None, "mxfp8", False)
    return out.float().sum(dim=-1) + lse.transpose(1, 2)


def test_make_fx_traces_with_fake_tensors(kernel):
    graph = make_fx(_attention_block, tracing_mode="fake")(*_dense())
    targets = [node.target for node in graph.graph.nodes if node.op == "call_function"]
    assert torch.ops.aiter_fused.fwd.default in targets
    assert kernel.calls == []  # tracing ran the fake implementation only


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_torch_compile_fullgraph(kernel, backend):
    torch._dynamo.reset()
    q, k, v = _dense(seed=3)
    expected = _attention_block(q, k, v)
    compiled = torch.compile(_attention_block, fullgraph=True, backend=backend, dynamic=False)
    torch.testing.assert_close(compiled(q, k, v), expected, atol=0, rtol=0, equal_nan=True)
    assert len(kernel.calls) == 2  # once eager, once compiled


def test_kernel_entries_accept_what_the_ops_pass():
    """The ops call the kernel entries by keyword; their signatures must accept exactly these calls."""
    from aiter_fused import attention

    q, k, v = _dense()
    options = dict(
        causal=True, softmax_scale=None, mx_format="mxfp8", exact=False, return_lse=True, recovery_threshold=8.0
    )
    inspect.signature(attention.fused_softmax_attention).bind(q, k, v, **options)
    qv, kv, vv, cu_q, cu_k = _varlen()
    inspect.signature(attention.fused_softmax_attention_varlen).bind(
        qv, kv, vv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=7, max_seqlen_k=21, validate=False, **options
    )


def test_kernel_takes_every_head_dim_the_override_serves():
    from aiter_fused import attention, override

    assert set(override.SUPPORTED_HEAD_DIMS) <= set(attention.HEAD_DIMS)


def test_importing_the_package_needs_no_triton_and_no_aiter():
    code = (
        "import sys, aiter_fused, aiter_fused.ops, aiter_fused.override, aiter_fused.vllm_plugin\n"
        "loaded = sorted(name for name in ('triton', 'aiter', 'aiter_fused.attention') if name in sys.modules)\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=Path(__file__).parents[1])
