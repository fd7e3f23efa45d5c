"""Which knob makes the persistent grid fault (one variant per process: a fault ends its CUDA context).

    python -m studies.fp8_sm90.persistent_fault   # on the H200; prints one line per variant

The sixteenth session's GPU suite under persistent defaults met an illegal memory access first at the exact twin,
head dim 64, causal, 2 x 513 x (4 q heads, 1 kv head), tile_n 192, row_sum="mma", beta 0.25, overlapped; the
bit-identity tests (PERSISTENT_CASES, tests/test_fp8_sm90_gpu.py) had passed. Each variant runs FA4's grid, then the
persistent one, and reports a fault, a mismatch or bit identity.
"""

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

BASE = dict(softmax_mode="exact", tile_n=192, row_sum="mma", beta=0.25)
SHAPE = (2, 513, 513, 4, 1, 64)
VARIANTS = {
    "fault": (SHAPE, BASE),
    "no_beta": (SHAPE, dict(BASE, beta=None)),
    "fadd": (SHAPE, dict(BASE, row_sum="fadd")),
    "o_head_dim": (SHAPE, dict(BASE, o_store="head_dim")),
    "no_overlap": (SHAPE, dict(BASE, intra_wg_overlap=False)),
    "mha": ((2, 513, 513, 4, 4, 64), BASE),
    "seqlen_512": ((2, 512, 512, 4, 1, 64), BASE),
    "head_dim_128": ((2, 513, 513, 4, 1, 128), BASE),
    "h15": (SHAPE, dict(softmax_mode="rowmax_h15", tile_n=192, row_sum="mma")),
    "tile_128": (SHAPE, dict(BASE, tile_n=128)),
}

WORKER = """
import json, sys, torch
from fa4_rowmax.fp8_sm90 import flash_attn_fp8_sm90
shape, knobs = json.loads(sys.argv[1])
b, sq, sk, hq, hk, d = shape
g = torch.Generator(device="cuda").manual_seed(0)
sizes = ((sq, hq), (sk, hk), (sk, hk))
q, k, v = (torch.randn(b, s, h, d, device="cuda", generator=g).to(torch.float8_e4m3fn) for s, h in sizes)
ref = flash_attn_fp8_sm90(q, k, v, causal=True, persistent=False, **knobs)
torch.cuda.synchronize()
out = flash_attn_fp8_sm90(q, k, v, causal=True, persistent=True, **knobs)
torch.cuda.synchronize()
same = all(torch.equal(a.view(torch.int16 if a.dtype == torch.bfloat16 else torch.int32),
                       x.view(torch.int16 if x.dtype == torch.bfloat16 else torch.int32)) for a, x in zip(ref, out))
print("bit-identical" if same else "MISMATCH")
"""


def run(name):
    shape, knobs = VARIANTS[name]
    proc = subprocess.run(
        [sys.executable, "-c", WORKER, json.dumps([shape, knobs])], capture_output=True, text=True, timeout=300
    )
    tail = (proc.stdout.strip().splitlines() or [""])[-1]
    error = [line for line in proc.stderr.splitlines() if "Error" in line][-1:] if proc.returncode else []
    return f"{name}: {tail or 'no output'} {' '.join(error)[:160]} ({shape}, {knobs})"


if __name__ == "__main__":
    with ThreadPoolExecutor(4) as pool:
        for line in pool.map(run, VARIANTS):
            print(line, flush=True)
