#!/usr/bin/env python3
"""Tune the aiter_fused exact twin's launch on the H200 against FA4 stock, and time the MX paths (issue 14, item 5).

    python3 -m studies.aiter_h200_tune.tune OUTDIR [--seqlens 8K 16K] [--rounds 5] [--max-minutes 3.5]

One sm_90 GPU (the H200), about 4 minutes. Writes OUTDIR/aiter_h200_tune.json (after every group, so a run cut
short keeps what it measured) and prints one line per gate and per timed kernel.

1. Gate: every candidate launch of the exact twin (``CANDIDATES``), FA4 stock and the MX rows run on two small
   shapes (``GATE_SHAPES``: a tail tile, a partial query block, seqlen_q != seqlen_k; FA4 stock on the square
   one only), both masks, and their outputs are compared with fp32 attention of the same BF16 inputs
   (``bench.check``) at the bench's tolerances (``bench.kernels``, Note [Gate tolerances]: 1e-2 for exact
   softmax, the MX formats' own); the exact twin's LSE also against the fp32 log-sum-exp, within ``LSE_TOL``.
   A kernel that fails is not timed.
   The gate shapes are chosen so that the kernels compile exactly as at the timed shapes (every integer
   argument has the same divisibility by 16), so the gate is also the compile warm-up.
2. Time: the bench's shapes (batch x seqlen = 32K tokens, 16 heads, head dim 128, BF16), causal and not, with
   ``bench.timing.time_interleaved``: interleaved rounds in shuffled order, CUDA events per call, inputs
   rotated past 2x L2 (Notes [Interleaved rounds], [Rotating inputs]); FA4 stock, each candidate, and the MX
   rows (``MX_ROWS``: the sm_90 default "fp8" mode for the three formats, "bf16" and "scaled" for MXFP8, at
   the launch table's sm90 entry; and MXFP8 "fp8" at the previous launch, ``PREVIOUS``).
3. Report: per kernel the median time, TFLOPS (``bench.sweep.tflops``) and the ratio to FA4 stock (the
   median over rounds of FA4's time over the kernel's in the same round); per candidate the worst ratio over
   the shapes, and whether it reaches the goal (``GOAL``: 0.6x FA4 stock at every shape).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

from aiter_fused.launch import LAUNCHES, Launch
from bench.sweep import format_seqlen, parse_seqlen

GOAL = 0.6  # issue 14, item 5: the exact twin at >= 0.6x FA4 stock, 8K and 16K, head dim 128, both masks
TABLE = LAUNCHES["sm90"]
PREVIOUS = Launch(block_m=64, num_warps=4, tile_n=128, num_stages=3)  # the launch before the sm90 entry


def _name(launch: Launch) -> str:
    tile_offsets = "_tileoff" if launch.kv_tile_offsets else ""  # Note [KV addresses] in aiter_fused/kernel.py
    return f"m{launch.block_m}_n{launch.tile_n}_w{launch.num_warps}_s{launch.num_stages}{tile_offsets}"


# The sm90 entry of commit dc034a1, which the candidates vary one field at a time (the set the 2026-12-01 H200 run
# timed; the table's entry is now its per-element-address sibling, m128_n128_w8_s3: Note [Launch table]).
BASE = Launch(block_m=128, num_warps=8, tile_n=128, num_stages=3, kv_tile_offsets=True)
# The exact twin's candidates (docs/aiter_h200.md): the base first, then one change at a time. Two 64-row
# programs of 4 warps fit an SM at tile 64 (112 KB of shared memory each at 3 stages): their softmax and GEMMs
# interleave without the per-tile CTA barrier that keeps one program's two warpgroups in step.
CANDIDATES = {
    _name(launch): launch
    for launch in (
        BASE,
        dataclasses.replace(BASE, kv_tile_offsets=False),
        dataclasses.replace(BASE, num_stages=2),
        dataclasses.replace(BASE, tile_n=64),
        dataclasses.replace(BASE, tile_n=64, num_stages=4),
        dataclasses.replace(BASE, block_m=64, num_warps=4, tile_n=64),
        PREVIOUS,
    )
}
assert _name(TABLE) in CANDIDATES, "the launch table's sm90 entry must be one of the timed candidates"
# (row name, mx_format, dot_mode, launch); dot_mode None is the architecture's default ("fp8" on sm_90).
MX_ROWS = (
    ("mxfp8_fp8", "mxfp8", None, None),
    ("mxfp6_fp8", "mxfp6", None, None),
    ("mxfp4_fp8", "mxfp4", None, None),
    ("mxfp8_bf16", "mxfp8", "bf16", None),
    ("mxfp8_scaled", "mxfp8", "scaled", None),
    (f"mxfp8_fp8_{_name(PREVIOUS)}", "mxfp8", None, PREVIOUS),
)
# (batch, seqlen_q, seqlen_k): batch * seqlen_q and batch * seqlen_k divisible by 16, as at the timed shapes.
GATE_SHAPES = ((2, 1000, 1000), (2, 776, 1104))
HEADS, HEAD_DIM, TOKENS = 16, 128, 32768
# The exact twin's LSE against fp32 log-sum-exp of the same inputs: the scores differ by the fp32 summation
# order (~1e-6 relative), ex2.approx by ~2**-22; 1e-4 as tests/test_aiter_fused_kernel.py holds it.
LSE_TOL = 1e-4


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="output directory (created)")
    parser.add_argument("--seqlens", nargs="+", type=parse_seqlen, default=[8192, 16384], help="e.g. 8K 16K")
    parser.add_argument("--candidates", nargs="+", choices=list(CANDIDATES), default=list(CANDIDATES))
    parser.add_argument("--no-mx", action="store_true", help="time the exact twin's candidates and FA4 only")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=3, help="calls per kernel and round")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--max-minutes", type=float, default=3.5, help="no new timing group starts after this (gates included)"
    )
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.calls < 1:
        parser.error("--rounds and --calls must be >= 1")
    return args


def _exact(candidate: Launch):
    from aiter_fused.attention import fused_softmax_attention

    return lambda q, k, v, causal: fused_softmax_attention(q, k, v, causal=causal, exact=True, launch=candidate)


def _mx(mx_format: str, dot_mode, launch):
    from aiter_fused.attention import fused_softmax_attention

    return lambda q, k, v, causal: fused_softmax_attention(
        q, k, v, causal=causal, mx_format=mx_format, dot_mode=dot_mode, launch=launch
    )


def kernels(args) -> tuple[dict, dict]:
    """(FA4 stock and the exact twin's candidates, the MX rows): name -> (call(q, k, v, causal) -> out or
    (out, lse), gate tolerance, whether the LSE is gated too)."""
    from bench.kernels import BASELINE, KERNELS

    exact_tol = KERNELS[BASELINE].tolerance("bf16")
    exact = {BASELINE: (lambda q, k, v, causal: KERNELS[BASELINE].bind(q, k, v, causal)(), exact_tol, False)}
    for name in args.candidates:
        exact[f"exact_{name}"] = (_exact(CANDIDATES[name]), exact_tol, True)
    mx = {}
    for name, mx_format, dot_mode, launch in () if args.no_mx else MX_ROWS:
        mx[name] = (_mx(mx_format, dot_mode, launch), KERNELS[f"aiter_{mx_format}"].tolerance("bf16"), False)
    return exact, mx


def _reference_lse(q, k, v, causal):
    """fp32 log-sum-exp of the scaled scores, (batch, heads, seqlen_q), bottom-right causal."""
    import torch

    s = torch.einsum("bqhd,bkhd->bhqk", q.float(), k.float()) * q.shape[-1] ** -0.5
    if causal:
        rows, keys = torch.arange(q.shape[1], device=q.device), torch.arange(k.shape[1], device=q.device)
        s = s.masked_fill(keys[None, :] > rows[:, None] + k.shape[1] - q.shape[1], float("-inf"))
    return s.logsumexp(-1)


def gate(table: dict, log) -> dict:
    """name -> list of gate records; a kernel with any failed record is left out of the timing."""
    import torch

    from bench.check import check_output, reference_attention
    from bench.kernels import BASELINE

    results = {name: [] for name in table}
    generator = torch.Generator(device="cuda").manual_seed(1234)
    for batch, seqlen_q, seqlen_k in GATE_SHAPES:
        q = torch.randn(batch, seqlen_q, HEADS, HEAD_DIM, device="cuda", generator=generator).bfloat16()
        k, v = (
            torch.randn(batch, seqlen_k, HEADS, HEAD_DIM, device="cuda", generator=generator).bfloat16()
            for _ in range(2)
        )
        for causal in (False, True):
            ref = reference_attention(q, k, v, causal)
            ref_lse = _reference_lse(q, k, v, causal)
            for name, (call, tolerance, checks_lse) in table.items():
                if name == BASELINE and seqlen_q != seqlen_k:
                    continue  # the baseline on the bench's square shapes only: without it no ratio is measured
                record = dict(shape=[batch, seqlen_q, seqlen_k], causal=causal)
                started = time.perf_counter()
                try:
                    result = call(q, k, v, causal)
                    out = result[0] if isinstance(result, (tuple, list)) else result
                    check = check_output(out.float(), ref, tolerance)
                    record.update(check.as_dict())
                    if checks_lse:
                        lse_diff = float((result[1] - ref_lse).abs().max())
                        record["lse_max_abs_diff"] = lse_diff
                        if not lse_diff <= LSE_TOL:
                            record.update(passed=False, reason=f"LSE off by {lse_diff:.3g} > {LSE_TOL:g}")
                except Exception as exc:  # a kernel that cannot run is a gate failure, reported, not a crash
                    record.update(passed=False, reason=f"{type(exc).__name__}: {exc}")
                torch.cuda.synchronize()
                record["seconds"] = round(time.perf_counter() - started, 2)
                results[name].append(record)
                log(
                    f"gate {name} {batch}x{seqlen_q}/{seqlen_k} {'causal' if causal else 'non-causal'}: "
                    f"{'ok' if record['passed'] else 'FAIL ' + record['reason']} (rel {record.get('rel_err')}, "
                    f"{record['seconds']} s)"
                )
    return results


def time_group(table: dict, names: list, seqlen: int, causal: bool, args, l2_bytes: int, log) -> dict:
    """One shape: every kernel of ``names`` interleaved with FA4 stock; ms, TFLOPS and the ratio to FA4."""
    from bench.check import make_inputs
    from bench.kernels import BASELINE
    from bench.sweep import make_shape, tflops
    from bench.timing import median, per_round_speedups, rotation_count, spread, time_interleaved

    shape = make_shape(seqlen, causal, tokens=TOKENS, head_dim=HEAD_DIM, heads_q=HEADS)
    set_bytes = 3 * shape.batch * shape.seqlen * HEADS * HEAD_DIM * 2
    inputs = make_inputs(shape, rotation_count(set_bytes, l2_bytes), "cuda", seed=args.seed + seqlen + causal)
    launchers = {
        name: [(lambda call=table[name][0], q=q, k=k, v=v: call(q, k, v, causal)) for q, k, v in inputs]
        for name in names
    }
    times, errors = time_interleaved(
        launchers, rounds=args.rounds, calls_per_round=args.calls, warmup=1, seed=args.seed + seqlen
    )
    rows = {}
    baseline_ok = BASELINE not in errors and bool(times.get(BASELINE))
    for name in names:
        if name in errors:
            rows[name] = dict(error=errors[name])
            log(f"{shape.label} {name}: ERROR {errors[name]}")
            continue
        median_ms = median([ms for round_times in times[name] for ms in round_times])
        ratios = per_round_speedups(times[BASELINE], times[name]) if baseline_ok else []
        rows[name] = dict(
            median_ms=median_ms,
            tflops=tflops(shape, median_ms),
            ratio_to_fa4=spread(ratios)["median"] if ratios else None,
            ratio_spread=spread(ratios) if ratios else None,
            round_ms=times[name],
        )
        ratio = rows[name]["ratio_to_fa4"]
        log(
            f"{shape.label} {name}: {median_ms:.3f} ms, {rows[name]['tflops']:.0f} TFLOPS"
            + (f", {ratio:.3f}x FA4" if ratio is not None else "")
        )
    return dict(shape=dataclasses.asdict(shape), rotating_sets=len(inputs), kernels=rows)


def summary(groups: list, candidates: list) -> dict:
    """Per candidate the worst ratio to FA4 over the timed shapes, the best candidate, and the goal."""
    worst = {}
    for name in candidates:
        ratios = [group["kernels"].get(f"exact_{name}", {}).get("ratio_to_fa4") for group in groups]
        worst[name] = min(ratios) if ratios and None not in ratios else None
    timed = {name: ratio for name, ratio in worst.items() if ratio is not None}
    best = max(timed, key=timed.get) if timed else None
    return dict(
        worst_ratio_by_candidate=worst,
        best_candidate=best,
        best_worst_ratio=timed.get(best),
        table_candidate=_name(TABLE),
        goal=GOAL,
        goal_met_by_best=bool(best) and timed[best] >= GOAL,
        goal_met_by_table=worst.get(_name(TABLE)) is not None and worst[_name(TABLE)] >= GOAL,
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from bench import env_info

    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9:
        print("needs an sm_90 GPU (the H200): the launch tuned here is the table's sm90 entry", file=sys.stderr)
        return 2
    started = time.monotonic()
    deadline = started + 60 * args.max_minutes
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "aiter_h200_tune.json"

    def log(line):
        print(f"[{time.monotonic() - started:6.1f} s] {line}", flush=True)

    settings = {
        key: (str(value) if isinstance(value, Path) else value) for key, value in vars(args).items() if key != "out"
    }
    result = dict(
        env=env_info.collect(settings),
        candidates={name: dataclasses.asdict(CANDIDATES[name]) for name in args.candidates},
        mx_rows=[dict(name=n, mx_format=f, dot_mode=d, launch=_name(x) if x else "table") for n, f, d, x in MX_ROWS],
        goal=GOAL,
        groups=[],
    )

    def write():
        path.write_text(json.dumps(result, indent=1))

    from bench.kernels import BASELINE

    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    exact, mx = kernels(args)
    result["gates"], result["timed"] = {}, []
    # Part 1 (the goal): FA4 stock and the candidates; part 2: the MX rows, with FA4 stock again as the baseline.
    for part, rows in (("exact", exact), ("mx", mx)):
        if not rows or time.monotonic() > deadline:
            result["groups"].append(dict(part=part, skipped="no rows" if not rows else "past --max-minutes"))
            continue
        gates = gate(rows, log)
        result["gates"].update(gates)
        write()
        passed = [name for name, records in gates.items() if all(r["passed"] for r in records)]
        if part == "mx" and BASELINE in result["timed"]:
            passed.insert(0, BASELINE)
        result["timed"] += [name for name in passed if name not in result["timed"]]
        table = dict(rows, **{BASELINE: exact[BASELINE]})
        for seqlen in args.seqlens:
            for causal in (True, False):
                label = f"{part} {format_seqlen(seqlen)} {'causal' if causal else 'non-causal'}"
                if time.monotonic() > deadline:
                    result["groups"].append(dict(part=part, skipped=f"{label}: past --max-minutes {args.max_minutes}"))
                    log(f"skip {label}: past --max-minutes")
                    continue
                group = time_group(table, passed, seqlen, causal, args, l2_bytes, log)
                result["groups"].append(dict(part=part, **group))
                write()
    timed_groups = [group for group in result["groups"] if group.get("part") == "exact" and "kernels" in group]
    result["summary"] = summary(timed_groups, args.candidates)
    result["seconds"] = round(time.monotonic() - started, 1)
    write()
    log(f"summary: {json.dumps(result['summary'])}")
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
