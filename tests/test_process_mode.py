"""The process-wide softmax mode (Note [Process-wide softmax mode], fa4_rowmax/process_mode.py).

On the host: the stage the environment variables or a scope produce against the explicit arguments' stage, the
precedence rules, bad values, refusals naming the variable, the stderr line, the scope's nesting. Through the
patched FA4 itself (a patched copy in a subprocess, fake CUDA tensors): the compile key each call reaches, against
stock FA4's. On an H200: outputs bit for bit.
"""

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from fa4_rowmax import patching as fa4_patch
from fa4_rowmax import process_mode
from fa4_rowmax.interface import FEATURE_STOCK_VALUES, FEATURES_TESTED_16BIT, softmax_stage
from fa4_rowmax.process_mode import SCOPE, VARIABLES, softmax_mode_scope

ROOT = Path(__file__).resolve().parent.parent
MODE, THRESHOLD, BETA = (VARIABLES[a] for a in ("softmax_mode", "rescale_threshold", "beta"))


@pytest.fixture(autouse=True)
def no_process_setting(monkeypatch):
    for variable in VARIABLES.values():
        monkeypatch.delenv(variable, raising=False)
    assert process_mode.current() is None  # no scope left open by another test


def _set(monkeypatch, mode=None, threshold=None, beta=None):
    for variable, value in ((MODE, mode), (THRESHOLD, threshold), (BETA, beta)):
        if value is not None:
            monkeypatch.setenv(variable, value)


# --- on, off, precedence ---------------------------------------------------------------------------


def test_nothing_set_is_stock():
    assert process_mode.from_environment() is None
    assert softmax_stage(None) is None
    assert softmax_stage(None, requires_grad=True) is None
    # a knob the call passes still makes exact with a knob, as before the process setting existed
    assert softmax_stage(None, 4.0) == softmax_stage("exact", 4.0)


@pytest.mark.parametrize(
    "mode, threshold, beta",
    [("rowmax_h15", None, None), ("rowmax_h15", 8.0, None), ("rowmax_pot", 0.5, 1.0), ("exact", None, 0.25)],
)
def test_the_environment_gives_the_explicit_stage(monkeypatch, mode, threshold, beta):
    _set(monkeypatch, mode, None if threshold is None else str(threshold), None if beta is None else str(beta))
    explicit = softmax_stage(mode, threshold, beta)
    from_env = softmax_stage(None)
    assert from_env == explicit and hash(from_env) == hash(explicit) and repr(from_env) == repr(explicit)
    assert from_env.source("softmax_mode") == MODE and explicit.source("softmax_mode") is None
    for arch, dtype in ((90, torch.bfloat16), (100, torch.float16), (90, torch.float8_e4m3fn)):
        if arch == 90 and dtype == torch.float8_e4m3fn and mode == "rowmax_pot":
            continue  # the SM90 FP8 forward has no PoT: test_fp8_path_under_the_environment
        if arch == 90 and dtype == torch.float8_e4m3fn and threshold is not None:
            continue  # past FP8's range rule: test_fp8_path_under_the_environment
        assert from_env.for_kernel(arch=arch, q_dtype=dtype) == explicit.for_kernel(arch=arch, q_dtype=dtype)


def test_exact_from_the_environment_is_stock(monkeypatch):
    _set(monkeypatch, "exact")
    assert softmax_stage(None) is None


def test_a_scope_gives_the_explicit_stage_and_wins_over_the_environment(monkeypatch):
    _set(monkeypatch, "rowmax_pot", "1.0")
    with softmax_mode_scope("rowmax_h15", rescale_threshold=8.0) as setting:
        assert setting.source("softmax_mode") == SCOPE
        stage = softmax_stage(None)
        assert stage == softmax_stage("rowmax_h15", 8.0) and stage.source("rescale_threshold") == SCOPE
        with softmax_mode_scope("exact"):
            assert softmax_stage(None) is None  # a scope of exact turns the variables off within
    assert softmax_stage(None) == softmax_stage("rowmax_pot", 1.0)


