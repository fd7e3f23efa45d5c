"""The FA4 patch set and its apply/revert script, on private copies of the installed FA4 (never the venv's).

Also the host-side validation of `softmax_mode` / `rescale_threshold` / `beta` (fa4_rowmax.interface), both
directly and through the patched `flash_attn_func` imported from a patched copy in a subprocess.
"""

import errno
import hashlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fa4_rowmax import patched_wheel
from fa4_rowmax import patching as fa4_patch
from fa4_rowmax.config import LOG2_ROUND_UP
from fa4_rowmax.interface import FEATURE_STOCK_VALUES, FEATURES_TESTED_16BIT, SoftmaxStage, softmax_stage

ROOT = Path(__file__).resolve().parent.parent

PATCHED_FILES = (
    "flash_attn/cute/interface.py",
    "flash_attn/cute/flash_fwd_sm90.py",
    "flash_attn/cute/flash_fwd_sm100.py",
    "flash_attn/cute/flash_fwd.py",
)


def _pythonpath(*first: Path) -> str:
    """`first`, then the repo, ahead of the inherited PYTHONPATH: on the device machine the wheels FA4 needs are
    found through it (/tmp/site), so a probe that replaced it could not import them."""
    return os.pathsep.join(filter(None, [*map(str, first), str(ROOT), os.environ.get("PYTHONPATH")]))


def _digest(site: Path) -> dict:
    return {f: hashlib.sha256((site / f).read_bytes()).hexdigest() for f in PATCHED_FILES}


@pytest.fixture(scope="module")
def stock_copy(tmp_path_factory):
    return fa4_patch.copy_package(fa4_patch.default_site(), tmp_path_factory.mktemp("stock"), state="stock")


@pytest.fixture(scope="module")
def patched_copy(tmp_path_factory):
    return fa4_patch.copy_package(fa4_patch.default_site(), tmp_path_factory.mktemp("patched"), state="patched")


def test_patches_parse_and_touch_only_the_four_files():
    patches = fa4_patch.load_patches()
    assert sorted({p.path for p in patches}) == sorted(PATCHED_FILES)
    assert all(p.hunks for p in patches)


def test_apply_is_idempotent_and_revert_restores_stock_bytes(stock_copy, tmp_path):
    site = fa4_patch.copy_package(stock_copy, tmp_path, state="stock")
    stock = _digest(site)
    assert fa4_patch.status(site) == "stock"
    assert fa4_patch.apply(site, dry_run=True) and _digest(site) == stock  # dry run writes nothing
    assert sorted(fa4_patch.apply(site)) == sorted(PATCHED_FILES)
    assert fa4_patch.status(site) == "patched" and _digest(site) != stock
    patched = _digest(site)
    assert fa4_patch.apply(site) == [] and _digest(site) == patched  # idempotent
    assert sorted(fa4_patch.revert(site)) == sorted(PATCHED_FILES)
    assert _digest(site) == stock and fa4_patch.status(site) == "stock"
    assert fa4_patch.revert(site) == []


def test_wrong_version_is_refused_with_a_clear_message(stock_copy, tmp_path):
    site = fa4_patch.copy_package(stock_copy, tmp_path, state="stock")
    meta = next(site.glob("flash_attn_4-*.dist-info")) / "METADATA"
    meta.write_text(meta.read_text().replace("Version: 4.0.0b36", "Version: 4.0.0b37"))
    before = _digest(site)
    with pytest.raises(fa4_patch.PatchError, match=r"4\.0\.0b37.*4\.0\.0b36"):
        fa4_patch.apply(site)
    assert _digest(site) == before


def test_edited_file_is_refused_and_nothing_is_written(stock_copy, tmp_path):
    site = fa4_patch.copy_package(stock_copy, tmp_path, state="stock")
    sm90 = site / "flash_attn/cute/flash_fwd_sm90.py"
    text = sm90.read_text()
    line = "            num_rows=acc_O.shape[0][0] * acc_O.shape[1],\n"  # inside a hunk's context
    assert text.count(line) == 1
    sm90.write_text(text.replace(line, line.replace("num_rows=", "num_rows = ")))
    before = _digest(site)
    with pytest.raises(fa4_patch.PatchError, match="flash_fwd_sm90.py"):
        fa4_patch.apply(site)
    assert _digest(site) == before  # interface.py was not patched either: all-or-nothing


