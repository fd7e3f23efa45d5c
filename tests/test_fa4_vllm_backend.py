"""The `FA4_ROWMAX` vLLM attention backend (fa4_rowmax/vllm_plugin.py, vllm_routing.py, vllm_backend.py) against the
real vLLM package (vllm==0.33.0, installed --no-deps by scripts/install_vllm_ci.sh).

Real, run here: vLLM's attention backend registry and its `CUSTOM` slot, the plugin entry point, the softmax
setting's checks (fa4_rowmax.interface), the decode/prefill split, the cut decode metadata and the FA4 prefill
arguments on CPU tensors laid out as vLLM lays out its paged cache (`vllm.utils.torch_utils` included).
Read, not imported: vLLM's `vllm/v1/attention/backends/flash_attn.py` (the parent classes) and
`vllm/v1/attention/backend.py` (`validate_configuration`). Neither imports on this machine: both import
`vllm.model_executor` -> `vllm.distributed` -> `zmq` (`ModuleNotFoundError: No module named 'zmq'`), and past it
vLLM's serving stack (cbor2, aiohttp, openai, msgspec, cloudpickle, uvloop, prometheus_client, xgrammar, fastapi,
opentelemetry, ...; its full dependency set pins torch==2.14.0). So `validate_configuration` and the backend
classes do not run here; the source checks below pin what they consult and what the subclasses build on, and
the metadata the routing functions cut is a dataclass with FlashAttentionMetadata's fields read from that source.
"""

import ast
import dataclasses
import importlib.util
import logging
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm is not installed (scripts/install_vllm_ci.sh)"
)

from fa4_rowmax import vllm_plugin, vllm_routing  # noqa: E402
from fa4_rowmax.interface import softmax_stage  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SETTING_ENVS = (vllm_plugin.MODE_ENV, vllm_plugin.THRESHOLD_ENV, vllm_plugin.BETA_ENV)


def _vllm_source(relative: str) -> ast.Module:
    root = importlib.util.find_spec("vllm").submodule_search_locations[0]
    return ast.parse(Path(root, relative).read_text())


def _classes(tree: ast.Module) -> dict[str, ast.ClassDef]:
    return {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}


def _members(node: ast.ClassDef) -> dict[str, ast.AST]:
    members = {}
    for item in node.body:
        if isinstance(item, ast.FunctionDef):
            members[item.name] = item
        elif isinstance(item, ast.AnnAssign):
            members[item.target.id] = item
    return members


@pytest.fixture(scope="module")
def flash_attn_source():
    return _classes(_vllm_source("v1/attention/backends/flash_attn.py"))


@pytest.fixture
def registry():
    import vllm
    from vllm.v1.attention.backends import registry

    assert vllm.__version__ == "0.33.0", "the backend and these checks were written against vLLM 0.33.0"
    slot = registry.AttentionBackendEnum[vllm_plugin.VLLM_SLOT]
    before = registry._ATTN_OVERRIDES.pop(slot, None)
    yield registry
    registry._ATTN_OVERRIDES.pop(slot, None)
    if before is not None:
        registry._ATTN_OVERRIDES[slot] = before


@pytest.fixture
def no_setting(monkeypatch):
    for name in SETTING_ENVS:
        monkeypatch.delenv(name, raising=False)


# ----------------------------------------------------------------------------------------------------
# Registration and the setting.
# ----------------------------------------------------------------------------------------------------


def test_plugin_binds_the_custom_slot(registry, no_setting):
    slot = registry.AttentionBackendEnum["CUSTOM"]  # what --attention-backend CUSTOM parses to
    with pytest.raises(ValueError, match="must be registered before use"):
        slot.get_path()  # vLLM's own refusal of the empty slot: the plugin is what fills it
    vllm_plugin.register()
    assert slot.is_overridden() and slot.get_path() == vllm_plugin.BACKEND_CLASS
    assert vllm_plugin.BACKEND_CLASS == "fa4_rowmax.vllm_backend.FA4RowmaxBackend"
    assert vllm_plugin.register_vllm_backend()  # vLLM loads plugins several times per process
    assert registry._ATTN_OVERRIDES[slot] == vllm_plugin.BACKEND_CLASS


