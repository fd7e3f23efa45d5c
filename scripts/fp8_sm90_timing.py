#!/usr/bin/env python3
"""Same-run, interleaved timing of the SM90 FP8 forward against its peers on one GPU.

    python scripts/fp8_sm90_timing.py OUT_DIR [--seqlens 8192 16384] [--variants NAME ...]

`--variants` picks rows of the variant table by name (an unknown name raises and lists the table); the
default list leaves out the exact twin's beta rows (`fa4fp8_exact_n192[_mma]_beta0p125`, `_beta0p25`,
`_beta0p5`; the `_mma` ones take <= 2,048 keys).

Every variant runs on rotating inputs (enough sets to exceed L2), CUDA-event timed, `iters` calls per
measurement; rounds interleave the variants and the reported time is the median over rounds. The V^T
pre-pass runs inside every timed call of the FA4-FP8 variants. TFLOPS count 4 * b * h * s_q * s_k * d
(half for causal). Writes OUT_DIR/timing.json and prints one line per (shape, variant).
"""

import argparse
import json
import statistics
import time

import torch

EXACT_BETAS = (0.125, 0.25, 0.5)


def make_inputs(batch, seqlen, heads, head_dim, sets, dtype):
    out = []
    for i in range(sets):
        g = torch.Generator(device="cuda").manual_seed(i)
        q, k, v = (
            torch.randn(batch, seqlen, heads, head_dim, device="cuda", generator=g, dtype=torch.bfloat16)
            for _ in range(3)
        )
        out.append((q, k, v) if dtype == torch.bfloat16 else tuple(t.to(dtype) for t in (q, k, v)))
    return out


def variants(names, causal, batch, heads):
    from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90

    ones = torch.ones(batch, heads, device="cuda", dtype=torch.float32)
    table = {}

    def fp8(**kw):
        return lambda q, k, v: flash_attn_fp8_sm90(
            q, k, v, causal=causal, q_descale=ones, k_descale=ones, v_descale=ones, **kw
        )

    table["fa4fp8_exact"] = ("fp8", fp8(softmax_mode="exact"))
    table["fa4fp8_exact_noexp2"] = ("fp8", fp8(softmax_mode="exact", exp2_deleted=True))
    table["fa4fp8_h15"] = ("fp8", fp8(softmax_mode="rowmax_h15"))
    table["fa4fp8_h15_fold"] = ("fp8", fp8(softmax_mode="rowmax_h15", anchor_rounding="half_octave"))
    table["fa4fp8_exact_n192"] = ("fp8", fp8(softmax_mode="exact", tile_n=192))
    table["fa4fp8_h15_n192"] = ("fp8", fp8(softmax_mode="rowmax_h15", tile_n=192))
    table["fa4fp8_exact_noexp2_n192"] = ("fp8", fp8(softmax_mode="exact", exp2_deleted=True, tile_n=192))
    table["fa4fp8_exact_noexp2_n192_mma"] = (
        "fp8",
        fp8(softmax_mode="exact", exp2_deleted=True, tile_n=192, row_sum="mma"),
    )
    table["fa4fp8_exact_n192_mma"] = ("fp8", fp8(softmax_mode="exact", tile_n=192, row_sum="mma"))
    table["fa4fp8_exact_n192_mma_vote"] = (
        "fp8",
        fp8(softmax_mode="exact", tile_n=192, row_sum="mma", rescale_vote=True),
    )
    table["fa4fp8_h15_fold_n192_vote"] = (
        "fp8",
        fp8(softmax_mode="rowmax_h15", anchor_rounding="half_octave", tile_n=192, rescale_vote=True),
    )
    table["fa4fp8_h15_fold_n192_mma"] = (
        "fp8",
        fp8(softmax_mode="rowmax_h15", anchor_rounding="half_octave", tile_n=192, row_sum="mma"),
    )
    table["fa4fp8_h15_fold_n192_mma_vote"] = (
        "fp8",
        fp8(softmax_mode="rowmax_h15", anchor_rounding="half_octave", tile_n=192, row_sum="mma", rescale_vote=True),
    )
    table["fa4fp8_h15_sat_n192"] = ("fp8", fp8(softmax_mode="rowmax_h15", clamp="sat", tile_n=192))
    table["fa4fp8_h15_sat_n192_mma"] = ("fp8", fp8(softmax_mode="rowmax_h15", clamp="sat", tile_n=192, row_sum="mma"))
    table["fa4fp8_h15_n192_mma"] = ("fp8", fp8(softmax_mode="rowmax_h15", tile_n=192, row_sum="mma"))
    table["fa4fp8_exact_n224"] = ("fp8", fp8(softmax_mode="exact", tile_n=224))
    table["fa4fp8_h15_fold_n224"] = ("fp8", fp8(softmax_mode="rowmax_h15", anchor_rounding="half_octave", tile_n=224))
    table["fa4fp8_h15_fold_n192"] = ("fp8", fp8(softmax_mode="rowmax_h15", anchor_rounding="half_octave", tile_n=192))
    # The exact twin's beta share (Note [beta on the FP8 exact twin]); the MMA row sum takes <= 2,048 keys only.
    for beta in EXACT_BETAS:
        tag = f"beta{beta:g}".replace(".", "p")
        table[f"fa4fp8_exact_n192_{tag}"] = ("fp8", fp8(softmax_mode="exact", tile_n=192, beta=beta))
        table[f"fa4fp8_exact_n192_mma_{tag}"] = ("fp8", fp8(softmax_mode="exact", tile_n=192, row_sum="mma", beta=beta))
    fa3_missing = False
    try:
        import fa3_fwd_interface as fa3

        table["fa3_fp8"] = (
            "fp8",
            lambda q, k, v: fa3.flash_attn_func(q, k, v, causal=causal, q_descale=ones, k_descale=ones, v_descale=ones),
        )
        table["fa3_bf16"] = ("bf16", lambda q, k, v: fa3.flash_attn_func(q, k, v, causal=causal))
    except ImportError as e:
        fa3_missing = True
        print("fa3 unavailable:", e)
    from flash_attn.cute import flash_attn_func

    table["fa4_bf16_stock"] = ("bf16", lambda q, k, v: flash_attn_func(q, k, v, causal=causal))
    from fa4_rowmax.stage.v_transpose import v_transpose

    table["prepass_only"] = ("fp8", lambda q, k, v: v_transpose(v, ones, ones, ones))
    unknown = [n for n in names if n not in table and not (fa3_missing and n.startswith("fa3_"))]
    if unknown:
        raise ValueError(f"unknown --variants {unknown}; accepted: {sorted(table)}")
    return {n: table[n] for n in names if n in table}


