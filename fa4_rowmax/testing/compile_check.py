#!/usr/bin/env python3
"""Compile FA4 forward kernels to cubin on a CPU-only machine and read their SASS.

    python -m fa4_rowmax.testing.compile_check --arch sm90 --matrix ci --out /tmp/cc      # the CI matrix
    python -m fa4_rowmax.testing.compile_check --arch sm100 --matrix full --out /tmp/cc   # the bigger one
    python -m fa4_rowmax.testing.compile_check one --arch sm90 --config '{"mode": "rowmax_h15"}'  # one config, JSON out

How (shared/notes/rowmax_h15.md): FLASH_ATTENTION_ARCH / CUTE_DSL_ARCH / FLASH_ATTENTION_NUM_SMS select the
kernel and target, the forward runs inside torch's FakeTensorMode on "cuda" tensors so the kernel is traced
and compiled but never launched, and CUTE_DSL_KEEP=cubin keeps the cubin, which the triton wheel's cuobjdump
disassembles. One architecture per process, so every configuration runs in its own subprocess, against a
private copy of FA4 (patched, or stock for the reference) put first on PYTHONPATH; the installed FA4 is never
touched.

Checks, per architecture:
- every configuration compiles;
- `exact` (no knob: softmax_mode="exact" passed) through the patched FA4 gives the same SASS as stock FA4 (same
  configuration);
- the MUFU.EX2 count falls as beta grows (rowmax_h15 and exact).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from fa4_rowmax import patching as fa4_patch

ROOT = Path(__file__).resolve().parents[2]

ARCH_ENV = {
    "sm90": {"FLASH_ATTENTION_ARCH": "sm_90", "CUTE_DSL_ARCH": "sm_90a", "FLASH_ATTENTION_NUM_SMS": "132"},
    "sm100": {"FLASH_ATTENTION_ARCH": "sm_100", "CUTE_DSL_ARCH": "sm_100a", "FLASH_ATTENTION_NUM_SMS": "148"},
    # B300: an SM100-family target; with no score_mod/mask_mod FA4 takes unmasked row maxima from tcgen05.ld.red.
    "sm103": {"FLASH_ATTENTION_ARCH": "sm_103", "CUTE_DSL_ARCH": "sm_103a", "FLASH_ATTENTION_NUM_SMS": "148"},
}
SM100_FAMILY = ("sm100", "sm103")
DEFAULT_CONFIG = dict(
    dtype="bf16",
    causal=True,
    hdim=128,
    gqa=False,
    varlen=False,
    page_size=None,  # paged KV (Note [Serving layouts on the CPU]): FA4's page_table with pages of this many keys
    mode="exact",
    beta=None,
    rescale_threshold=None,
    seqlen=256,
)
# Instruction classes counted in the SASS (opcode prefix match on the mnemonic).
COUNTED_OPS = (
    "MUFU.EX2",
    "FFMA",
    "FADD",
    "FMUL",
    "FMNMX",
    "FSEL",
    "LEA",
    "SHF",
    "IMAD",
    "IADD3",
    "LOP3",
    "F2FP",
    "FFMA2",
    "FADD2",
    "FMUL2",
    "HMMA",
    "HGMMA",
    "UTCHMMA",
    "UTCQMMA",
)


def ci_matrix(arch: str) -> list[dict]:
    """The small matrix whose SASS the compile tests check case by case (2 CPUs, ~10 minutes for both archs): stock
    reference + modes + beta sweep; `full_matrix` adds breadth (both run in CI)."""
    base = dict(DEFAULT_CONFIG)
    configs = [
        dict(base, mode="exact"),
        dict(base, mode="rowmax_h15"),
        dict(base, mode="rowmax_h15", beta=0.5),
        dict(base, mode="rowmax_h15", beta=0.0),
        dict(base, mode="exact", beta=1.0),
    ]
    if arch in SM100_FAMILY:
        configs.append(dict(base, mode="rowmax_h15", dtype="fp8", causal=False))
    else:
        configs.append(dict(base, mode="rowmax_h15", causal=False, hdim=64, gqa=True))
    configs += serving_layouts(arch)
    return configs


# Note [Serving layouts on the CPU]
# The layouts engines call (varlen cu_seqlens, paged KV through page_table + seqused_k) change how FA4 loads K/V
# and bounds each sequence, not the softmax stage; their values are checked on the H200
# (tests/test_fa4_varlen_paged.py). On the CPU each compiles for both families with the H15 stage in it: varlen
# GQA, and chunked prefill over a paged cache with a page of one key tile (128: FA4 loads pages by TMA) and of
# 64 keys (FA4's non-TMA page loads). So CI proves that the SM100 kernels it cannot run build with these layouts,
# with the exponential off the MUFU.
def serving_layouts(arch: str) -> list[dict]:
    base = dict(DEFAULT_CONFIG, mode="rowmax_h15")
    return [dict(base, varlen=True, gqa=True), dict(base, page_size=128), dict(base, page_size=64, causal=False)]


def full_matrix(arch: str) -> list[dict]:
    dtypes = ["bf16", "fp16"] + (["fp8"] if arch in SM100_FAMILY else [])
    configs = []
    for dtype in dtypes:
        for causal in (False, True):
            for hdim in (64, 128):
                for gqa, varlen in ((False, False), (True, False), (False, True)):
                    # FP8 varlen keeps its refusal on SM100 (FEATURES_TESTED_16BIT, interface.py)
                    for mode in ("exact",) if varlen and dtype == "fp8" else ("exact", "rowmax_h15", "rowmax_pot"):
                        configs.append(
                            dict(
                                DEFAULT_CONFIG, dtype=dtype, causal=causal, hdim=hdim, gqa=gqa, varlen=varlen, mode=mode
                            )
                        )
    configs += serving_layouts(arch)
    for beta in (0.0, 0.25, 0.5, 0.75, 1.0):
        configs.append(dict(DEFAULT_CONFIG, mode="rowmax_h15", beta=beta))
        configs.append(dict(DEFAULT_CONFIG, mode="exact", beta=beta))
    return configs


def _worker(arch: str, config: dict, dump_dir: Path) -> dict:
    """Runs in the subprocess: compile one configuration, return the SASS statistics."""
    import cutlass.utils
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    num_sms = int(os.environ["FLASH_ATTENTION_NUM_SMS"])

    class _HardwareInfo:
        """Stand-in for cutlass.utils.HardwareInfo, which asks the (absent) driver while tracing."""

        def __init__(self, *args, **kwargs):
            pass

        def get_device_multiprocessor_count(self):
            return num_sms

        def get_max_active_clusters(self, cluster_size):
            return num_sms // cluster_size

    cutlass.utils.HardwareInfo = _HardwareInfo
    import flash_attn.cute.tile_scheduler as tile_scheduler

    tile_scheduler.HardwareInfo = _HardwareInfo
    from flash_attn.cute import flash_attn_func, flash_attn_varlen_func

    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp8": torch.float8_e4m3fn}[config["dtype"]]
    heads_q, heads_k = (8, 2) if config["gqa"] else (4, 4)
    seqlen, hdim = config["seqlen"], config["hdim"]
    knobs = {}
    if (
        config["mode"] != "exact"
        or config["beta"] is not None
        or config["rescale_threshold"] is not None
        or config.get("levers")
    ):
        knobs = dict(softmax_mode=config["mode"], beta=config["beta"], rescale_threshold=config["rescale_threshold"])
    elif "softmax_mode" in inspect.signature(flash_attn_func).parameters:
        # Exact with no knob on the patched copy: passed, since its default (None) would take a process-wide mode
        # from an inherited FA4_ROWMAX_SOFTMAX_MODE (Note [Process-wide softmax mode]). "exact" with no knob is
        # stock FA4, so the stock comparison still holds. The stock copy has no such parameter and no such mode.
        knobs = dict(softmax_mode="exact")
    with FakeTensorMode():
        if config["page_size"] is not None:
            # Two sequences of `seqlen` cached keys each in pages, a chunk of 100 new queries each (chunked prefill).
            page_size, batch = config["page_size"], 2
            pages_per_seq = -(-seqlen // page_size)
            q = torch.empty(batch * 100, heads_q, hdim, dtype=dtype, device="cuda")
            k = torch.empty(batch * pages_per_seq, page_size, heads_k, hdim, dtype=dtype, device="cuda")
            flash_attn_varlen_func(
                q,
                k,
                k,
                cu_seqlens_q=torch.tensor([0, 100, 200], dtype=torch.int32, device="cuda"),
                seqused_k=torch.tensor([seqlen, seqlen - 7], dtype=torch.int32, device="cuda"),
                page_table=torch.empty(batch, pages_per_seq, dtype=torch.int32, device="cuda"),
                max_seqlen_q=100,
                max_seqlen_k=seqlen,
                causal=config["causal"],
                return_lse=True,
                **knobs,
            )
        elif config["varlen"]:
            total = 2 * seqlen
            q = torch.empty(total, heads_q, hdim, dtype=dtype, device="cuda")
            k = torch.empty(total, heads_k, hdim, dtype=dtype, device="cuda")
            cu = torch.tensor([0, seqlen - 7, total], dtype=torch.int32, device="cuda")
            flash_attn_varlen_func(
                q,
                k,
                k,
                cu_seqlens_q=cu,
                cu_seqlens_k=cu,
                max_seqlen_q=seqlen,
                max_seqlen_k=seqlen,
                causal=config["causal"],
                return_lse=True,
                **knobs,
            )
        elif config.get("levers"):
            # SM90 levers (anchor_rounding, rescale_vote): not flash_attn_func arguments.
            from fa4_rowmax.interface import rowmax_attn_func

            q = torch.empty(2, seqlen, heads_q, hdim, dtype=dtype, device="cuda")
            k = torch.empty(2, seqlen, heads_k, hdim, dtype=dtype, device="cuda")
            rowmax_attn_func(q, k, k, causal=config["causal"], return_lse=True, **knobs, **config["levers"])
        else:
            q = torch.empty(2, seqlen, heads_q, hdim, dtype=dtype, device="cuda")
            k = torch.empty(2, seqlen, heads_k, hdim, dtype=dtype, device="cuda")
            flash_attn_func(q, k, k, causal=config["causal"], return_lse=True, **knobs)
    cubins = sorted(p for p in dump_dir.glob("*.cubin") if "flash_fwd" in p.name or "Forward" in p.name)
    if not cubins:
        raise RuntimeError(f"no forward-kernel cubin in {dump_dir}: {sorted(p.name for p in dump_dir.iterdir())}")
    return sass_stats(cubins[-1])


def cuobjdump() -> str:
    """CUDA 13.5's cuobjdump (PyPI `nvidia-cuda-cuobjdump` with `nvidia-cuda-nvdisasm`, pinned): the one that
    decodes sm_103a; the cuobjdump 12.8 bundled with the pinned Triton 3.6 stops at sm_100a."""
    import nvidia

    for root in nvidia.__path__:
        tool = Path(root) / "cu13" / "bin" / "cuobjdump"
        if tool.is_file():
            return str(tool)
    raise FileNotFoundError(
        "cuobjdump not found under nvidia/cu13/bin: pip install -c constraints.txt "
        "nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm"
    )


_SASS_LINE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def disassemble(cubin: Path) -> list[str]:
    """The cubin's instruction stream, one instruction a line, addresses and encodings dropped."""
    sass = subprocess.run([cuobjdump(), "-sass", str(cubin)], check=True, capture_output=True, text=True).stdout
    return [line.split("*/", 1)[1].split(";")[0].strip() for line in sass.splitlines() if _SASS_LINE.search(line)]