def test_a_slot_another_package_holds_is_left_to_it_with_a_warning(registry, no_setting, caplog):
    slot = registry.AttentionBackendEnum["CUSTOM"]
    registry.register_backend(slot, "someone.else.Backend")
    with caplog.at_level(logging.WARNING, logger="fa4_rowmax"):
        vllm_plugin.register()
    assert slot.get_path() == "someone.else.Backend"
    assert "slot CUSTOM is already registered to someone.else.Backend: FA4_ROWMAX not registered" in caplog.text


def test_the_entry_point_is_the_plugin():
    entry = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["vllm.general_plugins"]
    module, function = entry["fa4_rowmax"].split(":")
    assert getattr(importlib.import_module(module), function) is vllm_plugin.register


def test_registration_alone_imports_neither_the_backend_nor_fa4():
    """Unselected, the plugin binds a name and nothing more: no backend module, no FA4, no vLLM CUDA backend."""
    code = (
        "import sys\n"
        "from fa4_rowmax import vllm_plugin; vllm_plugin.register()\n"
        "from vllm.v1.attention.backends.registry import AttentionBackendEnum as E\n"
        "print(E['CUSTOM'].get_path(), *(name in sys.modules for name in ('fa4_rowmax.vllm_backend', "
        "'flash_attn.cute', 'vllm.v1.attention.backends.flash_attn')))"
    )
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.split() == [vllm_plugin.BACKEND_CLASS, "False", "False", "False"]


def test_the_setting_defaults_to_rowmax_h15(no_setting):
    assert vllm_plugin.softmax_setting().fa4_arguments() == dict(
        softmax_mode="rowmax_h15", rescale_threshold=None, beta=None
    )


def test_the_setting_is_read_from_its_variables(monkeypatch):
    monkeypatch.setenv(vllm_plugin.MODE_ENV, "rowmax_pot")
    monkeypatch.setenv(vllm_plugin.THRESHOLD_ENV, " 8 ")
    monkeypatch.setenv(vllm_plugin.BETA_ENV, "")  # empty: unset
    assert vllm_plugin.softmax_setting() == vllm_plugin.SoftmaxSetting("rowmax_pot", 8.0, None)
    monkeypatch.setenv(vllm_plugin.MODE_ENV, "exact")
    monkeypatch.setenv(vllm_plugin.BETA_ENV, "0.5")
    assert vllm_plugin.softmax_setting() == vllm_plugin.SoftmaxSetting("exact", 8.0, 0.5)


@pytest.mark.parametrize(
    "name, value, message",
    [
        (vllm_plugin.MODE_ENV, "rowmax", r"softmax_mode must be one of \('exact', 'rowmax_h15', 'rowmax_pot'\)"),
        (vllm_plugin.MODE_ENV, "baps", "softmax_mode must be one of"),
        (vllm_plugin.THRESHOLD_ENV, "-1", "rescale_threshold must be None"),
        (vllm_plugin.THRESHOLD_ENV, "eight", "is not a number"),
        (vllm_plugin.BETA_ENV, "2", r"beta must be None or a number in \[0, 1\]"),
        (vllm_plugin.BETA_ENV, "nan", "beta must be None"),
    ],
)
def test_a_bad_setting_is_an_error_naming_the_variable(registry, no_setting, monkeypatch, name, value, message):
    """In every process, selected or not: register() checks the setting before it binds the slot."""
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=rf"^environment variable {name}\b.*{message}"):
        vllm_plugin.register()
    assert not registry.AttentionBackendEnum["CUSTOM"].is_overridden()


# ----------------------------------------------------------------------------------------------------
# The decode/prefill split and the two calls' arguments, on a batch laid out as vLLM lays it out.
# ----------------------------------------------------------------------------------------------------


def _offsets(lengths, padding=0):
    """query_start_loc_cpu: int32 offsets, `padding` repeats of the last one past num_reqs (vLLM pads them)."""
    values = [0]
    for length in lengths:
        values.append(values[-1] + length)
    return torch.tensor(values + [values[-1]] * padding, dtype=torch.int32)


