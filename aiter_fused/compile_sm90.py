"""Compile the Fused-Softmax kernel for the H200 (sm_90a) on a CPU and read its SASS.

    python -m aiter_fused.compile_sm90                       # the launch table's sm90 entry, every dot mode
    python -m aiter_fused.compile_sm90 --block-m 64 --num-warps 4 --num-stages 3 --json FILE

The PyPI Triton wheel ships ptxas and cuobjdump, so ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90,
32))`` gives the cubin without a GPU. What a launch compiles depends on the argument values too: Triton turns an
integer argument equal to 1 into a constant and marks one divisible by 16 (and 16-byte aligned pointers) as such,
which decides whether loads are vectorized and pipelined (Note [Compile as the runtime does]). Each configuration
is therefore compiled with the values ``attention._launch`` passes for the benchmark's shape (32K tokens, 16 heads:
``bench/kernels.py``), and the record holds registers, stack (spills), shared memory, the wgmma/mma instructions
in the PTX and the instruction counts of the main loop (the loop with the most warpgroup MMAs), per score element and
thread (Note [Per-element counts]).

Note [Compile as the runtime does]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
``compile_check.py`` (the AMD audit) compiles with every integer unspecialized. On sm_90 that hides what a call
runs: with no divisibility the K/V loads are 2-byte scalar loads, which Triton's pipeliner cannot turn into
``cp.async``, so the audit's sm_90 build of the exact twin has no software pipelining at all, while a real call
(strides 2048 and 128, pointers aligned) gets 16-byte ``cp.async`` and ``num_stages`` buffers. The specialization
here is Triton's own (``triton.runtime.jit.native_specialize_impl``) applied to the argument values.

Note [Per-element counts]
~~~~~~~~~~~~~~~~~~~~~~~~~
One pass of the main loop is one KV tile: each of the ``32 * num_warps`` threads holds ``BLOCK_M * BLOCK_N / (32 *
num_warps)`` scores of it (64 at BLOCK_M 128, BLOCK_N 128, 8 warps). Hopper issues one warp instruction per clock
per SMSP whatever the pipe, so loop instructions / scores per thread is the issue cost per score element, the number
FA4's SM90 budget is written in (``docs/fa4_notes.md``: stock's main loop is 474 instructions per warp and 128 x 128
tile, 7.4 per element).

Note [SASS control bits]
~~~~~~~~~~~~~~~~~~~~~~~~
From Volta on, every SASS instruction is one 128-bit word, and ptxas writes its static schedule into the word's top
bits: ``cuobjdump -sass`` prints the word as two 64-bit halves, low then high, and the control field starts at bit
41 of the high half (bit 105 of the word). In order from there: stall count (4 bits: cycles the warp waits before
issuing its next instruction, covering fixed-latency dependencies), yield (1 bit), write barrier index (3 bits; 7 =
none: the scoreboard a variable-latency result releases), read barrier index (3 bits; 7 = none: released when the
operands have been read), wait-barrier mask (6 bits: the scoreboards this instruction waits for), reuse (4 bits,
operand reuse cache). Sources: CuAssembler's ``CuSMVersion.py`` (github.com/cloudcores/CuAssembler: ``CCPos_7x_8x
= 64+41``, a 17-bit mask without the reuse bits), SASSOverlay's ``sassoverlay.py`` (github.com/sebftw/SASSOverlay:
the fields in this order and widths, from the Turing paper arXiv 1903.07486), and maxas's Control-Codes wiki (the
fields' meaning). Checked on this kernel: every LDG sets a write barrier and the first instruction to read its
result waits on that barrier's bit. ``loop_schedule`` sums the stall counts over the main loop and counts the waits
by the instruction that set the barrier (Note [Latency rule] in ``cost_model.py`` says what the model does with
them).
"""

import argparse
import dataclasses
import json
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Optional

import torch
import triton
from triton import knobs
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import native_specialize_impl

from aiter_fused.attention import DOT_MODES, _operand_format
from aiter_fused.compile_check import Config, _source
from aiter_fused.launch import LAUNCHES, Launch
from fa4_rowmax.config import MX_FORMATS

