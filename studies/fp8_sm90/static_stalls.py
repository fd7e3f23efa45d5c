#!/usr/bin/env python3
"""The main loop's softmax in the SM90 FP8 forward's SASS: instructions and ptxas's static stall cycles per score.

    python -m studies.fp8_sm90.static_stalls [OUT.md]

Asks whether three consumer warpgroups (tile_m 192, 160 registers a thread) get a worse softmax schedule from
ptxas than two (tile_m 128, 240 registers) at the same tile: each variant compiles non-causal (head dim 128, 256
keys: the first block and the main loop) in its own subprocess (`compile_check.compile_fp8_sm90`), and the study
reads, in the main loop, the stretch from the S GEMM's wait to the first P.V GEMM.

Note [Static stall cycles]
~~~~~~~~~~~~~~~~~~~~~~~~~~
Every Volta-and-later SASS instruction carries control bits that ptxas sets: in the high 64-bit word of the
128-bit encoding, bits 41-44 are the stall count (cycles the warp waits before it may issue its next instruction),
bit 45 the yield flag, then the write and read scoreboard indices and the wait mask (Jia et al., "Dissecting
the NVIDIA Volta GPU Architecture via Microbenchmarking", 2018, section 2.1; the layout is unchanged on Hopper's
sm_90a as far as cuobjdump's output shows). Their sum over a stretch is the cycles one warp spends issuing it
alone when every scoreboard wait is already satisfied: a lower bound on its latency, blind to the variable
latencies (MUFU, shared memory, wgmma waits) and to other warps competing for the same scheduler. Equal sums per
score at two register budgets mean ptxas scheduled the arithmetic alike; a runtime difference then comes from
the dynamic effects, which only a profile shows.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from fa4_rowmax.testing import compile_check

_BASE = dict(causal=False, softmax_mode="rowmax_h15", clamp="sat", row_sum="mma", intra_wg_overlap=False)
VARIANTS = {
    "h15_m128_n256": dict(_BASE, tile_m=128, tile_n=256),  # the two-warpgroup default's tile
    "h15_m128_n160": dict(_BASE, tile_m=128, tile_n=160),
    "h15_m192_n160": dict(_BASE, tile_m=192, tile_n=160),  # the non-causal default (Note [Tuned defaults])
    "h15_m192_n128": dict(_BASE, tile_m=192, tile_n=128),
}
PV_N = 136  # head dim 128 + the MMA row sum's 8 columns
STALL_SHIFT, STALL_MASK = 41, 0xF

_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);\s*/\*\s*(0x[0-9a-f]+)\s*\*/")
_HIGH_WORD = re.compile(r"^\s*/\*\s*(0x[0-9a-f]+)\s*\*/\s*$")
_BRANCH_TARGET = re.compile(r"\bBRA\b.*?(0x[0-9a-f]+)")


@dataclass(frozen=True)
class Instruction:
    address: int
    text: str
    stall: int

    @property
    def opcode(self) -> str:
        words = self.text.split()
        return words[1] if words[0].startswith("@") else words[0]


def parse(sass: str) -> list[Instruction]:
    """cuobjdump -sass text -> instructions with their stall count (Note [Static stall cycles]); each instruction
    line carries the low encoding word, the line after it the high word."""
    lines = sass.splitlines()
    out = []
    for line, following in zip(lines, lines[1:] + [""]):
        match = _INSTRUCTION.search(line)
        if match is None:
            continue
        high = _HIGH_WORD.match(following)
        if high is None:
            raise ValueError(f"no high encoding word after {line.strip()!r}")
        stall = (int(high.group(1), 16) >> STALL_SHIFT) & STALL_MASK
        out.append(Instruction(int(match.group(1), 16), match.group(2).strip(), stall))
    return out


def main_loop(instructions: list[Instruction], pv_n: int = PV_N) -> list[Instruction]:
    """The consumer's main loop: the shortest backward-branch body holding both a P.V GEMM (N = pv_n) and another
    wgmma (the S GEMM). Longer ones are the barrier-wait retry branches ptxas puts at the kernel's end, which jump
    back to the wait they retry and so span most of the kernel."""
    loops = []
    for branch in instructions:
        target = _BRANCH_TARGET.search(branch.text)
        if branch.opcode != "BRA" or target is None or int(target.group(1), 16) >= branch.address:
            continue
        body = [i for i in instructions if int(target.group(1), 16) <= i.address <= branch.address]
        gemms = {i.opcode.startswith(f"QGMMA.64x{pv_n}x") for i in body if i.opcode.startswith("QGMMA")}
        if gemms == {True, False}:
            loops.append(body)
    if not loops:
        raise ValueError("no backward branch around an S and a P.V wgmma: no main loop")
    return min(loops, key=len)


def softmax_stretch(loop: list[Instruction], pv_n: int = PV_N) -> list[Instruction]:
    """From after the first wgmma wait (the S GEMM's) to the first P.V GEMM."""
    start = next(k for k, i in enumerate(loop) if i.opcode.startswith("WARPGROUP.DEPBAR")) + 1
    end = next(k for k in range(start, len(loop)) if loop[k].opcode.startswith(f"QGMMA.64x{pv_n}x"))
    return loop[start:end]


def summarize(name: str, tile_n: int, loop: list[Instruction]) -> dict:
    stretch = softmax_stretch(loop)
    scores = tile_n // 2  # per thread and tile: 64 rows x tile_n over a warpgroup's 128 threads
    return {
        "variant": name,
        "loop instructions": len(loop),
        "loop stall cycles": sum(i.stall for i in loop),
        "loop local accesses": sum(i.opcode.startswith(("STL", "LDL")) for i in loop),
        "softmax instructions": len(stretch),
        "softmax stall cycles": sum(i.stall for i in stretch),
        "per score: instructions": len(stretch) / scores,
        "per score: stall cycles": sum(i.stall for i in stretch) / scores,
        "top opcodes": Counter(i.opcode.split(".")[0] for i in stretch).most_common(5),
    }


def table(rows: list[dict]) -> str:
    keys = [k for k in rows[0] if k != "top opcodes"]
    lines = ["| " + " | ".join(keys) + " |", "| " + " | ".join("---" for _ in keys) + " |"]
    for row in rows:
        lines.append("| " + " | ".join(f"{row[k]:.2f}" if isinstance(row[k], float) else str(row[k]) for k in keys))
        lines[-1] += " |"
    return "\n".join(lines)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    workdir = Path(tempfile.mkdtemp(prefix="fp8_stalls_"))
    site = compile_check.prepare_fa4_copies(workdir)["patched"]
    rows = []
    for name, kwargs in VARIANTS.items():
        cubin = compile_check.compile_fp8_sm90(kwargs, workdir / name, site)
        sass = subprocess.run(
            [compile_check.cuobjdump(), "-sass", str(cubin)], check=True, capture_output=True, text=True
        )
        rows.append(summarize(name, kwargs["tile_n"], main_loop(parse(sass.stdout))))
    text = table(rows)
    print(text)
    if argv:
        Path(argv[0]).write_text(text + "\n")


if __name__ == "__main__":
    main()