@pytest.mark.parametrize(
    "query_lens",
    [(1, 1, 1), (5, 300, 2), (1, 1, 7, 2, 129), (1, 0, 4), (1, 16, 0, 3), ()],
    ids=["decodes", "prefills", "mixed", "zero-length-after-decode", "zero-length-among-prefills", "empty"],
)
def test_split_batch_counts_the_leading_decodes(query_lens):
    split = vllm_routing.split_batch(_offsets(query_lens, padding=3), len(query_lens))
    decodes = next((i for i, n in enumerate(query_lens) if n > 1), len(query_lens))
    assert split == vllm_routing.BatchSplit(
        num_decodes=decodes,
        num_prefills=len(query_lens) - decodes,
        num_decode_tokens=sum(query_lens[:decodes]),
        num_prefill_tokens=sum(query_lens[decodes:]),
    )


def test_split_batch_refuses_a_decode_after_a_prefill():
    with pytest.raises(RuntimeError, match=r"decodes \(query length 1\) before prefills.*\[1, 5, 1, 3\]"):
        vllm_routing.split_batch(_offsets((1, 5, 1, 3)), 4)


def _metadata_class(flash_attn_source):
    """A dataclass with FlashAttentionMetadata's fields, names and defaults as vLLM 0.33.0's source declares them."""
    node = flash_attn_source["FlashAttentionMetadata"]
    spec = []
    for item in node.body:
        if isinstance(item, ast.AnnAssign):
            default = ast.literal_eval(item.value) if item.value is not None else dataclasses.MISSING
            spec.append((item.target.id, object, dataclasses.field(default=default)))
    return dataclasses.make_dataclass("FlashAttentionMetadata", spec)


