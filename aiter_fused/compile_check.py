"""Compile every kernel configuration the dispatcher can launch for an AMD GPU, on a CPU, and read the
machine code.

    python -m aiter_fused.compile_check --arch gfx950 --json FILE             # the full matrix
    python -m aiter_fused.compile_check --arch gfx942 --matrix ci --json FILE  # the CI slice

The PyPI Triton wheel ships its AMD backend (device libraries, lld): ``triton.compile(ASTSource(...),
target=GPUTarget("hip", ARCH, 64))`` gives AMDGCN and its metadata without ROCm. Each configuration is
compiled with the launch ``aiter_fused.launch.LAUNCHES[arch]`` gives (the one ``attention.py`` uses),
and the record holds: the MFMA instructions with their A/B operand formats, VGPR/AGPR/SGPR counts and
spills, waves per SIMD the registers allow, LDS bytes, and the VALU/MFMA/LDS instruction counts inside
the main loop, and gfx950's scaled fp8 down-converts (``v_cvt_scalef32_pk_fp8_*``: how many, how many with a
constant scale); for the attention kernel also how many times each dot's MFMA layout covers its result
(``dot_replication``: 2 means two groups of waves compute the same tile). A configuration that fails to
compile is recorded with its error. The Triton version is recorded with the results.
``Config(p_convert="hardware")`` (Note [Hardware P convert] in ``kernel.py``) is a gfx950 variant of this audit
alone, outside the matrix: ``aiter_fused.attention`` never launches it, and it has never run on a GPU.

Run with ``TRITON_INTERPRET`` unset (the interpreter replaces compilation).
"""

import argparse
import dataclasses
import hashlib
import itertools
import json
import re
import sys
from collections import Counter
from typing import Optional

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from aiter_fused.attention import HEAD_DIMS, TILE_SIZES, _default_dot_mode, _operand_format
from aiter_fused.kernel import _fused_softmax_attn_fwd
from aiter_fused.launch import LAUNCHES, Launch
from aiter_fused.quantize import _format_constants, _quantize_head_dim_kernel, _quantize_keys_kernel
from fa4_rowmax.config import MX_FORMATS
from fa4_rowmax.reference.fused_softmax import operand_element_format, p_element_format

__all__ = ["ARCHES", "Config", "P_CONVERTS", "audit", "configs", "read_amdgcn"]

ARCHES = ("gfx950", "gfx942")
WAVE_SIZE = 64
# The A/B operand format fields (cbsz / blgp) of gfx950's f8f6f4 MFMAs; absent means 0.
F8F6F4_FORMATS = {0: "fp8_e4m3", 1: "bf8_e5m2", 2: "fp6_e2m3", 3: "bf6_e3m2", 4: "fp4_e2m1"}
# The element formats of the other MFMAs, read off their names.
NAMED_FORMATS = (
    ("_bf16", "bf16"),
    ("_f16", "f16"),
    ("_fp8_fp8", "fp8_e4m3"),
    ("_bf8_bf8", "bf8_e5m2"),
    ("_xf32", "xf32"),
    ("_f32", "f32"),
)
VGPRS_PER_SIMD_LANE = 512  # gfx90a and later: one unified file of 512 VGPRs + AGPRs a lane
# How the kernel makes MX P (P_CONVERT): "software" is what every launch runs; "hardware" (Note [Hardware P
# convert] in kernel.py) exists for this audit only and is never passed by aiter_fused.attention.
P_CONVERTS = ("software", "hardware")
_HARDWARE_P_CONVERT_ONLY = (
    'p_convert="hardware" is a compile-audit variant only (gfx950, attention, dot_mode "scaled", MXFP8 P) and '
    "has never run on an MI355X"
)