def test_an_explicit_argument_wins(monkeypatch):
    _set(monkeypatch, "rowmax_h15", "8", "1")
    assert softmax_stage("exact") is None  # an explicit mode takes nothing from the process
    assert softmax_stage("rowmax_pot") == softmax_stage("rowmax_pot", None, None)
    assert softmax_stage("rowmax_pot").sources == ()
    # mode left out: the process mode, the call's knobs over the process's
    stage = softmax_stage(None, 2.0)
    assert stage == softmax_stage("rowmax_h15", 2.0, 1.0)
    assert dict(stage.sources) == {"softmax_mode": MODE, "beta": BETA}
    assert softmax_stage(None, None, 0.5) == softmax_stage("rowmax_h15", 8.0, 0.5)
    with softmax_mode_scope("rowmax_h15", rescale_threshold=8.0):
        assert softmax_stage("exact") is None


# --- bad values ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "variable, value, accepted",
    [
        (MODE, "h15", r"one of \('exact', 'rowmax_h15', 'rowmax_pot'\)"),
        (MODE, "ROWMAX_H15", "rowmax_h15"),
        (MODE, "", "rowmax_h15"),
        (MODE, "rowmax_h15 ", "rowmax_h15"),
        (THRESHOLD, "-1", ">= 0"),
        (THRESHOLD, "nan", ">= 0"),
        (THRESHOLD, "inf", ">= 0"),
        (THRESHOLD, "eight", ">= 0"),
        (THRESHOLD, "", ">= 0"),
        (BETA, "1.5", r"\[0, 1\]"),
        (BETA, "-0.25", r"\[0, 1\]"),
        (BETA, "none", r"\[0, 1\]"),
    ],
)
def test_a_bad_value_names_its_variable_and_the_accepted_values(monkeypatch, variable, value, accepted):
    _set(monkeypatch, "rowmax_h15")
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=rf"^{variable} must be .*{accepted}.*got {value!r}"):
        softmax_stage(None)
    assert softmax_stage("rowmax_h15") is not None  # a call that passes softmax_mode does not read them


