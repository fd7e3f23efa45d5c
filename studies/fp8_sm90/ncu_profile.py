#!/usr/bin/env python3
"""One launch of each named bench kernel, for Nsight Compute: where the SM90 FP8 forward's time goes.

    ncu --profile-from-start off --clock-control none --set full -o OUT/fp8 \\
        python3 -m studies.fp8_sm90.ncu_profile --seqlen 8192 --kernels fa3_fp8 fa4_fp8_func_h15 ...

Each kernel (a `bench.kernels.KERNELS` name) is bound to the bench's inputs (N(0, 1) cast to e4m3, 32K tokens
per call, 16 query heads), called twice outside the profiled range (the CuTe DSL compiles on the first call,
the second warms), then once between cudaProfilerStart and cudaProfilerStop, so the report holds exactly
the launches of that one call (for `flash_attn_func` rows: the V^T pre-pass and the attention kernel), in the
order of --kernels; one JSON line per kernel names it and the shape.
"""

import argparse
import dataclasses
import json

import torch

from bench.check import make_inputs
from bench.kernels import KERNELS
from bench.sweep import Shape

TOKENS_PER_CALL = 32 * 1024


def shape_parser(description: str, seqlen: int) -> argparse.ArgumentParser:
    """The options naming bench kernels and the bench's FP8 shape (32K tokens per call, 16 query heads)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--kernels", nargs="+", required=True, choices=sorted(KERNELS), metavar="NAME")
    parser.add_argument("--seqlen", type=int, default=seqlen)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--heads-kv", type=int, default=16)
    parser.add_argument("--causal", action="store_true")
    return parser


def bench_shape(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Shape:
    """The bench's FP8 shape for `shape_parser`'s options; --seqlen must divide the tokens per call."""
    if TOKENS_PER_CALL % args.seqlen:
        parser.error(f"--seqlen must divide {TOKENS_PER_CALL}, got {args.seqlen}")
    return Shape(
        seqlen=args.seqlen,
        causal=args.causal,
        dtype="fp8",
        head_dim=args.head_dim,
        heads_q=16,
        heads_kv=args.heads_kv,
        batch=TOKENS_PER_CALL // args.seqlen,
    )


def main(argv=None) -> None:
    parser = shape_parser(__doc__.splitlines()[0], seqlen=8192)
    args = parser.parse_args(argv)
    shape = bench_shape(parser, args)
    ((q, k, v),) = make_inputs(shape, 1, "cuda", seed=0)
    cudart = torch.cuda.cudart()
    for name in args.kernels:
        launch = KERNELS[name].bind(q, k, v, args.causal)
        launch()
        launch()
        torch.cuda.synchronize()
        cudart.cudaProfilerStart()
        launch()
        torch.cuda.synchronize()
        cudart.cudaProfilerStop()
        print(json.dumps({"kernel": name, **dataclasses.asdict(shape)}), flush=True)


if __name__ == "__main__":
    main()
