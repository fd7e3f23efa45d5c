"""The `AITER_FUSED` vLLM attention backend against the real vLLM package (vllm==0.33.0, installed
--no-deps by scripts/install_vllm_ci.sh) and the real AITER package (through tests/aiter_stub).

Real: vLLM's attention backend registry (`vllm.v1.attention.backends.registry`: `register_backend`,
`AttentionBackendEnum`, the name lookup vLLM's attention layer does), the plugin entry point, AITER.
Stand-in: vLLM's `vllm.v1.attention.backends.rocm_aiter_fa`, the parent classes of our backend. It cannot
be imported on this machine: at import it builds on vLLM's platform layer and AITER's compiled ROCm ops
and needs vLLM's full dependency set, which pins torch==2.14.0 (this project pins 2.13.0). The stand-in
has the two class names and only the members our subclasses use; `test_rocm_aiter_fa_source_has_what_
the_backend_builds_on` checks those names against the installed release's source file (read, not imported).
"""

import ast
import importlib.util
import logging
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or importlib.util.find_spec("aiter") is None,
    reason="vllm or amd-aiter is not installed (scripts/install_vllm_ci.sh, scripts/install_aiter_ci.sh)",
)

from aiter_stub import stand_ins  # noqa: E402

from aiter_fused import override, vllm_plugin  # noqa: E402

ROCM_AITER_FA = "vllm.v1.attention.backends.rocm_aiter_fa"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def registry():
    import vllm
    from vllm.v1.attention.backends import registry

    assert vllm.__version__ == "0.33.0", "the plugin's registry calls were written against vLLM 0.33.0"
    return registry


@pytest.fixture
def clean_switches(monkeypatch):
    for name in (override.DISABLE_ENV, override.FORMAT_ENV, override.EXACT_ENV, vllm_plugin.ENABLE_ENV):
        monkeypatch.delenv(name, raising=False)


class _StandInBackend:
    """Stand-in for vLLM 0.33.0's AiterFlashAttentionBackend (see the module docstring)."""

    supported_dtypes = [torch.float16, torch.bfloat16]

    @staticmethod
    def get_name():
        return "FLASH_ATTN"

    @classmethod
    def get_supported_head_sizes(cls):
        return [64, 128, 256]

    @classmethod
    def supports_sink(cls):
        return True

    @classmethod
    def supports_sliding_window(cls):
        return True


class _StandInImpl:
    """Stand-in for vLLM 0.33.0's AiterFlashAttentionImpl: records its constructor arguments."""

    def __init__(self, *args, **kwargs):
        self.arguments = (args, kwargs)


@pytest.fixture
def rocm_aiter_fa(monkeypatch):
    module = types.ModuleType(ROCM_AITER_FA)
    module.AiterFlashAttentionBackend = _StandInBackend
    module.AiterFlashAttentionImpl = _StandInImpl
    monkeypatch.setitem(sys.modules, ROCM_AITER_FA, module)
    monkeypatch.delitem(sys.modules, "aiter_fused.vllm_backend", raising=False)
    return module


@pytest.fixture
def aiter(tmp_path_factory):
    aiter = stand_ins.import_real_aiter(tmp_path_factory.mktemp("aiter_jit"))
    import aiter.ops.mha as mha

    originals = {name: getattr(mha, name) for name in ("_flash_attn_forward", "_flash_attn_varlen_forward")}
    yield aiter
    override._originals.clear()
    for name, function in originals.items():
        setattr(mha, name, function)


def test_plugin_registers_the_backend_name_in_vllms_registry(registry, clean_switches, caplog):
    with caplog.at_level(logging.INFO, logger="aiter_fused"):
        vllm_plugin.register()
    member = registry.AttentionBackendEnum["AITER_FUSED"]  # what --attention-backend AITER_FUSED parses to
    assert member.get_path() == vllm_plugin.BACKEND_CLASS == "aiter_fused.vllm_backend.AiterFusedBackend"
    assert member.is_overridden()
    assert vllm_plugin.register_vllm_backend()  # vLLM loads plugins several times per process
    assert registry.AttentionBackendEnum["AITER_FUSED"] is member
    assert not override.is_installed()


def test_a_foreign_registration_of_the_name_is_an_error(registry, clean_switches, monkeypatch):
    vllm_plugin.register_vllm_backend()
    member = registry.AttentionBackendEnum["AITER_FUSED"]
    monkeypatch.setitem(registry._ATTN_OVERRIDES, member, "someone.else.Backend")
    with pytest.raises(RuntimeError, match="AITER_FUSED is already registered to someone.else.Backend"):
        vllm_plugin.register_vllm_backend()