@dataclasses.dataclass(frozen=True)
class Config:
    """One compiled kernel. ``kernel``: "attention", "quantize_head_dim" (Q, K) or "quantize_keys" (V)."""

    kernel: str
    mx_format: str
    head_dim: int
    dot_mode: Optional[str] = None  # attention: one of DOT_MODES, or None for the exact twin
    causal: bool = False
    tile_n: Optional[int] = None
    pack_e2m1: bool = False  # quantizers: the packed e2m1 output of the "scaled" mode at MXFP4
    row_sum: str = "reduce"  # attention: one of attention.ROW_SUMS (Note [Row sum by GEMM] in kernel.py)
    exp_fold: bool = False  # attention: Note [Folded Schraudolph] in kernel.py
    p_convert: str = "software"  # attention: one of P_CONVERTS (Note [Hardware P convert] in kernel.py)

    def __post_init__(self):
        if self.p_convert not in P_CONVERTS:
            raise ValueError(f"p_convert must be one of {P_CONVERTS}; got {self.p_convert!r}")
        if self.p_convert == "hardware" and (
            self.kernel != "attention" or self.dot_mode != "scaled" or p_element_format(self.mx_format) != "e4m3"
        ):
            raise ValueError(_HARDWARE_P_CONVERT_ONLY + f"; got {self.kernel}/{self.mx_format}/{self.dot_mode}")

    @property
    def name(self) -> str:
        if self.kernel != "attention":
            return f"{self.kernel}/{self.mx_format}/hd{self.head_dim}" + ("/packed" if self.pack_e2m1 else "")
        mode = self.dot_mode or "exact"
        return (
            f"attention/{mode}/{self.mx_format}/hd{self.head_dim}/{'causal' if self.causal else 'dense'}/n{self.tile_n}"
            + ("" if self.row_sum == "reduce" else f"/row_sum_{self.row_sum}")
            + ("/exp_fold" if self.exp_fold else "")
            + ("" if self.p_convert == "software" else f"/p_convert_{self.p_convert}")
        )


def configs(arch: str, matrix: str = "full") -> list[Config]:
    """Every configuration the dispatcher can launch (``full``): formats x the architecture's dot modes
    (and the exact twin) x head dims x causal x tile sizes, and the quantizers for each operand format
    and head dim (MXFP4's also packed, for the "scaled" mode). ``ci``: the launch table's tile only, head dims
    64 and 128 (64: the default dot mode and the exact twin)."""
    if matrix not in ("full", "ci"):
        raise ValueError(f"matrix must be 'full' or 'ci'; got {matrix!r}")
    full = matrix == "full"
    tiles = TILE_SIZES if full else (LAUNCHES[arch].tile_n,)
    head_dims = HEAD_DIMS if full else (64, 128)
    result = []
    for head_dim, tile_n, causal in itertools.product(head_dims, tiles, (False, True)):
        launchable = LAUNCHES[arch].dot_modes
        modes = launchable if full or head_dim == 128 else (_default_dot_mode(arch),)
        for dot_mode, mx_format in itertools.product(modes, MX_FORMATS):
            result.append(Config("attention", mx_format, head_dim, dot_mode, causal, tile_n))
        result.append(Config("attention", "mxfp8", head_dim, None, causal, tile_n))
    packed = (False, True) if "scaled" in LAUNCHES[arch].dot_modes else (False,)
    for kernel, mx_format, head_dim, pack_e2m1 in itertools.product(
        ("quantize_head_dim", "quantize_keys"), MX_FORMATS, head_dims, packed
    ):
        if not pack_e2m1 or operand_element_format(mx_format) == "e2m1":
            result.append(Config(kernel, mx_format, head_dim, pack_e2m1=pack_e2m1))
    return result


_ATTENTION_POINTERS = dict(
    Q_scale="*u8",
    K_scale="*u8",
    V_scale="*u8",
    Out="*bf16",
    Lse="*fp32",
    Recoveries="*i32",
    cu_seqlens_q="*i32",
    cu_seqlens_k="*i32",
    cu_blocks_k="*i32",
)


def _source(config: Config, arch: str, launch: Launch) -> tuple[ASTSource, dict]:
    if config.p_convert == "hardware" and arch != "gfx950":
        raise ValueError(_HARDWARE_P_CONVERT_ONLY + f"; got arch {arch!r}")
    if config.kernel == "attention":
        p = _format_constants(p_element_format(config.mx_format))
        constants = dict(
            GROUP=1,
            HEAD_DIM=config.head_dim,
            BLOCK_M=launch.block_m,
            BLOCK_N=config.tile_n,
            CAUSAL=config.causal,
            EXACT=config.dot_mode is None,
            DOT_MODE=config.dot_mode or "bf16",
            DOT_DTYPE=tl.bfloat16,
            OPERAND_FORMAT=_operand_format(config.mx_format, config.dot_mode is None, config.dot_mode or "bf16"),
            RETURN_RECOVERIES=False,
            KV_TILE_OFFSETS=launch.kv_tile_offsets,
            ROW_SUM_GEMM=config.row_sum == "gemm",
            EXP_FOLD=config.exp_fold,
            P_CONVERT=config.p_convert,
            P_MANTISSA=p["MANTISSA"],
            P_MIN_EXPONENT=p["MIN_EXPONENT"],
            P_MAX_NORMAL=p["MAX_NORMAL"],
            P_MAX_MANTISSA_BITS=p["MAX_MANTISSA_BITS"],
            P_MAX_EXPONENT=p["MAX_EXPONENT"],
        )
        operand = {"e2m1": "*u8"}.get(constants["OPERAND_FORMAT"], "*bf16" if config.dot_mode is None else "*fp8e4nv")
        pointers = dict(_ATTENTION_POINTERS, Q=operand, K=operand, V=operand)
        kernel, floats = _fused_softmax_attn_fwd, ("scale_log2", "recovery_threshold")
    else:
        fmt = operand_element_format(config.mx_format)
        constants = dict(HEAD_DIM=config.head_dim, **_format_constants(fmt), PACK_E2M1=config.pack_e2m1)
        floats = ()
        if config.kernel == "quantize_head_dim":
            kernel, pointers = _quantize_head_dim_kernel, dict(X="*i16", Elements="*u8", Scale="*u8")
            constants.update(BLOCK_T=16, PRESCALED=False)
            floats = ("prescale",)
        else:
            kernel, pointers = (
                _quantize_keys_kernel,
                dict(V="*i16", Elements="*u8", Scale="*u8", cu_seqlens="*i32", cu_blocks="*i32", seq_of_block="*i32"),
            )
    signature = {
        name: pointers.get(name, "constexpr" if name in constants else "fp32" if name in floats else "i32")
        for name in kernel.arg_names
    }
    return ASTSource(kernel, signature, constants), launch.options(arch)


