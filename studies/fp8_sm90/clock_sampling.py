#!/usr/bin/env python3
"""SM clock and board power sampled beside each kernel's steady run: does a kernel lose to another because the GPU
clocks it lower?

    python3 -m studies.fp8_sm90.clock_sampling --seqlen 32768 --causal --heads-kv 4 --seconds 3 --repeats 3 \\
        --kernels fa4_fp8_h15_two_level_per_tile fa4_fp8_h15_two_level_persistent > OUT/clocks.md

Each kernel (a `bench.kernels.KERNELS` name, bound to the bench's inputs: N(0, 1) cast to e4m3, 32K tokens per
call, 16 query heads) runs back to back for --seconds, kernels alternating, --repeats times, while `nvidia-smi`
samples the SM clock and the power draw every --interval-ms. Each phase reports its time per call (calls over the
phase's CUDA-event span) and the mean clock and power of the samples taken inside it (the first quarter of each phase
dropped: the clock settles after a change of load). Inputs are not rotated past the L2, as in the bench: a kernel
here reads the same Q, K and V each call, so the ratio of times is not the bench's, only the clocks are the point.

Note [Clocks under a power cap]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
The H200 boosts to 1,980 MHz while its board stays under its 700 W cap and lowers the clock when it would not.
Two kernels that do the same work in the same cycles can then take different times if one keeps the SMs busier
(fewer idle gaps between work tiles), draws more power and runs at a lower clock. Nsight Compute's default
`--clock-control base` pins the clock, so a difference that survives it is in cycles, not in the clock; this study
reads the clock the benchmark runs at.
"""

import dataclasses
import subprocess
import time
from statistics import mean

import torch

from bench.check import make_inputs
from bench.kernels import KERNELS
from studies.fp8_sm90.ncu_profile import bench_shape, shape_parser

SETTLE_FRACTION = 0.25


@dataclasses.dataclass(frozen=True)
class Sample:
    t: float  # seconds, time.time()
    sm_mhz: float
    power_w: float


@dataclasses.dataclass(frozen=True)
class Phase:
    kernel: str
    start: float
    end: float
    calls: int
    ms_per_call: float


def parse_samples(text: str) -> list:
    """`nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw --format=csv,noheader,nounits` lines as Samples (the
    timestamp is `YYYY/MM/DD HH:MM:SS.mmm`, local time)."""
    samples = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != 3:
            continue
        stamp, mhz, watts = parts
        try:
            whole, _, millis = stamp.partition(".")
            t = time.mktime(time.strptime(whole, "%Y/%m/%d %H:%M:%S")) + float("0." + (millis or "0"))
            samples.append(Sample(t, float(mhz), float(watts)))
        except ValueError:
            continue
    return samples


def phase_means(phase: Phase, samples: list) -> dict:
    """Mean clock and power of the samples inside a phase, its first SETTLE_FRACTION dropped."""
    start = phase.start + SETTLE_FRACTION * (phase.end - phase.start)
    inside = [s for s in samples if start <= s.t <= phase.end]
    if not inside:
        return {"samples": 0, "sm_mhz": float("nan"), "power_w": float("nan")}
    return {
        "samples": len(inside),
        "sm_mhz": mean(s.sm_mhz for s in inside),
        "power_w": mean(s.power_w for s in inside),
    }


def table(phases: list, samples: list) -> str:
    """One markdown row per phase, then per kernel the median of its phases."""
    rows = ["| kernel | phase | ms per call | SM MHz | W | samples |", "| --- | --- | --- | --- | --- | --- |"]
    per_kernel = {}
    for i, phase in enumerate(phases):
        m = phase_means(phase, samples)
        per_kernel.setdefault(phase.kernel, []).append((phase.ms_per_call, m["sm_mhz"], m["power_w"]))
        cells = (phase.kernel, i, f"{phase.ms_per_call:.4f}", f"{m['sm_mhz']:.0f}", f"{m['power_w']:.0f}", m["samples"])
        rows.append("| " + " | ".join(map(str, cells)) + " |")
    rows += ["", "| kernel | median ms per call | median SM MHz | median W |", "| --- | --- | --- | --- |"]
    for kernel, values in per_kernel.items():
        ms, mhz, watts = (sorted(column)[len(column) // 2] for column in zip(*values))
        rows.append(f"| {kernel} | {ms:.4f} | {mhz:.0f} | {watts:.0f} |")
    return "\n".join(rows)


def run_phase(name: str, launch, seconds: float) -> Phase:
    start_event, end_event = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start = time.time()
    start_event.record()
    calls = 0
    while time.time() - start < seconds:
        for _ in range(10):
            launch()
        calls += 10
        torch.cuda.synchronize()
    end_event.record()
    torch.cuda.synchronize()
    end = time.time()
    return Phase(name, start, end, calls, start_event.elapsed_time(end_event) / calls)


def main(argv=None) -> None:
    parser = shape_parser(__doc__.splitlines()[0], seqlen=32768)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--interval-ms", type=int, default=50)
    args = parser.parse_args(argv)
    shape = bench_shape(parser, args)
    ((q, k, v),) = make_inputs(shape, 1, "cuda", seed=0)
    launches = {name: KERNELS[name].bind(q, k, v, args.causal) for name in args.kernels}
    for launch in launches.values():  # compile and warm
        launch()
    torch.cuda.synchronize()
    query = "--query-gpu=timestamp,clocks.sm,power.draw"
    sampler = subprocess.Popen(
        ["nvidia-smi", query, "--format=csv,noheader,nounits", f"--loop-ms={args.interval_ms}"],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        phases = [
            run_phase(name, launch, args.seconds) for _ in range(args.repeats) for name, launch in launches.items()
        ]
    finally:
        sampler.terminate()
        text, _ = sampler.communicate(timeout=10)
    print(f"{dataclasses.asdict(shape)}, {args.seconds} s a phase, nvidia-smi every {args.interval_ms} ms\n")
    print(table(phases, parse_samples(text)))


if __name__ == "__main__":
    main()