@pytest.mark.parametrize("knobs", [(THRESHOLD,), (BETA,), (THRESHOLD, BETA)])
def test_a_knob_variable_without_the_mode_is_refused(monkeypatch, knobs):
    for variable in knobs:
        monkeypatch.setenv(variable, "0.5")
    with pytest.raises(ValueError, match=rf"^{' and '.join(knobs)} set without {MODE}: set {MODE} to one of"):
        softmax_stage(None)


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (dict(softmax_mode="h15"), ValueError, "softmax_mode must be one of"),
        (dict(softmax_mode=None), TypeError, "softmax_mode must be a str"),
        (dict(softmax_mode="rowmax_h15", rescale_threshold=-1.0), ValueError, "rescale_threshold must be .*>= 0"),
        (dict(softmax_mode="rowmax_h15", rescale_threshold="8"), TypeError, "rescale_threshold"),
        (dict(softmax_mode="rowmax_h15", beta=2.0), ValueError, r"beta must be .*\[0, 1\]"),
    ],
)
def test_a_bad_scope_argument_is_refused_and_opens_nothing(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        with softmax_mode_scope(**kwargs):
            pytest.fail("the scope opened")
    assert process_mode.current() is None


# --- refusals name the source ----------------------------------------------------------------------

# FA4 features a softmax stage refuses whatever FEATURES_TESTED_16BIT gains for the serving layouts (they rewrite the
# scores or skip tiles; Note [Features allowed with a softmax stage]), with a non-stock value.
_REFUSED = {
    "softcap": 30.0,
    "window_size_left": 128,
    "window_size_right": 0,
    "learnable_sink": torch.zeros(4),
    "num_splits": 2,
    "score_mod": lambda *a: a[0],
    "mask_mod": lambda *a: True,
    "qv": torch.zeros(1),
}


@pytest.mark.parametrize("name", sorted(_REFUSED))
def test_a_refused_feature_names_the_variable(monkeypatch, name):
    assert name in FEATURE_STOCK_VALUES and name not in FEATURES_TESTED_16BIT
    _set(monkeypatch, "rowmax_h15")
    stage = softmax_stage(None)
    pattern = rf"^{name} is not supported with softmax_mode='rowmax_h15' from {MODE} and its knobs.*unset {MODE}"
    with pytest.raises(ValueError, match=pattern):
        stage.for_kernel(arch=90, q_dtype=torch.bfloat16, features={name: _REFUSED[name]})
    with softmax_mode_scope("rowmax_h15"):
        with pytest.raises(ValueError, match=rf"^{name} is not supported with softmax_mode='rowmax_h15' from {SCOPE}"):
            softmax_stage(None).for_kernel(arch=100, q_dtype=torch.bfloat16, features={name: _REFUSED[name]})


def test_gradients_and_other_gpus_name_the_variable(monkeypatch):
    _set(monkeypatch, "rowmax_h15")
    with pytest.raises(ValueError, match=rf"^softmax_mode='rowmax_h15' from {MODE} is forward-only.*unset {MODE}"):
        softmax_stage(None, requires_grad=True)
    with pytest.raises(ValueError, match=rf"^softmax_mode='rowmax_h15' from {MODE} with .* needs an SM90"):
        softmax_stage(None).for_kernel(arch=80, q_dtype=torch.bfloat16)


def test_fp8_path_under_the_environment(monkeypatch):
    """e4m3 on SM90 (the SM90 FP8 forward) takes the process mode like any other call; what it lacks is refused
    naming the variable (Note [Process-wide softmax mode])."""
    e4m3 = torch.float8_e4m3fn
    _set(monkeypatch, "rowmax_h15")
    assert softmax_stage(None).for_kernel(arch=90, q_dtype=e4m3) == softmax_stage("rowmax_h15").for_kernel(
        arch=90, q_dtype=e4m3
    )
    monkeypatch.setenv(THRESHOLD, "8")  # fine at BF16, past the range rule with an FP8 P
    softmax_stage(None).for_kernel(arch=90, q_dtype=torch.bfloat16)
    with pytest.raises(
        ValueError, match=rf"^{THRESHOLD}=8.0 is out of range for softmax_mode='rowmax_h15' from {MODE}"
    ):
        softmax_stage(None).for_kernel(arch=90, q_dtype=e4m3)
    monkeypatch.delenv(THRESHOLD)
    monkeypatch.setenv(BETA, "0.5")
    with pytest.raises(ValueError, match=rf"beta must be None or 1.0 .* got beta=0.5 from {BETA}"):
        softmax_stage(None).for_kernel(arch=90, q_dtype=e4m3)
    monkeypatch.delenv(BETA)
    monkeypatch.setenv(MODE, "rowmax_pot")
    softmax_stage(None).for_kernel(arch=100, q_dtype=e4m3)  # FA4's own SM100 FP8 path has PoT
    with pytest.raises(ValueError, match=rf"on the SM90 FP8 path, got softmax_mode='rowmax_pot' from {MODE}; pass"):
        softmax_stage(None).for_kernel(arch=90, q_dtype=e4m3)


# --- the stderr line -------------------------------------------------------------------------------


def test_the_first_call_under_a_setting_prints_one_line(monkeypatch, capsys):
    softmax_stage(None)
    assert capsys.readouterr().err == ""  # nothing set: nothing printed
    _set(monkeypatch, "rowmax_h15", "0.125")  # a setting no other test uses, so none printed it before
    for _ in range(3):
        softmax_stage(None)
    softmax_stage("rowmax_h15")  # an explicit mode does not read the setting
    assert capsys.readouterr().err == (
        "fa4_rowmax: FA4 calls that pass no softmax_mode run softmax_mode='rowmax_h15' (rescale_threshold=0.125, "
        f"beta=None) from {THRESHOLD}, {MODE}\n"
    )
    with softmax_mode_scope("rowmax_h15", rescale_threshold=0.125):
        softmax_stage(None)
        softmax_stage(None)
    assert capsys.readouterr().err == (
        "fa4_rowmax: FA4 calls that pass no softmax_mode run softmax_mode='rowmax_h15' (rescale_threshold=0.125, "
        f"beta=None) from {SCOPE}\n"
    )


# --- the scope -------------------------------------------------------------------------------------


def test_scopes_nest_and_restore_also_on_an_exception():
    h15, pot = softmax_stage("rowmax_h15"), softmax_stage("rowmax_pot", 1.0)
    with softmax_mode_scope("rowmax_h15"):
        assert softmax_stage(None) == h15
        with pytest.raises(KeyError):
            with softmax_mode_scope("rowmax_pot", rescale_threshold=1.0):
                assert softmax_stage(None) == pot
                raise KeyError("inside")
        assert softmax_stage(None) == h15
        with softmax_mode_scope("rowmax_pot", rescale_threshold=1.0):
            assert softmax_stage(None) == pot
        assert softmax_stage(None) == h15
    assert softmax_stage(None) is None


def test_a_scope_is_process_wide_and_an_exit_drops_only_its_own():
    seen = []
    with softmax_mode_scope("rowmax_h15"):
        worker = threading.Thread(target=lambda: seen.append(softmax_stage(None)))
        worker.start()
        worker.join()
    assert seen == [softmax_stage("rowmax_h15")]
    # two threads' scopes overlapping in time: leaving the outer one first leaves the inner one active
    outer, inner = softmax_mode_scope("rowmax_h15"), softmax_mode_scope("rowmax_pot")
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)
    assert softmax_stage(None) == softmax_stage("rowmax_pot")
    inner.__exit__(None, None, None)
    assert softmax_stage(None) is None