__all__ = ["BENCH_SHAPE", "compile_one", "decode_control", "loop_counts", "loop_schedule", "main"]

BENCH_SHAPE = dict(tokens=32768, heads=16)  # batch x seqlen = 32K tokens, 16 heads (bench/kernels.py)
_SASS = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")
_HIGH_WORD = re.compile(r"^\s*/\* (0x[0-9a-f]{16}) \*/\s*$")  # the line after an instruction: its high 64 bits
_BRANCH_TARGET = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")
_GMMA = ("HGMMA", "QGMMA")


def _integer_arguments(config: Config, tokens: int, heads: int) -> dict:
    """The integer arguments ``attention._launch`` passes for dense inputs of ``tokens`` x ``heads``, MHA, with
    the operand layouts of ``quantize.py`` (meta tensors: shapes and strides only)."""
    d, exact, mode = config.head_dim, config.dot_mode is None, config.dot_mode
    meta = dict(device="meta")
    packed = _operand_format(config.mx_format, exact, mode or "bf16") == "e2m1"
    q = torch.empty(tokens, heads, d // 2 if packed else d, dtype=torch.uint8, **meta)
    if exact:
        scale = torch.empty(1, 1, 1, dtype=torch.uint8, **meta)
        q_scale = k_scale = v_scale = scale
        v = q
    else:
        q_scale = k_scale = torch.empty(tokens, heads, d // 32, dtype=torch.uint8, **meta)
        v_scale = torch.empty(tokens // 32, heads, d, dtype=torch.uint8, **meta)
        if mode == "fp8":  # keys contiguous, padded to 16 (quantize_keys)
            v = torch.empty(heads, d, -(-tokens // 16) * 16, dtype=torch.uint8, **meta).permute(2, 0, 1)
        elif packed:
            v = torch.empty(tokens // 2, heads, d, dtype=torch.uint8, **meta)
        else:
            v = q
    out = torch.empty(tokens, heads, d, dtype=torch.bfloat16, **meta)
    return dict(
        stride_qt=q.stride(0),
        stride_qh=q.stride(1),
        stride_kt=q.stride(0),
        stride_kh=q.stride(1),
        stride_vt=v.stride(0),
        stride_vh=v.stride(1),
        stride_vd=v.stride(2),
        stride_qst=q_scale.stride(0),
        stride_qsh=q_scale.stride(1),
        stride_kst=k_scale.stride(0),
        stride_ksh=k_scale.stride(1),
        stride_vsb=v_scale.stride(0),
        stride_vsh=v_scale.stride(1),
        stride_ot=out.stride(0),
        stride_oh=out.stride(1),
        stride_lh=tokens,
    )


def _specialized_source(config: Config, launch: Launch, tokens: int, heads: int) -> ASTSource:
    """``compile_check._source``'s kernel, signature and constants, specialized on the argument values as a
    launch is (Note [Compile as the runtime does]); pointers are taken as 16-byte aligned."""
    source, _ = _source(config, "sm90", launch)
    values = _integer_arguments(config, tokens, heads)
    signature, constants, attrs = dict(source.signature), dict(source.constants), {}
    names = source.fn.arg_names
    for index, name in enumerate(names):
        kind = signature[name]
        if kind.startswith("*"):
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif name in values:
            kind, flags = native_specialize_impl(BaseBackend, values[name], False, True, True)
            if kind == "constexpr":
                signature[name], constants[(index,)] = "constexpr", values[name]
            else:
                signature[name] = kind
                if flags:
                    attrs[(index,)] = BaseBackend.parse_attr(flags)
    return ASTSource(source.fn, signature, {names[key[0]]: value for key, value in constants.items()}, attrs)


def _instructions(sass: str) -> list[tuple[int, str, Optional[int]]]:
    """(address, instruction, high 64 bits of its encoding or None) of every SASS line, the guard predicate kept."""
    result = []
    for line in sass.splitlines():
        found = _SASS.search(line)
        if found:
            address = re.search(r"/\*([0-9a-f]{4,})\*/", line).group(1)
            result.append((int(address, 16), found.group(1), None))
        elif result and result[-1][2] is None and (high := _HIGH_WORD.match(line)):
            result[-1] = (*result[-1][:2], int(high.group(1), 16))
    return result


def _mnemonic(instruction: str) -> str:
    return (instruction.split(None, 1)[1] if instruction.startswith("@") else instruction).split()[0]


def _main_loop(sass: str) -> list[tuple[int, str, Optional[int]]]:
    """The main loop's instructions: the span from a backward branch's target to the branch holding the most
    warpgroup MMAs (HGMMA for BF16, QGMMA for FP8)."""
    instructions = _instructions(sass)
    index_of = {address: index for index, (address, _, _) in enumerate(instructions)}
    best: list = []
    for index, (address, text, _) in enumerate(instructions):
        target = _BRANCH_TARGET.search(text)
        if target and int(target.group(1), 16) <= address and int(target.group(1), 16) in index_of:
            body = instructions[index_of[int(target.group(1), 16)] : index + 1]
            if sum(_mnemonic(t).startswith(_GMMA) for _, t, _ in body) > sum(
                _mnemonic(t).startswith(_GMMA) for _, t, _ in best
            ):
                best = body
    return best


def loop_counts(sass: str) -> dict:
    """Mnemonic counts of the main loop (``_main_loop``)."""
    return dict(Counter(_mnemonic(text) for _, text, _ in _main_loop(sass)))


def decode_control(high_word: int) -> dict:
    """Note [SASS control bits]: the scheduling fields of one instruction from the high 64 bits of its encoding."""
    control = high_word >> 41
    return dict(
        stall=control & 0xF,
        yield_bit=(control >> 4) & 1,
        write_barrier=(control >> 5) & 7,
        read_barrier=(control >> 8) & 7,
        wait_mask=(control >> 11) & 0x3F,
        reuse=(control >> 17) & 0xF,
    )


# What set a barrier another instruction waits on, by the producer's mnemonic (Note [Latency rule], cost_model.py).
_PRODUCERS = (
    ("global or local memory", ("LDG", "LDGSTS", "LDGDEPBAR", "LDL", "STL", "STG", "LD", "ST")),
    ("shared memory", ("LDS", "LDSM", "STS", "STSM", "ATOMS")),
    ("MUFU", ("MUFU",)),
    ("shuffle", ("SHFL",)),
    ("warpgroup MMA", ("HGMMA", "QGMMA", "WARPGROUP")),
    ("barrier", ("BAR", "SYNCS")),
)


# Instructions that wait by themselves, outside the scoreboards: a cp.async group, the warpgroup MMAs, the CTA barrier.
_WAIT_INSTRUCTIONS = ("DEPBAR", "WARPGROUP.DEPBAR", "BAR.SYNC")


def _producer_class(mnemonic: str) -> str:
    base = mnemonic.split(".")[0]
    for name, bases in _PRODUCERS:
        if base in bases:
            return name
    return "other"


def loop_schedule(sass: str) -> dict:
    """ptxas's static schedule of the main loop (Note [SASS control bits]): the stall counts summed (cycles one warp
    spends per pass on fixed-latency dependencies and issue, as scheduled), and the scoreboard waits counted by the
    class of the instruction that set the barrier, found backwards through the loop (cyclically: a pass waits on
    the previous pass's producers); a barrier last set before the loop counts as "before the loop"."""
    loop = _main_loop(sass)
    controls = [decode_control(high) for _, _, high in loop]
    mnemonics = [_mnemonic(text) for _, text, _ in loop]
    waits: Counter = Counter()
    for index, control in enumerate(controls):
        for barrier in range(6):
            if not control["wait_mask"] >> barrier & 1:
                continue
            producer = "before the loop"
            for back in range(1, len(loop) + 1):
                earlier = controls[index - back]
                if barrier in (earlier["write_barrier"], earlier["read_barrier"]):
                    producer = _producer_class(mnemonics[index - back])
                    break
            waits[producer] += 1
    return dict(
        stall_cycles=sum(control["stall"] for control in controls),
        waits=dict(sorted(waits.items())),
        waiting_instructions=sum(control["wait_mask"] != 0 for control in controls),
        wait_instructions=sum(m.startswith(_WAIT_INSTRUCTIONS) for m in mnemonics),
    )


def _resources(cubin: Path) -> dict:
    usage = subprocess.run(
        [knobs.nvidia.cuobjdump.path, "-res-usage", str(cubin)], check=True, capture_output=True, text=True
    ).stdout
    fields = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", usage))
    return {"registers": int(fields["REG"]), "stack_bytes": int(fields["STACK"])}


def compile_one(config: Config, launch: Launch, shape: Optional[dict] = None) -> dict:
    """Compile one configuration for sm_90a with ``launch`` and read it (see the module docstring)."""
    shape = BENCH_SHAPE if shape is None else shape
    options = dict(launch.options("sm90"))
    record = {"name": config.name, "launch": dataclasses.asdict(launch), "options": options}
    compiled = triton.compile(
        _specialized_source(config, launch, **shape), target=GPUTarget("cuda", 90, 32), options=options
    )
    with tempfile.TemporaryDirectory() as work:
        cubin = Path(work) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        sass = subprocess.run(
            [knobs.nvidia.cuobjdump.path, "-sass", str(cubin)], check=True, capture_output=True, text=True
        ).stdout
        record.update(_resources(cubin))
    loop = loop_counts(sass)
    schedule = loop_schedule(sass)
    threads = 32 * launch.num_warps
    scores_per_thread = launch.block_m * config.tile_n // threads
    record.update(
        shared_bytes=compiled.metadata.shared,
        mma=dict(Counter(re.findall(r"(wgmma\.mma_async\S*|mma\.sync\S*)", compiled.asm["ptx"]))),
        cp_async=len(re.findall(r"cp\.async\.(?:cg|ca)\.shared", compiled.asm["ptx"])),
        loop_instructions=sum(loop.values()),
        scores_per_thread=scores_per_thread,
        per_element=round(sum(loop.values()) / scores_per_thread, 2),
        loop=dict(sorted(loop.items(), key=lambda item: -item[1])),
        loop_stall_cycles=schedule["stall_cycles"],
        loop_waits=schedule["waits"],
        loop_waiting_instructions=schedule["waiting_instructions"],
        loop_wait_instructions=schedule["wait_instructions"],
    )
    return record


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sm90 = LAUNCHES["sm90"]
    parser.add_argument("--modes", nargs="+", default=["exact", *DOT_MODES], choices=["exact", *DOT_MODES])
    parser.add_argument("--masks", nargs="+", default=["dense", "causal"], choices=["dense", "causal"])
    parser.add_argument("--mx-format", default="mxfp8", choices=MX_FORMATS)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-m", type=int, default=sm90.block_m)
    parser.add_argument("--tile-n", type=int, default=sm90.tile_n)
    parser.add_argument("--num-warps", type=int, default=sm90.num_warps)
    parser.add_argument("--num-stages", type=int, default=sm90.num_stages)
    parser.add_argument("--kv-tile-offsets", type=int, choices=(0, 1), default=int(sm90.kv_tile_offsets))
    parser.add_argument("--json", help="where to write the records")
    args = parser.parse_args(argv)
    launch = dataclasses.replace(
        sm90,
        block_m=args.block_m,
        tile_n=args.tile_n,
        num_warps=args.num_warps,
        num_stages=args.num_stages,
        kv_tile_offsets=bool(args.kv_tile_offsets),
    )
    records = []
    for mode in args.modes:
        for causal in [mask == "causal" for mask in args.masks]:
            config = Config(
                "attention", args.mx_format, args.head_dim, None if mode == "exact" else mode, causal, args.tile_n
            )
            record = compile_one(config, launch)
            records.append(record)
            print(
                f"{record['name']}: block_m {launch.block_m} warps {launch.num_warps} stages {launch.num_stages} "
                f"tile offsets {int(launch.kv_tile_offsets)} | "
                f"regs {record['registers']} stack {record['stack_bytes']} smem {record['shared_bytes']} | loop "
                f"{record['loop_instructions']} = {record['per_element']}/element | {record['mma']}",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps({"triton": triton.__version__, "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
