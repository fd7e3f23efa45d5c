"""Compile, on the CPU, every kernel the H200 tune run timed and record its sm_90a main-loop counts.

    python -m studies.aiter_cost_model.counts studies/aiter_cost_model/results/sm90_counts.json

The inputs of ``studies.aiter_cost_model.cost_model``'s H200 validation: the exact twin's candidates
(``studies/aiter_h200_tune/tune.py``'s ``CANDIDATES``) and its MX rows (``MX_ROWS``), both masks, head dim 128,
compiled by ``aiter_fused.compile_sm90.compile_one`` with the benchmark's integer specialization (32K tokens, 16
heads). The JSON is rewritten after every compile, so an interrupted run keeps what it has. A record written before
the schedule fields (``loop_stall_cycles``, ``loop_waits``, ...: Note [SASS control bits] in compile_sm90.py)
existed is compiled again and gets them added, after a check that every field it had comes out the same (so the
v1 validation reproduces bit-identically); its ``compile_seconds`` is kept.
"""

import dataclasses
import json
import sys
import time
from pathlib import Path

import triton

from aiter_fused.compile_check import Config
from aiter_fused.compile_sm90 import compile_one
from studies.aiter_h200_tune.tune import CANDIDATES, MX_ROWS, TABLE

SCHEDULE_FIELDS = {"loop_stall_cycles", "loop_waits", "loop_waiting_instructions", "loop_wait_instructions"}


def jobs():
    for name, launch in CANDIDATES.items():
        yield f"exact_{name}", None, "mxfp8", launch
    for row, mx_format, dot_mode, launch_name in MX_ROWS:  # launch_name: a Launch, or None (the table)
        launch = TABLE if launch_name is None else launch_name
        yield row, dot_mode or "fp8", mx_format, launch


def main(out: str) -> int:
    path = Path(out)
    records = json.loads(path.read_text())["records"] if path.exists() else {}
    for row, dot_mode, mx_format, launch in jobs():
        for causal in (True, False):
            key = f"{row}/{'causal' if causal else 'non-causal'}"
            if key in records and SCHEDULE_FIELDS <= records[key].keys():
                continue
            timed_launch = launch
            if key in records:
                # Compile what the record says was timed: the MX rows follow the launch table, which has moved
                # since the H200 run (kv_tile_offsets on then, off now).
                timed = {name: tuple(v) if isinstance(v, list) else v for name, v in records[key]["launch"].items()}
                timed_launch = dataclasses.replace(launch, **timed)
            start = time.time()
            config = Config("attention", mx_format, 128, dot_mode, causal, timed_launch.tile_n)
            record = compile_one(config, timed_launch)
            record["compile_seconds"] = round(time.time() - start, 1)
            if key in records:
                old = records[key]
                # The Launch dataclass has gained fields since (refusals): compare the ones the record has.
                # JSON round trip: tuples come back as lists.
                fresh = json.loads(json.dumps(record))
                fresh["launch"] = {name: fresh["launch"][name] for name in old["launch"]}
                changed = [f for f in old if f != "compile_seconds" and old[f] != fresh[f]]
                if changed:
                    raise SystemExit(f"{key}: the recompile changed {changed}; not updating")
                record = {**old, **{field: record[field] for field in sorted(SCHEDULE_FIELDS)}}
            records[key] = record
            print(
                f"{key}: {record['loop_instructions']} ({record['per_element']}/score), "
                f"stalls {record['loop_stall_cycles']}, waits {record['loop_waits']}, {record['compile_seconds']} s",
                flush=True,
            )
            path.write_text(json.dumps({"triton": triton.__version__, "records": records}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