def _operand_formats(mnemonic: str, operands: str) -> list[str]:
    if "f8f6f4" in mnemonic:
        fields = dict(re.findall(r"\b(cbsz|blgp):(\d+)", operands))
        return [F8F6F4_FORMATS[int(fields.get(field, 0))] for field in ("cbsz", "blgp")]
    for suffix, fmt in NAMED_FORMATS:
        if mnemonic.endswith(suffix):
            return [fmt, fmt]
    return ["unknown", "unknown"]


def _main_loop(lines: list[str]) -> list[str]:
    """The instructions of the loop (a label and a later branch back to it) holding the most MFMAs."""
    labels = {}
    best: list[str] = []
    for index, line in enumerate(lines):
        label = re.match(r"^(\.LBB\w+):", line)
        if label:
            labels[label.group(1)] = index
            continue
        branch = re.match(r"^\s+s_(?:cbranch_\w+|branch)\s+(\.LBB\w+)", line)
        if branch and branch.group(1) in labels:
            body = lines[labels[branch.group(1)] : index + 1]
            if sum("v_mfma" in item for item in body) > sum("v_mfma" in item for item in best):
                best = body
    return best


def read_amdgcn(asm: str) -> dict:
    """What the audit records from one AMDGCN listing (see the module docstring)."""

    def metadata(key):
        found = re.search(rf"^\s+(?:- )?\.{key}:\s+(\d+)", asm, re.M)
        return int(found.group(1)) if found else None

    lines = asm.splitlines()
    instructions = [line.split()[0] for line in lines if re.match(r"^\s+[sv]_|^\s+ds_|^\s+buffer_|^\s+global_", line)]
    mfma = Counter()
    for line in lines:
        found = re.match(r"^\s+(v_mfma\w*)\s+(.*)$", line)
        if found:
            mfma[(found.group(1), *_operand_formats(found.group(1), found.group(2)))] += 1
    loop_lines = _main_loop(lines)
    loop = [line.split()[0] for line in loop_lines if re.match(r"^\s+[sv]_|^\s+ds_", line)]
    vgprs = metadata("vgpr_count")
    granule = 8
    return {
        "mfma": [
            {"instruction": name, "a_format": a, "b_format": b, "count": count}
            for (name, a, b), count in sorted(mfma.items())
        ],
        "vgpr_count": vgprs,
        "agpr_count": metadata("agpr_count"),
        "sgpr_count": metadata("sgpr_count"),
        "vgpr_spill_count": metadata("vgpr_spill_count"),
        "sgpr_spill_count": metadata("sgpr_spill_count"),
        "waves_per_simd": (VGPRS_PER_SIMD_LANE // (-(-vgprs // granule) * granule)) if vgprs else None,
        "instructions": len(instructions),
        "main_loop": {
            "valu": sum(item.startswith("v_") and not item.startswith("v_mfma") for item in loop),
            "mfma": sum(item.startswith("v_mfma") for item in loop),
            "lds": sum(item.startswith("ds_") for item in loop),
            "salu": sum(item.startswith("s_") for item in loop),
        },
        "scaled_fp8_converts": {"kernel": _scaled_fp8_converts(lines), "main_loop": _scaled_fp8_converts(loop_lines)},
    }


def _scaled_fp8_converts(lines: list[str]) -> dict:
    """gfx950's ``v_cvt_scalef32_pk_fp8_*`` down-converts: how many, and how many take a constant scale (a literal
    such as ``1.0``: Triton's plain fp32 -> e4m3 cast) rather than a register (Note [Hardware P convert])."""
    scales = [
        re.split(r"\s+[a-z_]+:", found.group(1))[0].split(",")[-1].strip()  # the last operand, before op_sel:[...]
        for found in (re.match(r"^\s+v_cvt_scalef32_pk_fp8_\w+\s+(.*)$", line) for line in lines)
        if found
    ]
    constant = sum(not re.match(r"^-?(?:[vsa]\d|[vsa]\[|ttmp|vcc|exec|m0)", scale) for scale in scales)
    return {"count": len(scales), "constant_scale": constant}


def dot_replication(ttgir: str) -> list[dict]:
    """For each ``tt.dot`` / ``tt.dot_scaled`` in the TTGIR: its result shape and how many times the MFMA
    layout's waves x instruction tile covers it (1: each wave has its own part; 2: computed twice)."""
    layouts = {}
    for name, body in re.findall(r"^(#mma\d*) = #ttg\.amd_mfma<\{(.*?)\}>", ttgir, re.M):
        warps = [int(x) for x in re.search(r"warpsPerCTA = \[([\d, ]+)\]", body).group(1).split(",")]
        instr = [int(x) for x in re.search(r"instrShape = \[([\d, ]+)\]", body).group(1).split(",")]
        layouts[name] = (warps, instr)
    result = []
    for rows, cols, layout in re.findall(r"tt\.dot(?:_scaled)? .*-> tensor<(\d+)x(\d+)xf32, (#mma\d*)>", ttgir):
        warps, instr = layouts[layout]
        rows, cols = int(rows), int(cols)
        factor = max(1, warps[0] * instr[0] // rows) * max(1, warps[1] * instr[1] // cols)
        result.append({"result": [rows, cols], "warps_per_cta": warps, "instr_shape": instr[:2], "replication": factor})
    return result


def compile_one(config: Config, arch: str, launch: Optional[Launch] = None) -> dict:
    """Compile one configuration with ``launch`` (default: the launch table's for ``arch``) and read it."""
    launch = LAUNCHES[arch] if launch is None else launch
    source, options = _source(config, arch, launch)
    record = {"name": config.name, **dataclasses.asdict(config), "options": options}
    if config.kernel == "attention":
        record["block_m"] = launch.block_m
    try:
        compiled = triton.compile(source, target=GPUTarget("hip", arch, WAVE_SIZE), options=options)
    except Exception as error:  # a configuration that does not compile is a finding, recorded as such
        record["error"] = f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
        return record
    asm = compiled.asm["amdgcn"]
    record.update(read_amdgcn(asm))
    record["lds_bytes"] = compiled.metadata.shared
    record["amdgcn_sha256"] = hashlib.sha256(asm.encode()).hexdigest()[:16]
    if config.kernel == "attention":
        record["dots"] = dot_replication(compiled.asm["ttgir"])
    return record


def audit(arch: str, matrix: str = "full", log=None) -> dict:
    if arch not in ARCHES:
        raise ValueError(f"arch must be one of {ARCHES}; got {arch!r}")
    records = []
    for config in configs(arch, matrix):
        records.append(compile_one(config, arch))
        if log:
            log(_summary(records[-1]))
    return {
        "arch": arch,
        "matrix": matrix,
        "triton": triton.__version__,
        "launch": dataclasses.asdict(LAUNCHES[arch]),
        "configs": records,
    }


def _summary(record: dict) -> str:
    if "error" in record:
        return f"{record['name']}: {record['error']}"
    mfma = ", ".join(f"{m['instruction']}[{m['a_format']}x{m['b_format']}]x{m['count']}" for m in record["mfma"])
    loop = record["main_loop"]
    return (
        f"{record['name']}: vgpr {record['vgpr_count']} agpr {record['agpr_count']} spill {record['vgpr_spill_count']} "
        f"lds {record['lds_bytes']} loop valu {loop['valu']} mfma {loop['mfma']} | {mfma}"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", required=True, choices=ARCHES)
    parser.add_argument("--matrix", default="full", choices=("full", "ci"))
    parser.add_argument("--json", required=True, help="where to write the records")
    args = parser.parse_args(argv)
    result = audit(args.arch, args.matrix, log=lambda line: print(line, flush=True))
    with open(args.json, "w") as handle:
        json.dump(result, handle, indent=1)
    failed = [record["name"] for record in result["configs"] if "error" in record]
    print(f"{len(result['configs'])} configurations, {len(failed)} failed to compile; triton {result['triton']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