def time_calls(fn, inputs, iters):
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(iters):
        fn(*inputs[i % len(inputs)])
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / iters


def gemm_ceiling(n=8192, iters=20):
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.ones((), device="cuda")
    fn = lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / iters)
    ms = statistics.median(times)
    return dict(variant="fp8_gemm_scaled_mm", n=n, ms=ms, tflops=2 * n**3 / ms / 1e9)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--seqlens", type=int, nargs="+", default=[8192, 16384])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--iters", type=int, default=8)
    p.add_argument(
        "--variants",
        nargs="+",
        default=[
            "fa4fp8_exact",
            "fa4fp8_exact_noexp2",
            "fa4fp8_h15",
            "fa4fp8_h15_fold",
            "fa4fp8_exact_n192",
            "fa4fp8_exact_noexp2_n192",
            "fa4fp8_exact_noexp2_n192_mma",
            "fa4fp8_exact_n192_mma",
            "fa4fp8_exact_n192_mma_vote",
            "fa4fp8_h15_n192",
            "fa4fp8_h15_n192_mma",
            "fa4fp8_h15_fold_n192",
            "fa4fp8_h15_fold_n192_vote",
            "fa4fp8_h15_fold_n192_mma",
            "fa4fp8_h15_fold_n192_mma_vote",
            "fa4fp8_h15_sat_n192",
            "fa4fp8_h15_sat_n192_mma",
            "fa3_fp8",
            "fa3_bf16",
            "fa4_bf16_stock",
            "prepass_only",
        ],
    )
    args = p.parse_args()
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "args": vars(args), "rows": []}
    results["gemm"] = gemm_ceiling()
    print(json.dumps(results["gemm"]), flush=True)
    for seqlen in args.seqlens:
        batch = args.tokens // seqlen
        for causal in (False, True):
            flops = 4 * batch * args.heads * seqlen * seqlen * args.head_dim / (2 if causal else 1)
            table = variants(args.variants, causal, batch, args.heads)
            inputs = {
                d: make_inputs(
                    batch, seqlen, args.heads, args.head_dim, 3, torch.float8_e4m3fn if d == "fp8" else torch.bfloat16
                )
                for d in ("fp8", "bf16")
            }
            live = {}
            for name, (dtype, fn) in table.items():
                try:
                    t = time.time()
                    fn(*inputs[dtype][0])
                    torch.cuda.synchronize()
                    live[name] = (dtype, fn)
                    print(f"warm {name}: {time.time() - t:.1f}s", flush=True)
                except Exception as e:
                    print(f"FAILED {name}: {e!r}"[:800], flush=True)
            times = {name: [] for name in live}
            for _ in range(args.rounds):
                for name, (dtype, fn) in live.items():
                    times[name].append(time_calls(fn, inputs[dtype], args.iters))
            for name, ts in times.items():
                ms = statistics.median(ts)
                row = dict(
                    seqlen=seqlen,
                    batch=batch,
                    causal=causal,
                    variant=name,
                    ms=ms,
                    ms_min=min(ts),
                    ms_max=max(ts),
                    tflops=flops / ms / 1e9,
                )
                results["rows"].append(row)
                print(json.dumps(row), flush=True)
            del inputs
            torch.cuda.empty_cache()
    with open(f"{args.out}/timing.json", "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
