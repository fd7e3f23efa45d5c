"""How much of an FP8 forward's time is fixed per call and how much grows with the keys: a fit over the
shared benchmark's lengths, per kernel, head dim, KV heads and mask.

    python -m studies.fp8_sm90.fixed_cost bench/results/h200_2026-12-03_s13/defaults_peers/h200_fp8_defaults_peers.json

Note [Fixed cost per call]
~~~~~~~~~~~~~~~~~~~~~~~~~~
The benchmark holds the tokens per call at 32K (batch x seqlen), so every length launches the same number of query
tiles (CTAs) and moves the same bytes of Q, O and V^T, while the key work per query tile grows with the length L.
So a call's median time fits T(L) = a + b L: `a` is what every call pays whatever its length (the V^T pre-pass,
launches, and whatever each work tile pays once over the grid's waves), `b` the time per 1K keys of key work.
b_FA3 / b is the speed-up the kernel approaches at long rows; the intercept is what pulls it down at short ones:
ratio(L) = (a_FA3 + b_FA3 L) / (a + b L). The fit is least squares over the run's lengths; its residuals say how
well two numbers carry the run: within 7 % of each time for our kernels on the H200 (the test holds them under 8 %),
up to 14 % for FA3-FP8, whose rate peaks at 4K-8K keys.
"""

import argparse
import json

import numpy as np

PEER = "fa3_fp8"
KERNELS = ("fa3_fp8", "vllm_fa3_fp8", "cudnn_fp8", "fa4_fp8_func_exact", "fa4_fp8_func_h15")


def fit_fixed_cost(rows: list[dict]) -> dict[tuple, dict]:
    """(kernel, head_dim, heads_kv, causal) -> {"lengths", "ms", "a_ms", "b_ms_per_1k", "residuals_ms"} for every
    group with a timed row at three or more lengths (Note [Fixed cost per call])."""
    series, shapes = {}, set()
    for r in rows:
        if r.get("median_ms") is None or r["dtype"] != "fp8":
            continue
        shapes.add((r["batch"] * r["seqlen"], r["heads_q"]))
        key = (r["kernel"], r["head_dim"], r["heads_kv"], r["causal"])
        if r["seqlen"] in series.setdefault(key, {}):
            raise ValueError(f"two timed rows for {key} at seqlen {r['seqlen']}: fit one run's rows at a time")
        series[key][r["seqlen"]] = r["median_ms"]
    if len(shapes) > 1:
        raise ValueError(
            f"rows of several settings (tokens per call, query heads): {sorted(shapes)}; the fit needs one "
            "(Note [Fixed cost per call])"
        )
    out = {}
    for key, times in series.items():
        if len(times) < 3:
            continue
        lengths = np.array(sorted(times), dtype=float)
        ms = np.array([times[int(n)] for n in lengths])
        design = np.vstack([np.ones_like(lengths), lengths / 1024]).T
        (a, b), *_ = np.linalg.lstsq(design, ms, rcond=None)
        out[key] = {
            "lengths": [int(n) for n in lengths],
            "ms": ms.tolist(),
            "a_ms": float(a),
            "b_ms_per_1k": float(b),
            "residuals_ms": (ms - design @ np.array([a, b])).tolist(),
        }
    return out


def table(fits: dict[tuple, dict]) -> str:
    lines = [
        "| kernel | head dim | KV heads | mask | a (ms per call) | b (ms per 1K keys) | b_FA3 / b | largest residual |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    order = {k: i for i, k in enumerate(KERNELS)}
    for key in sorted(fits, key=lambda k: (-k[1], -k[2], k[3], order.get(k[0], len(order)), k[0])):
        kernel, head_dim, heads_kv, causal = key
        fit = fits[key]
        peer = fits.get((PEER, head_dim, heads_kv, causal))
        speed = f"{peer['b_ms_per_1k'] / fit['b_ms_per_1k']:.2f}x" if peer else "-"
        worst = max(abs(r) / t for r, t in zip(fit["residuals_ms"], fit["ms"]))
        lines.append(
            f"| {kernel} | {head_dim} | {heads_kv} | {'causal' if causal else 'non-causal'} | {fit['a_ms']:.3f} | "
            f"{fit['b_ms_per_1k']:.4f} | {speed} | {worst:.1%} |".replace("%", " %")
        )
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("json", nargs="+", help="shared-benchmark JSONs of one run (python -m bench --fp8)")
    args = parser.parse_args(argv)
    rows = []
    for path in args.json:
        with open(path) as f:
            rows += json.load(f)["rows"]
    print(table(fit_fixed_cost(rows)))


if __name__ == "__main__":
    main()
