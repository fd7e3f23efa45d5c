"""Measurement: interleaved A/B rounds timed with CUDA events, input rotation past L2, and the statistics.

Note [Interleaved rounds]
~~~~~~~~~~~~~~~~~~~~~~~~~
Clocks, temperature and the neighbours on a shared host drift over seconds. Timing kernel A for a while
and then kernel B would fold that drift into the A/B ratio. Instead every round runs each kernel of a group
`calls_per_round` times, kernels in a fresh shuffled order, and the ratio is taken per round (baseline's
median over kernel's median within the same round). The quoted speed-up is the median of the per-round
ratios and its spread is their min / quartiles / max, so a noisy round shows up as spread, not as bias.

Note [Events and the launch queue]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Each call is bracketed by its own pair of CUDA events and the median over calls is reported. An event
measures GPU time between its two records, so it is only honest while the GPU has work queued: if the
stream is idle when the start event is recorded, the host time spent launching the kernel (Python, the
CuTe-DSL dispatcher, cuDNN graph lookup: tens of microseconds) is counted too. Before each kernel's calls
a `torch.cuda._sleep` spacer (~1 ms of GPU spinning) is queued, so the host enqueues those calls while the
GPU is still busy and each start event fires right after the previous call ends. Every kernel here runs
for well over the ~0.1 ms its launch takes, so the queue stays ahead.

Note [Rotating inputs]
~~~~~~~~~~~~~~~~~~~~~~
A kernel fed the same q/k/v on every call finds part of them in L2 (50 MB on the H200) and looks faster
than in a model, where the previous layer's activations have long been evicted. The calls therefore
cycle through `rotation_count` input sets whose combined size exceeds twice the L2 size, so the set a
call reads was last touched more than one L2's worth of traffic ago.
"""

from __future__ import annotations

import math
import random
import statistics
from typing import Callable, Mapping, Sequence

import torch

SPACER_CYCLES = 2_000_000  # ~1 ms at the H200's ~1.98 GHz boost clock


def median(values: Sequence[float]) -> float:
    if not values:
        raise ValueError("median of an empty sequence")
    return statistics.median(values)


def spread(values: Sequence[float]) -> dict[str, float]:
    """min, q1, median, q3, max (quartiles by linear interpolation, numpy's default)."""
    if not values:
        raise ValueError("spread of an empty sequence")
    if len(values) == 1:
        q1 = q3 = values[0]
    else:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return {"min": min(values), "q1": q1, "median": statistics.median(values), "q3": q3, "max": max(values)}


def per_round_speedups(
    baseline_rounds: Sequence[Sequence[float]], kernel_rounds: Sequence[Sequence[float]]
) -> list[float]:
    """Per round: the baseline's median time over the kernel's (> 1 means the kernel is faster)."""
    if len(baseline_rounds) != len(kernel_rounds):
        raise ValueError(f"round counts differ: baseline {len(baseline_rounds)}, kernel {len(kernel_rounds)}")
    return [median(b) / median(k) for b, k in zip(baseline_rounds, kernel_rounds)]


def rotation_count(set_bytes: int, l2_bytes: int, minimum: int = 2) -> int:
    """The fewest input sets (at least `minimum`) whose total size exceeds 2x L2 (Note [Rotating inputs])."""
    if set_bytes < 1 or l2_bytes < 0 or minimum < 1:
        raise ValueError(f"need set_bytes >= 1, l2_bytes >= 0, minimum >= 1; got {set_bytes}, {l2_bytes}, {minimum}")
    return max(minimum, math.floor(2 * l2_bytes / set_bytes) + 1)


def round_orders(names: Sequence[str], rounds: int, seed: int) -> list[list[str]]:
    """`rounds` independent shuffles of `names`, reproducible from `seed` (Note [Interleaved rounds])."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    rng = random.Random(seed)
    orders = []
    for _ in range(rounds):
        order = list(names)
        rng.shuffle(order)
        orders.append(order)
    return orders


def time_interleaved(
    launchers: Mapping[str, Sequence[Callable[[], object]]],
    *,
    rounds: int,
    calls_per_round: int,
    warmup: int,
    seed: int,
    on_round: Callable[[int], None] | None = None,
) -> tuple[dict[str, list[list[float]]], dict[str, str]]:
    """Time every kernel of a group in interleaved rounds on the current CUDA device.

    `launchers[name]` holds one zero-argument launch per rotating input set (the same sets for every
    kernel); the group's i-th call, whichever kernel makes it, uses set i mod n.
    Returns (times, errors): `times[name][round]` is that round's list of per-call milliseconds; a kernel
    that raises is dropped from later rounds, loses its partial times and gets its message in `errors`.
    """
    if calls_per_round < 1 or warmup < 0:
        raise ValueError(f"need calls_per_round >= 1 and warmup >= 0, got {calls_per_round}, {warmup}")
    times: dict[str, list[list[float]]] = {name: [] for name in launchers}
    errors: dict[str, str] = {}
    cursor = 0  # shared by all kernels: consecutive calls never read the same input set

    def next_launch(name):
        nonlocal cursor
        sets = launchers[name]
        launch = sets[cursor % len(sets)]
        cursor += 1
        return launch

    for name in launchers:
        try:
            for _ in range(warmup):
                next_launch(name)()
        except Exception as exc:  # a kernel failing mid-benchmark is reported in its row; the others go on
            errors[name] = f"{type(exc).__name__}: {exc}"
    torch.cuda.synchronize()

    for r, order in enumerate(round_orders([n for n in launchers if n not in errors], rounds, seed)):
        pending = []
        for name in order:
            if name in errors:
                continue
            torch.cuda._sleep(SPACER_CYCLES)
            events = []
            try:
                for _ in range(calls_per_round):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    launch = next_launch(name)
                    start.record()
                    launch()
                    end.record()
                    events.append((start, end))
            except Exception as exc:
                errors[name] = f"{type(exc).__name__}: {exc}"
                continue
            pending.append((name, events))
        torch.cuda.synchronize()
        for name, events in pending:
            times[name].append([start.elapsed_time(end) for start, end in events])
        if on_round is not None:
            on_round(r)
    for name in errors:
        times[name] = []
    return times, errors
