"""Properties of the host-side resolution (`fa4_rowmax.interface`: softmax_stage, SoftmaxStage.for_kernel,
reference_config) and of the SM90 FP8 forward's host checks (`fa4_rowmax.fp8_sm90`), which run before any GPU
work: here on fake CUDA tensors (FakeTensorMode) and CPU tensors.

- every call either returns a stage that holds what was asked, or raises TypeError/ValueError naming an argument
  it was given, and a refusal never lists the refused value among the accepted ones;
- a resolved stage gives a valid reference configuration;
- the FP8 forward refuses each bad argument by name before touching the GPU.
Budgets: Note [Hypothesis profiles] in tests/conftest.py.
"""

import math
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from property_helpers import BAD_POSITIVE_REALS, NOT_A_BOOL, assert_refused_naming, examples, real_like_values
from torch._subclasses.fake_tensor import FakeTensorMode

from fa4_rowmax.config import KERNEL_MODES, STAGE_KNOBS, SoftmaxConfig
from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90
from fa4_rowmax.interface import SoftmaxStage, softmax_stage

E4M3 = torch.float8_e4m3fn


def _knob_values(name):
    """A knob's accepted values, and look-alikes of other types."""
    knob = STAGE_KNOBS[name]
    junk = [None, "yes", 1, 1.0, 128.0, True, "exact", -1, 10**400]
    return st.sampled_from(list(knob.accepted) + junk)


knob_settings = st.dictionaries(st.sampled_from(sorted(STAGE_KNOBS)), st.none(), max_size=3).flatmap(
    lambda chosen: st.fixed_dictionaries({name: _knob_values(name) for name in chosen})
)
modes = st.sampled_from(KERNEL_MODES + ("baps", "Exact", "", "rowmax"))
thresholds_or_betas = st.one_of(st.none(), real_like_values)


def _accepted_part(message: str) -> str:
    """The text between "must be" / "accepted" and "got" (what the error says it takes)."""
    match = re.search(r"(must be|accepted[^:]*:)(.*?)(;|,)?\s*got\b", message, flags=re.S)
    return match.group(2) if match else ""


def assert_refusal_is_honest(error: BaseException, value) -> None:
    """A refusal of `value` does not list it as accepted ('must be one of [... 'torch.float32' ...]; got
    torch.float32')."""
    accepted = _accepted_part(str(error))
    for spelling in {repr(value), str(value)}:
        if len(spelling) > 2 and re.search(rf"(?<![\w.]){re.escape(spelling)}(?![\w.])", accepted):
            raise AssertionError(f"the refusal lists the refused value {spelling} as accepted: {error}")


@examples(150)
@given(mode=modes, threshold=thresholds_or_betas, beta=thresholds_or_betas, knobs=knob_settings)
def test_softmax_stage_returns_what_was_asked_or_names_an_argument(mode, threshold, beta, knobs):
    names = ("softmax_mode", "rescale_threshold", "beta", "requires_grad", *knobs)
    try:
        stage = softmax_stage(mode, threshold, beta, **knobs)
    except (TypeError, ValueError) as error:
        assert any(re.search(rf"\b{re.escape(n)}\b", str(error)) for n in names), error
        return
    if stage is None:  # stock FA4: exact, no threshold, no beta, every knob at its default
        assert mode == "exact" and threshold is None and beta is None
        assert all(value == STAGE_KNOBS[name].default for name, value in knobs.items())
        return
    assert isinstance(stage, SoftmaxStage) and stage.mode == mode
    for name, value in dict(rescale_threshold=threshold, beta=beta).items():
        got = getattr(stage, name)
        assert (got is None) if value is None else (isinstance(got, float) and got == float(value)), (name, got)
    for name, value in knobs.items():
        assert getattr(stage, name) == value and type(getattr(stage, name)) is type(value), name


ARCHS = (80, 90, 100, 103, 110, 120, 9, "90", None, 90.0)
Q_DTYPES = (torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float8_e5m2, torch.float32, "bfloat16", None)


@examples(150)
@given(
    mode=st.sampled_from(KERNEL_MODES),
    threshold=st.one_of(st.none(), st.floats(0, 40), st.integers(0, 12)),
    knobs=knob_settings,
    arch=st.sampled_from(ARCHS),
    q_dtype=st.sampled_from(Q_DTYPES),
    tile_n=st.sampled_from((32, 64, 128)),
)
def test_for_kernel_resolves_or_names_an_argument(mode, threshold, knobs, arch, q_dtype, tile_n):
    try:
        stage = softmax_stage(mode, threshold, None, **knobs)
    except (TypeError, ValueError):
        return  # the first property's subject
    stage = stage or SoftmaxStage()
    try:
        resolved = stage.for_kernel(arch=arch, q_dtype=q_dtype)
    except (TypeError, ValueError) as error:
        names = ("arch", "q_dtype", "rescale_threshold", "softmax_mode", "beta", *STAGE_KNOBS)
        assert any(re.search(rf"\b{re.escape(n)}\b", str(error)) for n in names), error
        for given_value in (arch, q_dtype):
            if "q_dtype" in str(error) or "arch" in str(error):
                assert_refusal_is_honest(error, given_value)
        return
    assert resolved.arch == arch and resolved.q_dtype == q_dtype
    assert math.isfinite(resolved.rescale_threshold) and resolved.rescale_threshold >= 0
    config = resolved.reference_config(tile_n=tile_n)
    assert isinstance(config, SoftmaxConfig) and config.mode == mode and config.tile_n == tile_n