def _paged_batch(query_lens, context_lens, *, block_size=16, kv_heads=2, head_size=64, seed=0):
    """A batch as vLLM 0.33.0 holds it: K/V of every token (context + new) written in a cache of shape
    (blocks, kv heads, block size, 2 * head size) through a shuffled block table; returns the cache, the
    block table, seq_lens, slot_mapping of the new tokens and each sequence's K and V."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    width = max(blocks_per_seq) + 1
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks
    order = torch.randperm(num_blocks, generator=gen).to(torch.int32)
    kv_cache = torch.randn(num_blocks, kv_heads, block_size, 2 * head_size, generator=gen)
    block_table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    keys, values, slots, used = [], [], [], 0
    for i, (n, blocks) in enumerate(zip(seq_lens, blocks_per_seq)):
        block_table[i, :blocks] = order[used : used + blocks]
        used += blocks
        k, v = torch.randn(2, n, kv_heads, head_size, generator=gen)
        for position in range(n):
            block, offset = block_table[i, position // block_size], position % block_size
            kv_cache[block, :, offset] = torch.cat([k[position], v[position]], dim=-1)
            if position >= context_lens[i]:
                slots.append(int(block) * block_size + offset)
        keys.append(k)
        values.append(v)
    return kv_cache, block_table, torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(slots), keys, values


def test_decode_cut_and_prefill_arguments_select_each_sequences_queries_and_keys(flash_attn_source):
    """Decodes then prefills (one fresh, two after a cached prefix, one of length 16 = a block): the cut metadata
    holds exactly the decodes; the FA4 arguments, applied as FA4 applies them (query rows by cu_seqlens_q, keys
    through page_table up to seqused_k, pages from paged_kv), give each prefill its own queries and every key of
    its sequence, context included, in order."""
    query_lens, context_lens = (1, 1, 37, 16, 5, 20), (40, 3, 0, 21, 100, 0)
    kv_cache, block_table, seq_lens, slots, keys, values = _paged_batch(query_lens, context_lens)
    query_start_loc = _offsets(query_lens)
    num_tokens = int(query_start_loc[-1])
    metadata = _metadata_class(flash_attn_source)(
        num_actual_tokens=num_tokens,
        max_query_len=max(query_lens),
        query_start_loc=query_start_loc,
        max_seq_len=int(seq_lens.max()),
        seq_lens=seq_lens,
        block_table=block_table,
        slot_mapping=slots,
        scheduler_metadata=torch.ones(9, dtype=torch.int32),
    )
    split = vllm_routing.split_batch(query_start_loc, len(query_lens))
    assert (split.num_decodes, split.num_decode_tokens) == (2, 2)

    cut = vllm_routing.decode_metadata(metadata, split)
    assert type(cut) is type(metadata) and metadata.num_actual_tokens == num_tokens  # a copy; the batch's intact
    assert (cut.num_actual_tokens, cut.max_query_len, cut.scheduler_metadata) == (2, 1, None)
    assert cut.query_start_loc.tolist() == [0, 1, 2]
    assert torch.equal(cut.seq_lens, seq_lens[:2]) and torch.equal(cut.block_table, block_table[:2])
    assert torch.equal(cut.slot_mapping, slots[:2])

    arguments = vllm_routing.prefill_arguments(metadata, split)
    assert set(arguments) == {"cu_seqlens_q", "max_seqlen_q", "seqused_k", "page_table"}
    assert arguments["cu_seqlens_q"].dtype == arguments["page_table"].dtype == torch.int32
    assert arguments["max_seqlen_q"] >= max(query_lens[2:])
    query = torch.arange(num_tokens)  # token ids stand in for the query rows
    prefill_query = query[split.num_decode_tokens : num_tokens]
    key_cache, value_cache = vllm_routing.paged_kv(kv_cache, keys[0].shape[-1])
    block_size = key_cache.shape[1]
    cu = arguments["cu_seqlens_q"].tolist()
    assert cu[0] == 0 and len(cu) == split.num_prefills + 1
    for i in range(split.num_prefills):
        sequence = split.num_decodes + i
        rows = prefill_query[cu[i] : cu[i + 1]]
        assert rows.tolist() == list(range(int(query_start_loc[sequence]), int(query_start_loc[sequence + 1])))
        n = int(arguments["seqused_k"][i])
        assert n == context_lens[sequence] + query_lens[sequence]
        pages = arguments["page_table"][i, : -(-n // block_size)].long()
        k = key_cache[pages].reshape(-1, *key_cache.shape[2:])[:n]
        v = value_cache[pages].reshape(-1, *value_cache.shape[2:])[:n]
        assert torch.equal(k, keys[sequence]) and torch.equal(v, values[sequence])


def test_paged_kv_matches_the_stock_forward_and_fa4s_paged_shape(flash_attn_source):
    """paged_kv is the stock forward's view of the cache (the same expression, read from its source) and the
    (blocks, block size, kv heads, head size) FA4's page_table path asserts; with one KV head its strides are
    made canonical, as the stock forward makes them for TMA."""
    forward = _members(flash_attn_source["FlashAttentionImpl"])["forward"]
    assert "kv_cache.transpose(1, 2).split(self.head_size, dim=-1)" in ast.unparse(forward)
    assert "canonicalize_singleton_dim_strides(key_cache)" in ast.unparse(forward)
    kv_cache = torch.randn(5, 1, 16, 2 * 64)
    k, v = vllm_routing.paged_kv(kv_cache, 64)
    assert k.shape == v.shape == (5, 16, 1, 64)
    assert torch.equal(k, kv_cache.transpose(1, 2)[..., :64]) and torch.equal(v, kv_cache.transpose(1, 2)[..., 64:])
    assert k.stride(-1) == 1 and k.stride(2) == 64  # the singleton head dimension: its natural stride


# ----------------------------------------------------------------------------------------------------
# Which layers go to FA4.
# ----------------------------------------------------------------------------------------------------

PLAIN_LAYER = dict(alibi_slopes=None, logits_soft_cap=0, sliding_window=(-1, -1), sinks=None, kv_cache_dtype="auto")


@pytest.mark.parametrize(
    "feature, value, named",
    [
        ("alibi_slopes", torch.ones(4), "ALiBi"),
        ("logits_soft_cap", 30.0, "softcap"),
        ("sliding_window", (4095, 0), "a sliding window"),
        ("sinks", torch.zeros(4), "attention sinks"),
        ("kv_cache_dtype", "fp8_e4m3", "KV cache dtype 'fp8_e4m3'"),
    ],
)
def test_a_layer_with_an_unserved_feature_runs_stock(feature, value, named):
    reason = vllm_routing.layer_stock_reason(
        vllm_plugin.SoftmaxSetting(), arch=90, dtype=torch.bfloat16, **{**PLAIN_LAYER, feature: value}
    )
    assert reason == f"the layer has {named}, which FA4_ROWMAX does not serve"


def test_an_fp8_model_dtype_runs_stock():
    reason = vllm_routing.layer_stock_reason(
        vllm_plugin.SoftmaxSetting(), arch=90, dtype=torch.float8_e4m3fn, **PLAIN_LAYER
    )
    assert reason == "the layer has dtype torch.float8_e4m3fn, which FA4_ROWMAX does not serve"


@pytest.mark.parametrize("arch", [90, 100, 103, 110])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["rowmax_h15", "rowmax_pot"])
def test_a_plain_layer_goes_to_fa4_exactly_when_the_stage_takes_vllms_layout(arch, dtype, mode):
    """The stage's own check decides (Note [Features allowed with a softmax stage]): the layer goes to FA4 when
    `for_kernel` accepts cu_seqlens_q, seqused_k and page_table for this arch and dtype, and runs stock, naming
    the stage's refusal, when it does not."""
    setting = vllm_plugin.SoftmaxSetting(mode)
    try:
        softmax_stage(mode).for_kernel(arch=arch, q_dtype=dtype, features=vllm_routing.prefill_features())
        refusal = None
    except ValueError as error:
        refusal = str(error)
    reason = vllm_routing.layer_stock_reason(setting, arch=arch, dtype=dtype, **PLAIN_LAYER)
    if refusal is None:
        assert reason is None
    else:
        assert (
            reason.startswith(f"the softmax stage refuses vLLM's prefill layout on arch {arch}") and refusal in reason
        )
        assert any(name in refusal for name in ("cu_seqlens_q", "seqused_k", "page_table"))


