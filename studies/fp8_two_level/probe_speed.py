"""Speed probe of two-level P.V accumulation in the SM90 FP8 forward, beside single-level and FA3-FP8 (H200).

One process, interleaved rounds (bench.timing.time_interleaved), medians; 32K tokens per call (batch x seqlen),
16 heads, head dim 128, N(0, 1) inputs in e4m3, descales none. Prints one line per (shape, kernel): median ms,
TFLOPs and the ratio to FA3-FP8 in the same rounds. Run on the device: python -m studies.fp8_two_level.probe_speed
"""

import argparse
import json
import math

import torch

from bench.timing import median, time_interleaved
from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90

VARIANTS = {
    "ours_exact_single": dict(softmax_mode="exact", pv_accumulation="single"),
    "ours_exact_two_level": dict(softmax_mode="exact"),
    "ours_exact_two_level_mma": dict(softmax_mode="exact", row_sum="mma"),
    "ours_h15_single": dict(softmax_mode="rowmax_h15", pv_accumulation="single"),
    "ours_h15_two_level": dict(softmax_mode="rowmax_h15"),
    "ours_h15_single_n192_sat": dict(softmax_mode="rowmax_h15", pv_accumulation="single", tile_n=192, clamp="sat"),
    "ours_h15_two_level_sat": dict(softmax_mode="rowmax_h15", clamp="sat"),
    "ours_h15_two_level_sat_mma": dict(softmax_mode="rowmax_h15", clamp="sat", row_sum="mma"),
    "ours_h15_two_level_fold_mma": dict(softmax_mode="rowmax_h15", anchor_rounding="half_octave", row_sum="mma"),
    "ours_exact_two_level_deleted": dict(softmax_mode="exact", exp2_deleted=True),
    "ours_exact_two_level_deleted_mma": dict(softmax_mode="exact", exp2_deleted=True, row_sum="mma"),
}


def vt_bandwidth(seqlens, rounds: int) -> list[dict]:
    """The V^T pre-pass alone (stage/v_transpose.py) at several BLOCK_KEYS x NUM_WARPS, beside a plain device copy
    of the same bytes (torch's copy_: the HBM rate this GPU reaches for a read and a write): median ms and the
    rate of each (V read once, V^T written once)."""
    from fa4_rowmax.stage import v_transpose as vt_module

    heads, dim, tokens = 16, 128, 32768
    rows = []
    defaults = vt_module.BLOCK_KEYS, vt_module.NUM_WARPS
    for seqlen in seqlens:
        batch = tokens // seqlen
        sets = [torch.randn(batch, seqlen, heads, dim, device="cuda").to(torch.float8_e4m3fn) for _ in range(2)]
        outs = [torch.empty_like(v) for v in sets]
        launchers = {"copy": [lambda v=v, o=o: o.copy_(v) for v, o in zip(sets, outs)]}
        configs = [(block, warps) for block in (32, 64, 128, 256) for warps in (2, 4, 8)]
        for block, warps in configs:

            def launch(v, block=block, warps=warps):
                vt_module.BLOCK_KEYS, vt_module.NUM_WARPS = block, warps
                return vt_module.v_transpose(v)

            launchers[f"vt_block{block}_warps{warps}"] = [lambda v=v, f=launch: f(v) for v in sets]
        times, errors = time_interleaved(launchers, rounds=rounds, calls_per_round=5, warmup=2, seed=seqlen)
        copy_ms = median([t for r in times["copy"] for t in r])
        for name in launchers:
            if name in errors:
                print(f"{seqlen} {name}: failed: {errors[name]}")
                continue
            ms = median([t for r in times[name] for t in r])
            rate = 2 * sets[0].numel() / ms / 1e6
            rows.append(dict(seqlen=seqlen, kernel=name, ms=ms, gb_per_s=rate, vs_copy=copy_ms / ms))
            print(f"{seqlen} {name}: {ms:.4f} ms {rate:.0f} GB/s {copy_ms / ms:.2f}x the copy's rate")
    vt_module.BLOCK_KEYS, vt_module.NUM_WARPS = defaults
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seqlens", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--vt-only", action="store_true", help="only the V^T pre-pass's bandwidth")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.vt_only:
        rows = vt_bandwidth(args.seqlens, args.rounds)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)
        return
    import fa3_fwd_interface as fa3

    heads, dim, tokens = 16, 128, 32768
    rows = []
    for seqlen in args.seqlens:
        batch = tokens // seqlen
        for causal in (False, True):
            sets = []
            for s in range(2):
                g = torch.Generator(device="cuda").manual_seed(s)
                sets.append(
                    [
                        torch.randn(batch, seqlen, heads, dim, device="cuda", generator=g).to(torch.float8_e4m3fn)
                        for _ in range(3)
                    ]
                )
            launchers = {
                "fa3_fp8": [lambda q=q, k=k, v=v: fa3.flash_attn_func(q, k, v, causal=causal) for q, k, v in sets]
            }
            for name, kw in VARIANTS.items():
                launchers[name] = [
                    lambda q=q, k=k, v=v, kw=kw: flash_attn_fp8_sm90(q, k, v, causal=causal, **kw) for q, k, v in sets
                ]
            times, errors = time_interleaved(launchers, rounds=args.rounds, calls_per_round=3, warmup=2, seed=seqlen)
            flops = 4 * batch * heads * seqlen * seqlen * dim / (2 if causal else 1)
            base = median([t for r in times["fa3_fp8"] for t in r]) if times.get("fa3_fp8") else math.nan
            for name in launchers:
                if name in errors:
                    print(f"{seqlen} causal={causal} {name}: ERROR {errors[name][:300]}")
                    continue
                ms = median([t for r in times[name] for t in r])
                row = dict(seqlen=seqlen, causal=causal, kernel=name, ms=ms, tflops=flops / ms / 1e9, vs_fa3=base / ms)
                rows.append(row)
                print(f"{seqlen} causal={causal} {name:32s} {ms:7.3f} ms {row['tflops']:6.0f} TF {row['vs_fa3']:.3f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