def test_registration_alone_imports_neither_the_backend_nor_aiter():
    """Without the opt-in the plugin binds a name and nothing more: no AITER import, no backend import."""
    code = (
        "import sys, logging; logging.basicConfig(level=logging.INFO)\n"
        "from aiter_fused import vllm_plugin; vllm_plugin.register()\n"
        "from vllm.v1.attention.backends.registry import AttentionBackendEnum as E\n"
        "print(E['AITER_FUSED'].get_path(), 'aiter' in sys.modules, 'aiter_fused.vllm_backend' in sys.modules)"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == ["aiter_fused.vllm_backend.AiterFusedBackend", "False", "False"]
    assert "AITER is left untouched" in result.stderr


def test_selected_backend_resolves_and_its_impl_installs_the_override(
    registry, clean_switches, rocm_aiter_fa, aiter, caplog
):
    """vLLM's path for `--attention-backend AITER_FUSED`: the enum member's class, looked up again by its
    get_name() (vLLM's attention layer does `AttentionBackendEnum[backend.get_name()]`), then the impl
    built in the worker: that is the opt-in, so the override is installed there, and logged."""
    vllm_plugin.register()
    assert not override.is_installed()
    backend = registry.AttentionBackendEnum["AITER_FUSED"].get_class()
    from aiter_fused.vllm_backend import AiterFusedBackend, AiterFusedImpl

    assert backend is AiterFusedBackend and issubclass(backend, rocm_aiter_fa.AiterFlashAttentionBackend)
    assert registry.AttentionBackendEnum[backend.get_name()] is registry.AttentionBackendEnum["AITER_FUSED"]
    assert backend.supported_dtypes == [torch.bfloat16] and backend.get_supported_head_sizes() == [64, 128]
    assert not backend.supports_sink() and not backend.supports_sliding_window()
    impl_cls = backend.get_impl_cls()
    assert impl_cls is AiterFusedImpl and issubclass(impl_cls, rocm_aiter_fa.AiterFlashAttentionImpl)
    with caplog.at_level(logging.INFO, logger="aiter_fused"):
        impl = impl_cls(8, 128, 128**-0.5, num_kv_heads=2)
    assert impl.arguments == ((8, 128, 128**-0.5), {"num_kv_heads": 2})
    assert override.is_installed() and "attention backend AITER_FUSED selected" in caplog.text


def test_selected_backend_honours_the_kill_switch(registry, clean_switches, rocm_aiter_fa, aiter, monkeypatch, caplog):
    vllm_plugin.register()
    monkeypatch.setenv(override.DISABLE_ENV, "1")
    impl_cls = registry.AttentionBackendEnum["AITER_FUSED"].get_class().get_impl_cls()
    with caplog.at_level(logging.WARNING, logger="aiter_fused"):
        impl_cls(8, 128, 128**-0.5)
    assert not override.is_installed() and "runs as ROCM_AITER_FA" in caplog.text


def test_rocm_aiter_fa_source_has_what_the_backend_builds_on(registry):
    """The installed vLLM's rocm_aiter_fa.py (parsed, not imported) defines the parents with the members
    our subclasses override, and its impl reaches AITER through flash_attn_varlen_func (the call the
    AITER override serves; Note [Which vLLM paths reach the fused kernel])."""
    source = Path(
        importlib.util.find_spec("vllm").submodule_search_locations[0], "v1/attention/backends/rocm_aiter_fa.py"
    )
    tree = ast.parse(source.read_text())
    classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
    members = {
        name: {
            item.name if not isinstance(item, ast.AnnAssign) else item.target.id
            for item in node.body
            if isinstance(item, (ast.FunctionDef, ast.AnnAssign))
        }
        for name, node in classes.items()
    }
    assert {
        "get_name",
        "get_impl_cls",
        "get_supported_head_sizes",
        "supports_sink",
        "supports_sliding_window",
        "supported_dtypes",
    } <= members["AiterFlashAttentionBackend"]
    assert {"__init__", "forward", "extend_forward"} <= members["AiterFlashAttentionImpl"]
    calls = [
        node.func.attr
        for node in ast.walk(classes["AiterFlashAttentionImpl"])
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
    ]
    assert calls.count("flash_attn_varlen_func") >= 3  # prefill, extend (context chunks and suffix), SWA
