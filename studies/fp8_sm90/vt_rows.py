"""Does the MMA row sum's 8 extra V^T rows cost the pre-pass time? The V^T pre-pass alone, with and without them.

    python -m studies.fp8_sm90.vt_rows --json OUT.json    # on a CUDA GPU

One call per (batch x seqlen = 32K tokens, 16 or 4 KV heads, head dim 128) e4m3 V, `v_transpose` with
`row_sum_rows` 0 and 8 interleaved (7 rounds x 5 calls, CUDA events, a spacer before each kernel's calls, two V
sets rotated), medians. Note [Fixed cost per call] (fixed_cost.py) asks what the per-call cost holds: in the sixth
H200 session's run the MMA row sum's configurations carried ~0.1 ms more of it than the FADD row sum's at 16 KV
heads and none at 4; the pre-pass is the only per-call work whose size the row sum changes by the KV heads.
"""

import argparse
import json
import statistics

import torch

TOKENS = 32 * 1024
HEAD_DIM = 128


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args(argv)

    from fa4_rowmax.stage.v_transpose import v_transpose

    rows = []
    for heads_kv in (16, 4):
        for seqlen in (2048, 8192):
            batch = TOKENS // seqlen
            sets = [
                torch.randn(batch, seqlen, heads_kv, HEAD_DIM, device="cuda").to(torch.float8_e4m3fn) for _ in range(2)
            ]
            times = {0: [], 8: []}
            for extra in times:  # compile and warm
                v_transpose(sets[0], row_sum_rows=extra)
            torch.cuda.synchronize()
            for r in range(args.rounds):
                for extra in (0, 8) if r % 2 == 0 else (8, 0):
                    torch.cuda._sleep(1_000_000)
                    events = []
                    for c in range(args.calls):
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        v_transpose(sets[c % 2], row_sum_rows=extra)
                        end.record()
                        events.append((start, end))
                    torch.cuda.synchronize()
                    times[extra] += [s.elapsed_time(e) for s, e in events]
            row = dict(heads_kv=heads_kv, seqlen=seqlen, batch=batch)
            row.update({f"ms_rows_{extra}": statistics.median(t) for extra, t in times.items()})
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(args.json, "w") as f:
        json.dump({"rows": rows, "gpu": torch.cuda.get_device_name()}, f, indent=1)


if __name__ == "__main__":
    main()