def test_the_stage_refusal_reaches_the_layer_on_a_gpu_without_the_stage():
    """SM80 and SM120 have no softmax stage: the approximate modes refuse them, so such a layer runs stock."""
    for arch in (80, 120):
        reason = vllm_routing.layer_stock_reason(
            vllm_plugin.SoftmaxSetting(), arch=arch, dtype=torch.bfloat16, **PLAIN_LAYER
        )
        assert reason.startswith(f"the softmax stage refuses vLLM's prefill layout on arch {arch}"), reason


def test_exact_without_knobs_is_stock_fa4_on_every_layout():
    assert softmax_stage("exact") is None  # the patched FA4 runs stock code, every feature
    for arch in (80, 90, 100):
        setting = vllm_plugin.SoftmaxSetting("exact")
        assert vllm_routing.layer_stock_reason(setting, arch=arch, dtype=torch.bfloat16, **PLAIN_LAYER) is None


# ----------------------------------------------------------------------------------------------------
# What the backend builds on in vLLM 0.33.0's source, and what validate_configuration consults.
# ----------------------------------------------------------------------------------------------------

# FA4RowmaxBackend's overrides (fa4_rowmax/vllm_backend.py), each consulted by validate_configuration.
DECLARATIONS = {
    "supports_head_size",
    "supports_dtype",
    "supports_kv_cache_dtype",
    "supports_sink",
    "supports_compute_capability",
    "supports_attn_type",
    "supports_sliding_window",
    "supports_rswa",
    "supports_mm_prefix",
    "supports_non_causal",
    "supports_per_head_quant_scales",
    "supports_batch_invariance",
    "supports_dcp",
    "supports_device_cpu_query_lens_mismatch",
}


def _own_backend_classes():
    return _classes(ast.parse((REPO / "fa4_rowmax" / "vllm_backend.py").read_text()))


def test_validate_configuration_consults_every_declaration():
    backend = _classes(_vllm_source("v1/attention/backend.py"))
    validate = _members(backend["AttentionBackend"])["validate_configuration"]
    consulted = {
        node.func.attr
        for node in ast.walk(validate)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.value.id == "cls"
    }
    assert DECLARATIONS <= consulted, DECLARATIONS - consulted
    # supports_dtype / supports_kv_cache_dtype read the class lists the backend sets; supports_dcp the impl's flag
    base = ast.unparse(backend["AttentionBackend"])
    for name in ("dtype in cls.supported_dtypes", "kv_cache_dtype in cls.supported_kv_cache_dtypes"):
        assert name in base
    assert "cls.get_impl_cls().supports_dcp" in base
    ours = _own_backend_classes()
    declared = set(_members(ours["FA4RowmaxBackend"])) | {"supports_dtype", "supports_kv_cache_dtype", "supports_dcp"}
    assert DECLARATIONS <= declared
    assert {"supported_dtypes", "supported_kv_cache_dtypes"} <= set(_members(ours["FA4RowmaxBackend"]))
    assert "supports_dcp" in _members(ours["FA4RowmaxImpl"])


