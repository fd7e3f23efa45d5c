"""What a call saves when the V^T pre-pass zeroes the persistent grid's tile counter instead of a `torch.zeros` launch.

    python -m studies.fp8_sm90.counter_zeroing --json OUT.json    # on a CUDA GPU

Note [The counter zeroed by the pre-pass] (fa4_rowmax/stage/v_transpose.py) removes one kernel launch from every
persistent call: before it, a call ran `torch.zeros` (a fill kernel) for the counter and its slots, then the pre-pass,
then the attention kernel. This times what precedes the attention kernel both ways, interleaved: "zeros" (the fill,
then the pre-pass) and "prepass" (the pre-pass storing the counter's 0), at the e4m3 V of head dim 128, 32K tokens a
call, 16 and 4 KV heads, 2K and 8K keys (`bench.timing.time_interleaved`: 7 rounds x 5 calls, CUDA events, a
spacer before each side's calls so that the host has queued them all and the GPU runs them back to back, as it does
ahead of a 1 ms attention kernel; two V sets rotated; medians). The difference is the time a call saves; over the
attention call's time at the same shape (the benchmark's) it is the speed-up.
"""

import argparse
import json
import statistics

import torch

from bench.timing import time_interleaved

TOKENS = 32 * 1024
HEAD_DIM = 128


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args(argv)

    from fa4_rowmax.stage.tile_scheduler_sm90 import semaphore_numel
    from fa4_rowmax.stage.v_transpose import v_transpose

    numel = semaphore_numel(torch.cuda.get_device_properties(0).multi_processor_count)

    def zeros(v):
        torch.zeros(numel, dtype=torch.int32, device="cuda")
        v_transpose(v)

    def prepass(v):
        v_transpose(v, counter=torch.empty(numel, dtype=torch.int32, device="cuda"))

    rows = []
    for heads_kv in (16, 4):
        for seqlen in (2048, 8192):
            batch = TOKENS // seqlen
            sets = [
                torch.randn(batch, seqlen, heads_kv, HEAD_DIM, device="cuda").to(torch.float8_e4m3fn) for _ in range(2)
            ]
            launchers = {
                name: [lambda way=way, v=v: way(v) for v in sets]
                for name, way in (("zeros", zeros), ("prepass", prepass))
            }
            times, errors = time_interleaved(
                launchers, rounds=args.rounds, calls_per_round=args.calls, warmup=2, seed=seqlen + heads_kv
            )
            if errors:
                raise RuntimeError(errors)
            row = dict(heads_kv=heads_kv, seqlen=seqlen, batch=batch)
            row.update({f"ms_{name}": statistics.median(sum(t, [])) for name, t in times.items()})
            row["us_saved"] = 1e3 * (row["ms_zeros"] - row["ms_prepass"])
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(args.json, "w") as f:
        json.dump({"rows": rows, "gpu": torch.cuda.get_device_name(), "semaphore_numel": numel}, f, indent=1)


if __name__ == "__main__":
    main()