def sass_stats(cubin: Path) -> dict:
    """Opcode counts and a hash of the instruction stream (`disassemble`)."""
    instructions = disassemble(cubin)
    opcodes = Counter(ins.split()[0] if not ins.startswith("@") else ins.split()[1] for ins in instructions)
    counts = {
        op: sum(n for name, n in opcodes.items() if name == op or name.startswith(op + ".")) for op in COUNTED_OPS
    }
    counts["MUFU.EX2"] = sum(n for name, n in opcodes.items() if name.startswith("MUFU.EX2"))
    return {
        "cubin": cubin.name,
        "instructions": len(instructions),
        "counts": counts,
        "sass_sha256": hashlib.sha256("\n".join(instructions).encode()).hexdigest(),
    }


def run_one(arch: str, config: dict, fa4_site: Path, workdir: Path, timeout: float = 600) -> dict:
    """Compile one configuration in a fresh subprocess against the FA4 copy in `fa4_site`."""
    dump = Path(tempfile.mkdtemp(prefix="dump_", dir=workdir))
    env = dict(
        os.environ,
        **ARCH_ENV[arch],
        CUTE_DSL_KEEP="cubin",
        CUTE_DSL_DUMP_DIR=str(dump),
        PYTHONPATH=os.pathsep.join([str(fa4_site), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        PYTHONWARNINGS="ignore",
    )
    cmd = [
        sys.executable,
        "-m",
        "fa4_rowmax.testing.compile_check",
        "one",
        "--arch",
        arch,
        "--config",
        json.dumps(config),
        "--dump",
        str(dump),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        return {"config": config, "ok": False, "error": proc.stderr[-4000:]}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"config": config, "ok": True, **result}


# The SM90 FP8 forward's compile configuration: causal unless the knobs say causal=False, head dim 128, 256 keys
# (so FA4's three softmax sites are unrolled when causal), batch 2, 4 heads; the kernel's knobs come as JSON in
# argv[1].
_FP8_SM90_WORKER = r"""
import json, os, sys
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90
from fa4_rowmax.stage.flash_fwd_sm90_fp8 import FlashAttentionForwardSm90Fp8
kw = json.loads(sys.argv[1])
causal = kw.pop("causal", True)
head_dim = kw.pop("head_dim", 128)
storage_cls = FlashAttentionForwardSm90Fp8._get_shared_storage_cls
def recorded_storage_cls(self):
    storage = storage_cls(self)
    with open(os.path.join(os.environ["CUTE_DSL_DUMP_DIR"], "shared_storage_bytes"), "w") as f:
        f.write(str(storage.size_in_bytes()))
    return storage
FlashAttentionForwardSm90Fp8._get_shared_storage_cls = recorded_storage_cls
with FakeTensorMode():
    q = torch.empty(2, 256, 4, head_dim, dtype=torch.float8_e4m3fn, device="cuda")
    k = torch.empty(2, 256, 4, head_dim, dtype=torch.float8_e4m3fn, device="cuda")
    flash_attn_fp8_sm90(q, k, k, causal=causal, **kw)
"""


def compile_fp8_sm90(kwargs: dict, dump: Path, fa4_site: Path, timeout: float = 600) -> Path:
    """The cubin of the SM90 FP8 forward with `kwargs` (`flash_attn_fp8_sm90`'s knobs, `causal` and `head_dim`: 128
    unless named), compiled for
    sm_90a in a subprocess against `fa4_site` (a patched copy from `prepare_fa4_copies`) and kept under the new
    folder `dump`, beside the traced size of its shared storage (`traced_shared_storage_bytes`)."""
    dump.mkdir()
    env = dict(
        os.environ,
        **ARCH_ENV["sm90"],
        CUTE_DSL_KEEP="cubin",
        CUTE_DSL_DUMP_DIR=str(dump),
        PYTHONPATH=os.pathsep.join([str(fa4_site), str(ROOT), os.environ.get("PYTHONPATH", "")]),
        PYTHONWARNINGS="ignore",
    )
    proc = subprocess.run(
        [sys.executable, "-c", _FP8_SM90_WORKER, json.dumps(kwargs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"the SM90 FP8 forward with {kwargs} did not compile:\n{proc.stderr[-3000:]}")
    cubins = sorted(dump.glob("*Sm90Fp8*.cubin"))
    if len(cubins) != 1:
        raise RuntimeError(f"expected one *Sm90Fp8*.cubin under {dump}, found {sorted(p.name for p in dump.iterdir())}")
    return cubins[0]


def traced_shared_storage_bytes(cubin: Path) -> int:
    """The size of the shared-storage struct the kernel of `cubin` (from `compile_fp8_sm90`) allocated, as traced."""
    return int((cubin.parent / "shared_storage_bytes").read_text())


def prepare_fa4_copies(workdir: Path) -> dict[str, Path]:
    """Private stock and patched copies of the installed FA4 (which stays untouched)."""
    site = fa4_patch.default_site()
    return {
        state: fa4_patch.copy_package(site, workdir / f"fa4_{state}", state=state) for state in ("stock", "patched")
    }


def check_matrix(arch: str, configs: list[dict], workdir: Path, jobs: int = 2) -> dict:
    """Compile `configs` (patched FA4) plus the stock reference; return results and the checks."""
    copies = prepare_fa4_copies(workdir)
    tasks = [("patched", c) for c in configs] + [("stock", dict(DEFAULT_CONFIG))]
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(run_one, arch, c, copies[state], workdir) for state, c in tasks]
        results = [f.result() for f in futures]
    patched, stock = results[:-1], results[-1]
    checks = {}
    checks["all_compile"] = all(r["ok"] for r in results)
    exact = next((r for r in patched if r["config"] == dict(DEFAULT_CONFIG)), None)
    if exact and exact["ok"] and stock["ok"]:
        checks["exact_sass_equals_stock"] = exact["sass_sha256"] == stock["sass_sha256"]
    for mode in ("rowmax_h15", "exact"):
        sweep = sorted(
            (
                (r["config"]["beta"], r["counts"]["MUFU.EX2"])
                for r in patched
                if r["ok"]
                and r["config"]["mode"] == mode
                and r["config"]["beta"] is not None
                and {k: v for k, v in r["config"].items() if k not in ("beta", "mode")}
                == {k: v for k, v in DEFAULT_CONFIG.items() if k not in ("beta", "mode")}
            ),
        )
        if len(sweep) >= 2:
            ex2 = [n for _, n in sweep]
            checks[f"mufu_falls_with_beta_{mode}"] = all(a >= b for a, b in zip(ex2, ex2[1:])) and ex2[0] > ex2[-1]
            checks[f"mufu_by_beta_{mode}"] = sweep
    return {"arch": arch, "results": results, "stock": stock, "checks": checks}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", default="matrix", choices=["matrix", "one"])
    parser.add_argument("--arch", required=True, choices=sorted(ARCH_ENV))
    parser.add_argument("--matrix", default="ci", choices=["ci", "full"])
    parser.add_argument("--config", default="{}", help="one: JSON overrides of the default configuration")
    parser.add_argument("--dump", type=Path, help="one: artifact directory")
    parser.add_argument("--out", type=Path, default=None, help="matrix: directory for the JSON report")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    if args.command == "one":
        config = dict(DEFAULT_CONFIG, **json.loads(args.config))
        print(json.dumps(_worker(args.arch, config, args.dump)))
        return 0
    configs = ci_matrix(args.arch) if args.matrix == "ci" else full_matrix(args.arch)
    out = args.out or Path(tempfile.mkdtemp(prefix="fa4_compile_"))
    out.mkdir(parents=True, exist_ok=True)
    report = check_matrix(args.arch, configs, out, jobs=args.jobs)
    (out / f"compile_{args.arch}_{args.matrix}.json").write_text(json.dumps(report, indent=1))
    for r in report["results"]:
        c = r["config"]
        desc = (
            f"{c['mode']:<11} beta={c['beta']} {c['dtype']} causal={c['causal']} d={c['hdim']} gqa={c['gqa']} "
            f"varlen={c['varlen']} page_size={c['page_size']}"
        )
        print(
            f"{'ok ' if r['ok'] else 'ERR'} {desc} "
            + (f"instr={r['instructions']} {r['counts']}" if r["ok"] else r["error"][-800:])
        )
    print(json.dumps(report["checks"]))
    return 0 if all(v for k, v in report["checks"].items() if not k.startswith("mufu_by_beta")) else 1


if __name__ == "__main__":
    sys.exit(main())