@pytest.mark.parametrize("arch", ["90", None, 90.0, 100.0, True, 9.5], ids=repr)
def test_for_kernel_refuses_an_arch_that_is_not_an_int_by_name(arch):
    """90.0 compares equal to 90 and True floor-divides, so only a type check keeps them out of the cache key."""
    with pytest.raises(TypeError, match=r"\barch\b.*90, 100, 103, 110") as refusal:
        SoftmaxStage().for_kernel(arch=arch, q_dtype=torch.bfloat16)
    assert_refusal_is_honest(refusal.value, arch)


def _fake_fp8_inputs(batch=1, seqlen=128, heads_q=2, heads_kv=1, head_dim=128, device="cuda"):
    q = torch.empty(batch, seqlen, heads_q, head_dim, dtype=E4M3, device=device)
    k = torch.empty(batch, seqlen, heads_kv, head_dim, dtype=E4M3, device=device)
    return q, k, torch.empty_like(k)


def _bad_fp8_calls():
    """(label, keyword arguments, names the error must mention), every argument of flash_attn_fp8_sm90."""
    cases = [(f"causal {label}", dict(causal=value), ("causal",)) for label, value in NOT_A_BOOL]
    cases += [(f"softmax_scale {label}", dict(softmax_scale=v), ("softmax_scale",)) for label, v in BAD_POSITIVE_REALS]
    cases += [(f"validate {label}", dict(validate=value), ("validate",)) for label, value in NOT_A_BOOL]
    for name in ("exp2_deleted", "rescale_vote"):
        cases += [(f"{name} {label}", {name: value}, (name,)) for label, value in NOT_A_BOOL]
    for value in (128.0, True, "128", 96, 288):
        cases.append((f"tile_n {value!r}", dict(tile_n=value), ("tile_n",)))
    for label, value in [("bool", True), ("nan", math.nan), ("negative", -1.0), ("str", "8")]:
        cases.append((f"rescale_threshold {label}", dict(rescale_threshold=value), ("rescale_threshold",)))
    for label, value in [("bool", True), ("above 1", 1.5), ("nan", math.nan)]:
        cases.append((f"beta {label}", dict(beta=value), ("beta",)))
    cases += [
        ("softmax_mode pot", dict(softmax_mode="rowmax_pot"), ("softmax_mode",)),
        ("softmax_mode junk", dict(softmax_mode="fast"), ("softmax_mode",)),
        ("unknown knob", dict(tile_m=64), ("tile_m", "knobs")),
        ("q_descale dtype", dict(q_descale="1"), ("q_descale",)),
    ]
    return cases


@pytest.mark.parametrize("case", _bad_fp8_calls(), ids=lambda case: case[0])
def test_fp8_forward_names_each_bad_argument_before_any_gpu_work(case):
    _, kwargs, names = case
    with FakeTensorMode():
        q, k, v = _fake_fp8_inputs()
        assert_refused_naming(lambda: flash_attn_fp8_sm90(q, k, v, **kwargs), names)


@pytest.mark.parametrize(
    "label, shapes, names",
    [
        ("zero q heads", dict(heads_q=0), ("heads", "q")),
        ("zero kv heads", dict(heads_kv=0), ("heads", "k")),
        ("head_dim 256", dict(head_dim=256), ("head_dim",)),
        ("head_dim 96", dict(head_dim=96), ("head_dim",)),
        ("GQA remainder", dict(heads_q=3, heads_kv=2), ("heads",)),
    ],
    ids=lambda x: x if isinstance(x, str) else "",
)
def test_fp8_forward_names_bad_shapes(label, shapes, names):
    with FakeTensorMode():
        q, k, v = _fake_fp8_inputs(**shapes)
        assert_refused_naming(lambda: flash_attn_fp8_sm90(q, k, v), names)


@examples(20)
@given(
    which=st.sampled_from(("q", "k", "v")),
    dtype=st.sampled_from((torch.bfloat16, torch.float16, torch.float32, torch.float8_e5m2, torch.int8)),
)
def test_fp8_forward_names_a_wrong_dtype(which, dtype):
    with FakeTensorMode():
        inputs = dict(zip(("q", "k", "v"), _fake_fp8_inputs()))
        inputs[which] = torch.empty(inputs[which].shape, dtype=dtype, device="cuda")
        assert_refused_naming(lambda: flash_attn_fp8_sm90(**inputs), (which,))


def test_fp8_forward_refuses_cpu_tensors_by_name():
    q, k, v = _fake_fp8_inputs(device="cpu")
    assert_refused_naming(lambda: flash_attn_fp8_sm90(q, k, v), ("q, k and v", "q"))