def test_flash_attn_backend_has_what_the_subclasses_build_on(flash_attn_source):
    members = {name: set(_members(node)) for name, node in flash_attn_source.items()}
    ours = _own_backend_classes()
    own_backend = set(_members(ours["FA4RowmaxBackend"])) - {"supported_dtypes", "supported_kv_cache_dtypes"}
    # Every classmethod the backend overrides exists on the parent or its base (so vLLM calls it).
    base = set(_members(_classes(_vllm_source("v1/attention/backend.py"))["AttentionBackend"]))
    assert own_backend <= members["FlashAttentionBackend"] | base, own_backend - members["FlashAttentionBackend"] - base
    assert {"get_name", "get_impl_cls", "get_builder_cls", "supports_head_size"} <= members["FlashAttentionBackend"]
    assert {"__init__", "forward"} <= members["FlashAttentionImpl"]
    assert {"build", "get_cudagraph_support"} <= members["FlashAttentionMetadataBuilder"]
    # The forward and build signatures the overrides repeat.
    for cls, method in (("FlashAttentionImpl", "forward"), ("FlashAttentionMetadataBuilder", "build")):
        parent = _members(flash_attn_source[cls])[method].args
        own = _members(ours[cls.replace("FlashAttention", "FA4Rowmax")])[method].args
        assert [a.arg for a in own.args] == [a.arg for a in parent.args]
        assert len(own.defaults) == len(parent.defaults)
    # The impl attributes layer_stock_reason reads are set by the parent's __init__.
    init = _members(flash_attn_source["FlashAttentionImpl"])["__init__"]
    assigned = {
        target.attr
        for node in ast.walk(init)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Attribute)
    }
    assert {"alibi_slopes", "logits_soft_cap", "sliding_window", "sinks", "kv_cache_dtype", "scale"} <= assigned
    assert "self.sliding_window = (-1, -1)" in ast.unparse(init)  # "no window", as layer_stock_reason reads it


def test_the_metadata_fields_the_routing_sets_exist(flash_attn_source):
    """decode_metadata assigns on a copy: a misspelt field would add an attribute the stock forward never reads."""
    fields = {f.name for f in dataclasses.fields(_metadata_class(flash_attn_source))}
    routing = ast.parse((REPO / "fa4_rowmax" / "vllm_routing.py").read_text())
    assigned = {
        target.attr
        for node in ast.walk(routing)
        if isinstance(node, ast.Assign)
        for target in node.targets
        if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "cut"
    }
    read = {
        node.attr
        for node in ast.walk(routing)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "metadata"
    }
    assert assigned and read
    assert assigned | read <= fields, (assigned | read) - fields


def test_the_builder_hooks_exist_in_vllm():
    """reorder_batch_threshold (the runner's reorder), UNIFORM_SINGLE_TOKEN_DECODE, query_start_loc_cpu and
    num_reqs on CommonAttentionMetadata: what FA4RowmaxMetadataBuilder relies on."""
    backend = _classes(_vllm_source("v1/attention/backend.py"))
    assert "reorder_batch_threshold" in _members(backend["AttentionMetadataBuilder"])
    support = {t.id for n in backend["AttentionCGSupport"].body if isinstance(n, ast.Assign) for t in n.targets}
    assert "UNIFORM_SINGLE_TOKEN_DECODE" in support
    assert {"query_start_loc_cpu", "num_reqs"} <= set(_members(backend["CommonAttentionMetadata"]))
    runner = _vllm_source("v1/worker/gpu_model_runner.py")
    assert "group.get_metadata_builder().reorder_batch_threshold" in ast.unparse(runner)