# --- through the patched FA4 (a patched copy, fake CUDA tensors, no GPU) ----------------------------

_PROBE = r"""
import json, os, sys, torch
from torch._subclasses.fake_tensor import FakeTensorMode
import flash_attn.cute.interface as fi

class Looked(Exception):
    pass

class KeyLog:
    # In place of a compile cache: logs the key the dispatch looks up, then ends the call before any compile.
    def __init__(self):
        self.keys = []
    def __contains__(self, key):
        self.keys.append(repr(key))
        raise Looked

fa4_cache = KeyLog()
fi._flash_attn_fwd.compile_cache = fa4_cache

def looked_up(cache, call, **kwargs):
    try:
        call(**kwargs)
    except Looked:
        return cache.keys[-1]
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no compile-cache lookup"

out = {}
with FakeTensorMode():
    q = torch.empty(1, 300, 4, 64, dtype=torch.bfloat16, device="cuda")
    kv = torch.empty(1, 509, 2, 64, dtype=torch.bfloat16, device="cuda")
    dense = lambda **kw: fi.flash_attn_func(q, kv, kv, causal=True, **kw)
    out["unset"] = looked_up(fa4_cache, dense)
    out["fa4_rowmax_loaded"] = sorted(m for m in sys.modules if m.split(".")[0] == "fa4_rowmax")
    if sys.argv[1] == "patched":
        out["variables"] = list(fi._PROCESS_MODE_VARIABLES)
        out["unset_again"] = looked_up(fa4_cache, dense)
        out["explicit_exact"] = looked_up(fa4_cache, dense, softmax_mode="exact")
        out["explicit_h15"] = looked_up(fa4_cache, dense, softmax_mode="rowmax_h15", rescale_threshold=8.0)
        os.environ["FA4_ROWMAX_SOFTMAX_MODE"] = "rowmax_h15"
        os.environ["FA4_ROWMAX_RESCALE_THRESHOLD"] = "8"
        out["env_h15"] = looked_up(fa4_cache, dense)
        out["env_h15_again"] = looked_up(fa4_cache, dense)
        out["env_explicit_exact"] = looked_up(fa4_cache, dense, softmax_mode="exact")
        out["env_softcap"] = looked_up(fa4_cache, dense, softcap=30.0)
        out["env_grad"] = looked_up(fa4_cache, lambda: fi.flash_attn_func(q.clone().requires_grad_(), kv, kv))
        varlen_q = torch.empty(300, 4, 64, dtype=torch.bfloat16, device="cuda")
        varlen_kv = torch.empty(509, 2, 64, dtype=torch.bfloat16, device="cuda")
        cu_q, cu_k = (torch.empty(3, dtype=torch.int32, device="cuda") for _ in range(2))
        varlen = lambda **kw: fi.flash_attn_varlen_func(
            varlen_q, varlen_kv, varlen_kv, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, causal=True, **kw)
        out["varlen_env_h15"] = looked_up(fa4_cache, varlen)
        out["varlen_explicit_h15"] = looked_up(fa4_cache, varlen, softmax_mode="rowmax_h15", rescale_threshold=8.0)
        out["varlen_env_explicit_exact"] = looked_up(fa4_cache, varlen, softmax_mode="exact")
        from fa4_rowmax.process_mode import softmax_mode_scope
        with softmax_mode_scope("rowmax_pot"):
            out["scope_pot"] = looked_up(fa4_cache, dense)
        out["explicit_pot"] = looked_up(fa4_cache, dense, softmax_mode="rowmax_pot")
        import fa4_rowmax.fp8_sm90 as fp8_sm90
        fp8_cache = KeyLog()
        fp8_sm90._compile_cache = fp8_cache
        q8, kv8 = q.to(torch.float8_e4m3fn), kv.to(torch.float8_e4m3fn)
        fp8 = lambda **kw: fi.flash_attn_func(q8, kv8, kv8, causal=True, **kw)
        out["fp8_env_h15_t8"] = looked_up(fp8_cache, fp8)
        del os.environ["FA4_ROWMAX_RESCALE_THRESHOLD"]
        out["fp8_env_h15"] = looked_up(fp8_cache, fp8)
        out["fp8_explicit_h15"] = looked_up(fp8_cache, fp8, softmax_mode="rowmax_h15")
        os.environ["FA4_ROWMAX_SOFTMAX_MODE"] = "rowmax_pot"
        out["fp8_env_pot"] = looked_up(fp8_cache, fp8)
        out["fp8_env_explicit_exact"] = looked_up(fp8_cache, fp8, softmax_mode="exact")
        del os.environ["FA4_ROWMAX_SOFTMAX_MODE"]
        out["fp8_unset"] = looked_up(fp8_cache, fp8)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def probes(tmp_path_factory):
    """The probe's results in a stock and a patched copy of the installed FA4, with none of the variables set."""
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES.values()}
    env.update(FLASH_ATTENTION_ARCH="sm_90", CUTE_DSL_ARCH="sm_90a", FLASH_ATTENTION_NUM_SMS="132")
    results = {}
    for state in ("stock", "patched"):
        site = fa4_patch.copy_package(fa4_patch.default_site(), tmp_path_factory.mktemp(state), state=state)
        proc = subprocess.run(
            [sys.executable, "-c", _PROBE, state],
            env=dict(env, PYTHONPATH=os.pathsep.join(filter(None, [str(site), str(ROOT), env.get("PYTHONPATH")]))),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[state] = json.loads(proc.stdout.strip().splitlines()[-1])
        results[state]["stderr_lines"] = [line for line in proc.stderr.splitlines() if line.startswith("fa4_rowmax:")]
    return results


def test_unset_is_the_stock_path_with_the_stock_compile_key(probes):
    stock, patched = probes["stock"]["unset"], probes["patched"]["unset"]
    assert stock.startswith("(") and stock.endswith(")"), stock  # a compile key, not an error
    assert patched == stock[:-1] + ", None)"  # stock FA4's key, and no stage (patch 0001 appends the stage)
    assert probes["patched"]["fa4_rowmax_loaded"] == []  # nothing set: the patched FA4 does not import fa4_rowmax
    assert probes["patched"]["variables"] == list(VARIABLES.values())  # the names the patch checks before importing
    # with fa4_rowmax loaded, and with softmax_mode="exact" under a variable: the same stock key
    patched_run = probes["patched"]
    assert patched_run["unset_again"] == patched_run["explicit_exact"] == patched_run["env_explicit_exact"] == patched
    assert patched_run["fp8_unset"] == patched_run["fp8_env_explicit_exact"]
    # (the package digest, the config): Note [Compiled kernels on disk] in fa4_rowmax/fp8_sm90.py
    assert patched_run["fp8_unset"].startswith("('") and ", KernelConfig(" in patched_run["fp8_unset"]


def test_the_environment_and_a_scope_compile_the_explicit_kernel(probes):
    run = probes["patched"]
    assert "SoftmaxStage(mode='rowmax_h15', rescale_threshold=8.0" in run["explicit_h15"]
    assert run["env_h15"] == run["env_h15_again"] == run["explicit_h15"]
    assert "SoftmaxStage(mode='rowmax_pot'" in run["explicit_pot"] and run["scope_pot"] == run["explicit_pot"]
    assert "SoftmaxStage(mode='rowmax_h15'" in run["fp8_explicit_h15"] and run["fp8_env_h15"] == run["fp8_explicit_h15"]
    assert "SoftmaxStage(mode='rowmax_h15'" in run["varlen_explicit_h15"]  # varlen passes on the H200: accepted
    assert run["varlen_env_h15"] == run["varlen_explicit_h15"]
    assert run["varlen_env_explicit_exact"].endswith(", None)")


def test_refusals_through_the_patched_fa4_name_the_variable(probes):
    run = probes["patched"]
    assert run["env_softcap"].startswith(
        f"ValueError: softcap is not supported with softmax_mode='rowmax_h15' from {MODE}"
    )
    assert run["env_grad"].startswith(f"ValueError: softmax_mode='rowmax_h15' from {MODE} is forward-only")
    assert run["fp8_env_h15_t8"].startswith(f"ValueError: {THRESHOLD}=8.0 is out of range")
    assert run["fp8_env_pot"].startswith(
        "ValueError: softmax_mode must be one of ('exact', 'rowmax_h15') on the SM90 FP8"
    )
    assert f"got softmax_mode='rowmax_pot' from {MODE}" in run["fp8_env_pot"]


def test_the_patched_fa4_prints_one_line_per_setting(probes):
    assert probes["stock"]["stderr_lines"] == []
    assert probes["patched"]["stderr_lines"] == [
        "fa4_rowmax: FA4 calls that pass no softmax_mode run softmax_mode='rowmax_h15' (rescale_threshold=8.0, "
        f"beta=None) from {THRESHOLD}, {MODE}",
        f"fa4_rowmax: FA4 calls that pass no softmax_mode run softmax_mode='rowmax_pot' (rescale_threshold=None, "
        f"beta=None) from {SCOPE}",
        "fa4_rowmax: FA4 calls that pass no softmax_mode run softmax_mode='rowmax_h15' (rescale_threshold=None, "
        f"beta=None) from {MODE}",
        "fa4_rowmax: FA4 calls that pass no softmax_mode run softmax_mode='rowmax_pot' (rescale_threshold=None, "
        f"beta=None) from {MODE}",
    ]


# --- on an H200 ------------------------------------------------------------------------------------


@pytest.mark.gpu(arch="sm90")
def test_outputs_under_the_variable_equal_the_explicit_outputs_bit_for_bit(monkeypatch):
    from flash_attn.cute import flash_attn_func

    from fa4_rowmax.interface import fa4_backend, is_fa4_patched

    assert is_fa4_patched(), "FA4 is not patched: python -m fa4_rowmax.patching apply"
    gen = torch.Generator(device="cuda").manual_seed(24)
    q = (torch.randn(2, 509, 8, 128, device="cuda", generator=gen) * 3.0).bfloat16()
    k, v = (torch.randn(2, 777, 2, 128, device="cuda", generator=gen).bfloat16() for _ in range(2))
    q8, k8, v8 = (t.to(torch.float8_e4m3fn) for t in (q / 3.0, k, v))

    def run(q, k, v, **kwargs):
        with torch.no_grad():
            return flash_attn_func(q, k, v, causal=True, return_lse=True, **kwargs)

    def assert_bitwise(a, b):
        for x, y in zip(a, b):
            assert x.dtype == y.dtype and torch.equal(x.view(torch.uint8), y.view(torch.uint8))

    unset, unset8 = run(q, k, v), run(q8, k8, v8)
    assert_bitwise(unset, run(q, k, v, softmax_mode="exact"))
    assert_bitwise(unset8, run(q8, k8, v8, softmax_mode="exact"))
    explicit, explicit8 = run(q, k, v, softmax_mode="rowmax_h15"), run(q8, k8, v8, softmax_mode="rowmax_h15")
    monkeypatch.setenv(MODE, "rowmax_h15")
    assert_bitwise(run(q, k, v), explicit)
    assert_bitwise(run(q8, k8, v8), explicit8)
    assert not torch.equal(explicit[0], unset[0])  # H15 is on: its lattice moves the output
    assert_bitwise(run(q, k, v, softmax_mode="exact"), unset)
    assert_bitwise(fa4_backend("exact")(q, k, v, True), unset)  # a gate backend keeps its mode under the variable