def test_cli_status_check_and_exit_codes(stock_copy, tmp_path):
    site = fa4_patch.copy_package(stock_copy, tmp_path, state="stock")
    script = [sys.executable, "-m", "fa4_rowmax.patching"]

    def run(*a):
        return subprocess.run(script + list(a) + ["--site", str(site)], capture_output=True, text=True)

    assert run("check").returncode == 1
    assert "stock" in run("status").stdout
    assert run("apply").returncode == 0 and run("check").returncode == 0
    assert run("revert").returncode == 0 and "stock" in run("status").stdout


@pytest.mark.parametrize("command, start", [("apply", "stock"), ("revert", "patched")])
@pytest.mark.parametrize("fault", ["write", "rename"])
@pytest.mark.parametrize("faulty", PATCHED_FILES[1:])
def test_a_failed_write_or_rename_leaves_every_file_as_it_was(
    stock_copy, tmp_path, monkeypatch, capsys, command, start, fault, faulty
):
    """A full disk while the second or third file is written or renamed in: every file keeps its old bytes,
    no temporary file is left, the CLI exits 2 with a one-line message."""
    site = fa4_patch.copy_package(stock_copy, tmp_path, state=start)
    cute_dir = site / "flash_attn/cute"
    before, names = _digest(site), sorted(p.name for p in cute_dir.iterdir())
    faulty_name = Path(faulty).name
    calls = {"n": 0}

    def disk_full():
        calls["n"] += 1
        return OSError(errno.ENOSPC, "No space left on device")

    if fault == "rename":
        real_replace = os.replace

        def replace(src, dst, *args, **kwargs):
            touches = any(Path(x).name.startswith(faulty_name) for x in (src, dst))
            if touches and calls["n"] == 0:
                raise disk_full()
            return real_replace(src, dst, *args, **kwargs)

        monkeypatch.setattr(os, "replace", replace)
    else:
        real_write_text = Path.write_text

        def write_text(self, data, *args, **kwargs):
            if self.parent == cute_dir and self.name.startswith(faulty_name) and calls["n"] == 0:
                real_write_text(self, data[: len(data) // 2], *args, **kwargs)  # the disk fills mid-file
                raise disk_full()
            return real_write_text(self, data, *args, **kwargs)

        monkeypatch.setattr(Path, "write_text", write_text)
    assert fa4_patch.main([command, "--site", str(site)]) == 2
    assert calls["n"] == 1  # the fault was hit
    err = capsys.readouterr().err
    assert err.startswith("fa4_patch: error: ") and "No space left" in err and err.count("\n") == 1, err
    assert _digest(site) == before
    assert sorted(p.name for p in cute_dir.iterdir()) == names
    monkeypatch.undo()
    assert fa4_patch.status(site) == start


_HALF_PATCHED_PROBE = r"""
import json, torch
from torch._subclasses.fake_tensor import FakeTensorMode
from fa4_rowmax.interface import is_fa4_patched
from flash_attn.cute import flash_attn_func
out = {"is_fa4_patched": is_fa4_patched()}
with FakeTensorMode():
    q = torch.empty(1, 128, 2, 64, dtype=torch.bfloat16, device="cuda")
    try:
        flash_attn_func(q, q, q, softmax_mode="rowmax_h15")
        out["call"] = "no error"
    except Exception as e:
        out["call"] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def test_a_half_patched_fa4_refuses_a_stage_and_is_not_reported_patched(stock_copy, tmp_path):
    """interface.py patched, both kernel files stock (what a torn apply used to leave): the stage would be
    ignored by the stock kernel, so the patched interface refuses it before compiling, and is_fa4_patched()
    says False."""
    site = fa4_patch.copy_package(stock_copy, tmp_path, state="stock")
    interface_only = [p for p in fa4_patch.load_patches() if p.path == PATCHED_FILES[0]]
    assert fa4_patch.apply(site, patches=interface_only) == [PATCHED_FILES[0]]
    assert fa4_patch.status(site) == "mixed"
    env = dict(
        os.environ,
        FLASH_ATTENTION_ARCH="sm_90",
        CUTE_DSL_ARCH="sm_90a",
        FLASH_ATTENTION_NUM_SMS="132",
        PYTHONPATH=_pythonpath(site),
    )
    proc = subprocess.run(
        [sys.executable, "-c", _HALF_PATCHED_PROBE], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["is_fa4_patched"] is False
    assert out["call"].startswith("RuntimeError: flash_attn.cute.flash_fwd_sm90 has no softmax_stage hook"), out


def test_a_deleted_kernel_file_is_exit_2_with_one_line(stock_copy, tmp_path):
    site = fa4_patch.copy_package(stock_copy, tmp_path, state="patched")
    (site / PATCHED_FILES[2]).unlink()
    script = [sys.executable, "-m", "fa4_rowmax.patching"]
    for command in ("status", "check", "apply", "revert"):
        proc = subprocess.run(script + [command, "--site", str(site)], capture_output=True, text=True)
        assert proc.returncode == 2, (command, proc.stderr)
        assert proc.stderr.count("\n") == 1 and "flash_fwd_sm100.py is missing" in proc.stderr, proc.stderr
    assert not (site / PATCHED_FILES[2]).exists()


def test_two_dist_infos_are_refused_not_picked_by_name(stock_copy, tmp_path):
    """A stale flash_attn_4-4.0.0b4.dist-info sorts after 4.0.0b36's; which one pip sees is undefined, so the
    tool refuses both rather than trusting either."""
    site = fa4_patch.copy_package(stock_copy, tmp_path, state="stock")
    (live,) = site.glob("flash_attn_4-*.dist-info")
    stale = site / "flash_attn_4-4.0.0b4.dist-info"
    stale.mkdir()
    (stale / "METADATA").write_text((live / "METADATA").read_text().replace("Version: 4.0.0b36", "Version: 4.0.0b4"))
    before = _digest(site)
    with pytest.raises(fa4_patch.PatchError, match=r"2 flash-attn-4 dist-info directories.*4\.0\.0b36.*4\.0\.0b4"):
        fa4_patch.apply(site)
    assert _digest(site) == before


def test_the_version_is_read_from_the_metadata_not_the_directory_name(stock_copy, tmp_path):
    site = fa4_patch.copy_package(stock_copy, tmp_path, state="stock")
    (live,) = site.glob("flash_attn_4-*.dist-info")
    live.rename(site / "flash_attn_4-4.0.0b36+rowmax.dist-info")
    assert fa4_patch.installed_version(site) == "4.0.0b36"
    meta = site / "flash_attn_4-4.0.0b36+rowmax.dist-info" / "METADATA"
    meta.write_text(meta.read_text().replace("Version: 4.0.0b36", "Version: 4.0.0b4"))
    with pytest.raises(fa4_patch.PatchError, match=r"4\.0\.0b4 is installed"):
        fa4_patch.apply(site)


# --- host-side validation (no kernel) ---------------------------------------------------------------


def test_stock_arguments_give_no_stage():
    assert softmax_stage() is None
    assert softmax_stage("exact", None, None, requires_grad=True) is None


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        (dict(softmax_mode="rowmax"), ValueError, "softmax_mode.*rowmax_h15"),
        (dict(softmax_mode=3), TypeError, "softmax_mode"),
        (dict(softmax_mode="rowmax_h15", rescale_threshold=-1.0), ValueError, "rescale_threshold.*>= 0"),
        (dict(softmax_mode="rowmax_h15", rescale_threshold=math.nan), ValueError, "rescale_threshold"),
        (dict(softmax_mode="rowmax_h15", rescale_threshold="8"), TypeError, "rescale_threshold"),
        (dict(softmax_mode="rowmax_h15", beta=1.5), ValueError, r"beta.*\[0, 1\]"),
        (dict(softmax_mode="exact", beta=True), TypeError, "beta"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        softmax_stage(**kwargs)


@pytest.mark.parametrize("mode", ["rowmax_h15", "rowmax_pot"])
def test_approximate_modes_refuse_gradients(mode):
    with pytest.raises(ValueError, match="forward-only"):
        softmax_stage(mode, requires_grad=True)
    assert softmax_stage("exact", 4.0, requires_grad=True) is not None  # exact with knobs keeps gradients


def test_stage_is_hashable_and_resolves_per_arch():
    stage = softmax_stage("rowmax_h15")
    assert hash(stage) == hash(SoftmaxStage("rowmax_h15"))
    sm90 = stage.for_kernel(arch=90, q_dtype=torch.bfloat16)
    sm100 = stage.for_kernel(arch=100, q_dtype=torch.bfloat16)
    sm100_fp8 = stage.for_kernel(arch=100, q_dtype=torch.float8_e4m3fn)
    assert (sm90.rescale_threshold, sm90.max_offset) == (0.0, 0)
    assert (sm100.rescale_threshold, sm100.max_offset) == (8.0, 0)
    assert (sm100_fp8.rescale_threshold, sm100_fp8.max_offset) == (0.0, 8)
    assert len({sm90, sm100, sm100_fp8}) == 3  # distinct compile-cache keys
    with pytest.raises(ValueError, match="SM90 or SM100"):
        stage.for_kernel(arch=80, q_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="qv is not supported"):
        stage.for_kernel(arch=100, q_dtype=torch.bfloat16, features={"qv": torch.zeros(1)})


# Every FA4 feature a softmax stage refuses (Note [Features allowed with a softmax stage]), with a non-stock value.
_NON_STOCK = {
    "qv": torch.zeros(1),
    "cu_seqlens_q": torch.zeros(2, dtype=torch.int32),
    "cu_seqlens_k": torch.zeros(2, dtype=torch.int32),
    "seqused_q": torch.zeros(1, dtype=torch.int32),
    "seqused_k": torch.zeros(1, dtype=torch.int32),
    "page_table": torch.zeros(1, 1, dtype=torch.int32),
    "softcap": 30.0,
    "window_size_left": 128,
    "window_size_right": 0,
    "learnable_sink": torch.zeros(4),
    "num_splits": 2,
    "score_mod": lambda *a: a[0],
    "mask_mod": lambda *a: True,
    "block_sparse_tensors": object(),
    "aux_tensors": [torch.zeros(1)],
    "q_descale": torch.ones(1, 1),
    "k_descale": torch.ones(1, 1),
    "v_descale": torch.ones(1, 1),
    "gather_kv_indices": torch.zeros(1, dtype=torch.int32),
    "scheduler_metadata": object(),
    "seqlen_k_per_split": 128,
}


def test_every_refused_feature_is_listed():
    assert set(_NON_STOCK) == set(FEATURE_STOCK_VALUES)


@pytest.mark.parametrize("name", sorted(set(_NON_STOCK) - set(FEATURES_TESTED_16BIT)))
@pytest.mark.parametrize("mode, threshold", [("rowmax_h15", None), ("rowmax_pot", None), ("exact", 4.0)])
def test_untested_features_are_refused(name, mode, threshold):
    """Every feature outside the tested serving layouts (tests/test_fa4_varlen_paged.py covers those)."""
    stage = softmax_stage(mode, threshold)
    with pytest.raises(ValueError, match=rf"^{name} is not supported with softmax_mode='{mode}'.*accepted"):
        stage.for_kernel(arch=90, q_dtype=torch.bfloat16, features={name: _NON_STOCK[name]})
    # the stock value passes, for every feature at once
    stage.for_kernel(arch=90, q_dtype=torch.bfloat16, features=dict(FEATURE_STOCK_VALUES))


def test_unknown_feature_names_are_a_programming_error():
    with pytest.raises(TypeError, match="unknown FA4 features"):
        softmax_stage("rowmax_h15").for_kernel(arch=90, q_dtype=torch.bfloat16, features={"dropout_p": 0.1})


@pytest.mark.parametrize("arch", [90, 100, 103])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("mode, threshold", [("rowmax_h15", None), ("rowmax_pot", 0.25), ("exact", None)])
def test_reference_config_is_derived_from_the_resolved_stage(arch, dtype, mode, threshold):
    from fa4_rowmax.interface import fa4_default_rescale_threshold, fa4_max_offset

    if arch == 90 and dtype == torch.float8_e4m3fn and mode == "rowmax_pot":  # the SM90 FP8 forward has no PoT
        with pytest.raises(ValueError, match=r"softmax_mode must be one of \('exact', 'rowmax_h15'\) on the SM90 FP8"):
            SoftmaxStage(mode, rescale_threshold=threshold).for_kernel(arch=arch, q_dtype=dtype)
        return
    stage = SoftmaxStage(mode, rescale_threshold=threshold).for_kernel(arch=arch, q_dtype=dtype)
    config = stage.reference_config(tile_n=128)
    expected_threshold = fa4_default_rescale_threshold(arch, dtype) if threshold is None else threshold
    assert (config.mode, config.rescale_threshold, config.max_offset, config.p_dtype, config.tile_n) == (
        mode,
        expected_threshold,
        fa4_max_offset(dtype),
        dtype,
        128,
    )
    with pytest.raises(AssertionError, match="for_kernel must run"):
        SoftmaxStage(mode).reference_config(tile_n=128)


def test_fa4_defaults_match_the_rule_in_the_pinned_wheel():
    """The host mirrors FA4's threshold and max_offset rules; the kernel asserts them at trace time
    (SoftmaxStage._check_stock_defaults). Here the rules are read from the pinned wheel's source."""
    source = (Path(fa4_patch.default_site()) / "flash_attn/cute/flash_fwd_sm100.py").read_text()
    assert "rescale_threshold = 8.0 if const_expr(self.q_dtype.width == 16) else 0.0" in source
    assert "max_offset = 8 if cutlass.const_expr(self.q_dtype.width == 8) else 0" in source


def test_fp8_range_rule_leaves_room_for_the_round_up():
    log2_e4m3_max = math.log2(448.0)
    # H15 may round up by log2(1.5) - 0.25 octaves: with max_offset 8 that leaves < 0.472 for the threshold.
    room = log2_e4m3_max - 8 - LOG2_ROUND_UP["rowmax_h15"]
    SoftmaxStage("rowmax_h15", rescale_threshold=room - 1e-3).for_kernel(arch=100, q_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="rescale_threshold.*float8_e4m3fn"):
        SoftmaxStage("rowmax_h15", rescale_threshold=room + 1e-3).for_kernel(arch=100, q_dtype=torch.float8_e4m3fn)
    # exact has no round-up, so the same threshold is fine there
    SoftmaxStage("exact", rescale_threshold=room + 1e-3).for_kernel(arch=100, q_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="rescale_threshold"):
        SoftmaxStage("rowmax_pot", rescale_threshold=0.4).for_kernel(arch=100, q_dtype=torch.float8_e4m3fn)


# --- the patched FA4 itself, imported from a patched copy in a subprocess ----------------------------

_PROBE = r"""
import json, inspect, torch
import flash_attn.cute.interface as fi
from fa4_rowmax.interface import is_fa4_patched
out = {"params": {f: [p for p in ("softmax_mode", "rescale_threshold", "beta")
                      if p in inspect.signature(getattr(fi, f)).parameters]
                  for f in ("flash_attn_func", "flash_attn_varlen_func")},
       "is_fa4_patched": is_fa4_patched()}
q = torch.zeros(1, 8, 2, 64, dtype=torch.bfloat16)
for name, kw, grad in [("bad_mode", dict(softmax_mode="h15"), False),
                       ("bad_beta", dict(softmax_mode="rowmax_h15", beta=2.0), False),
                       ("grad", dict(softmax_mode="rowmax_h15"), True)]:
    qq = q.clone().requires_grad_(grad)
    try:
        fi.flash_attn_func(qq, q, q, **kw)
        out[name] = "no error"
    except Exception as e:
        out[name] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def test_patched_fa4_takes_the_knobs_and_validates_before_any_kernel(patched_copy):
    env = dict(os.environ, PYTHONPATH=_pythonpath(patched_copy))
    proc = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["params"] == {
        f: ["softmax_mode", "rescale_threshold", "beta"] for f in ("flash_attn_func", "flash_attn_varlen_func")
    }
    assert out["is_fa4_patched"] is True
    assert out["bad_mode"].startswith("ValueError") and "softmax_mode" in out["bad_mode"]
    assert out["bad_beta"].startswith("ValueError") and "beta" in out["bad_beta"]
    assert out["grad"].startswith("ValueError") and "forward-only" in out["grad"]


# --- the +rowmax wheel --------------------------------------------------------------------------------


def test_build_wheel_patches_relabels_and_writes_a_correct_record(stock_copy, tmp_path):
    """A pinned-version wheel is packed from the stock copy, then rebuilt by fa4_rowmax.patched_wheel."""
    import base64
    import csv
    import zipfile

    src = tmp_path / "src"
    fa4_patch.copy_package(stock_copy, src, state="stock")
    (src / "flash_attn_4-4.0.0b36.dist-info" / "RECORD").unlink()
    (tmp_path / "pinned").mkdir()
    subprocess.run(
        [sys.executable, "-m", "wheel", "pack", "--dest-dir", str(tmp_path / "pinned"), str(src)],
        check=True,
        capture_output=True,
    )
    (pinned,) = (tmp_path / "pinned").glob("*.whl")
    built = patched_wheel.build(pinned, tmp_path / "dist")
    assert built.name.startswith("flash_attn_4-4.0.0b36+rowmax-")
    unpacked = tmp_path / "unpacked"
    with zipfile.ZipFile(built) as zf:
        zf.extractall(unpacked)
    info = unpacked / "flash_attn_4-4.0.0b36+rowmax.dist-info"
    assert "Version: 4.0.0b36+rowmax\n" in (info / "METADATA").read_text()
    assert fa4_patch.status(unpacked) == "patched"
    rows = list(csv.reader((info / "RECORD").read_text().splitlines()))
    assert {r[0] for r in rows} >= set(PATCHED_FILES)
    for path, digest, size in rows:
        if digest:
            data = (unpacked / path).read_bytes()
            algo, value = digest.split("=", 1)
            assert base64.urlsafe_b64encode(hashlib.new(algo, data).digest()).rstrip(b"=").decode() == value, path
            assert int(size) == len(data), path
