"""How the Fused-Softmax kernel is launched on each architecture: the one launch table.

``attention.py`` (the dispatcher) asks ``launch_for(device)`` and ``compile_check.py`` asks
``LAUNCHES[arch]``, so what the audit compiles is what a call launches.

Note [Launch table]
~~~~~~~~~~~~~~~~~~~
- ``block_m`` (query rows per program), ``num_warps`` and ``waves_per_eu`` (AMD only: Triton's HIP option
  that caps registers per wave so that many waves share a SIMD; 0 leaves it to the compiler) change no
  value.
- ``tile_n`` is the default KV tile when the caller passes ``tile_n=None``. It is numerics: the frozen
  max comes from the first tile and a recovery is decided per tile (``fa4_rowmax.reference.fused_softmax``),
  so a caller who needs the same values on every GPU passes ``tile_n`` explicitly.
- gfx950 (MI350/MI355X) is seeded from AITER's tuned MHA default (``configs/gfx950-MHA-DEFAULT.json``:
  BLOCK_M 128, BLOCK_N 64, 4 warps, waves_per_eu 2), except ``waves_per_eu``: with 2 the compiler gets 256
  registers a lane and the default ``dot_mode="scaled"`` spills 156 VGPRs (hd128, Triton 3.6, the compile
  audit); left to the compiler it takes 415 (159 of them AGPRs, one wave a SIMD) and spills none. BLOCK_M
  128 over 4 waves also gives each wave its own 32 rows of the 32x32 MFMAs (with 64 rows, two pairs of
  waves computed the same QK^T and softmax). gfx942 (MI300X) takes the same values; it has no scaled
  MFMA and Triton 3.6 cannot lower ``tl.dot_scaled`` for it ("Unsupported DotScaleOp"), so ``dot_modes``
  leaves "scaled" out there and the dispatcher refuses it with a ValueError instead of a compiler crash.
- sm90 (H200, H100): BLOCK_M 128 over 8 warps, tile 128 (unchanged, so every mode's default values are),
  3 stages: Triton's fused-attention tutorial's Hopper shape. Each of the two warpgroups owns 64 rows (one
  m64n128 wgmma row block), so the scheduler has two warps to issue from where BLOCK_M 64 over 4 warps (the
  previous value, still ``default``) left one, and a second warpgroup's softmax can run while the first's
  GEMMs do. K and V take 3 x 64 KB of shared memory with Q's 32 KB (224 of the 227 KB an H200 block may use)
  and the exact twin 246-249 registers with no spills (``python -m aiter_fused.compile_sm90``); 2 stages spill
  16 bytes. The candidates: ``studies/aiter_h200_tune/tune.py``; the measurement: ``docs/aiter_h200.md``.
- sm90's ``kv_tile_offsets`` is off (per-element K/V addresses), by measurement: on the H200 (2026-12-01
  12:28 UTC, code of commit 6a400db; 32K tokens, 16 heads, head dim 128, BF16, 5 interleaved rounds x 3
  calls, ratio = median over rounds of FA4 stock's time over the kernel's in the same round) the per-element
  form ran 0.686 / 0.679 / 0.706 / 0.714x FA4 stock at 8K causal / 8K non-causal / 16K causal / 16K
  non-causal, the tile-offset form 0.675 / 0.660 / 0.689 / 0.644x: faster at every shape (by 1.6-10.1 %
  in time; at 8K causal the two rounds' ranges overlap, 0.676-0.695 vs 0.666-0.684), although its main loop
  has 598 / 600 instructions per warp and tile against 529 / 548 (SASS, CPU compile). Not explained
  (``docs/aiter_h200.md``, Prediction vs measurement). Neither form changes a value: the same elements are
  loaded from the same addresses, computed two ways (Note [KV addresses] in ``kernel.py``); the override
  ``launch=Launch(..., kv_tile_offsets=True)`` still reaches the other form, and ``attention._launch``'s int32
  check applies to it only.
- Everything else (other NVIDIA GPUs, other AMD GPUs) keeps BLOCK_M 64, 4 warps, tile 128 and Triton's
  default stages (3 on CUDA); Triton's CPU interpreter uses BLOCK_M 16 (speed of the tests only).
- ``num_stages`` is the depth of the KV loads' software pipeline (buffers in shared memory); 0 leaves
  Triton's default, which is what gfx950 and gfx942 compile with.
- ``refusals``: what a launch was measured not to run (Note [sm90 refusals]); the dispatcher raises a
  ValueError naming the accepted tiles instead of launching them.

Note [sm90 refusals]
~~~~~~~~~~~~~~~~~~~~
Measured on the H200 (2026-12-01 17:18 UTC, Triton 3.6.0, the sm90 launch above: BLOCK_M 128, 8 warps, 3
stages; ``studies/aiter_h200_fault/launch_sweep.py``, every kernel x tile x head dim x mask in its own process, the
output against the same mode's reference; ``bench/results/h200_2026-12-01_s4/aiter_sweep/``):
- head dim 32, dot modes "bf16" and "scaled", tiles 64 and 128: "scaled" returned wrong outputs (relative L2
  error 1.4-1.6 against its reference, or Inf) at both tiles and hit an illegal memory access at tile 128
  causal; "bf16" at tile 64 hit an illegal memory access with 4 query rows (a 128-row block mostly masked),
  folded or not, in four of five processes (under ``compute-sanitizer`` once it ran clean: a race, not a fixed
  address), while 300 rows ran right. Tile 32 ran right in both modes, and "fp8" and the exact twin at every
  tile. Not placed further; public Triton issues report illegal shared-memory reads on Hopper at head dim 32
  with several dots (triton-lang/triton #10486, #10573, #11366). Refused: both modes at tiles 64 and 128.
- head dim 256: the compile needs more shared memory than an H200 block has (232,448 bytes): the exact twin
  262,144 at tile 64 and 458,752 at tile 128, "bf16" 327,680 and "scaled" 264,192 at tile 128 (Triton's
  OutOfResources). Refused, with the tiles that fit named, rather than Triton's error; "fp8" fits at every tile.
Head dims 64 and 128 ran right everywhere, both masks.
A ``launch=Launch(...)`` of the caller's on sm90 inherits the head-dim-32 refusal (the dispatcher appends the
table's ``inherited`` ones): that fault is not placed, so no other launch is known to be free of it. The
shared-memory ones are the table's launch's (BLOCK_M 128, 3 stages): a caller's launch that does not fit gets
Triton's OutOfResources, one that does (fewer stages, a smaller BLOCK_M) runs, unmeasured here.
"""

import dataclasses

import torch

__all__ = ["LAUNCHES", "Launch", "Refusal", "arch_of", "launch_for"]


@dataclasses.dataclass(frozen=True)
class Refusal:
    """Kernels a launch does not run (Note [sm90 refusals]): ``kernels`` holds dot modes, "exact" for the exact
    twin; ``why`` is the measurement, for the error message."""

    head_dim: int
    kernels: tuple[str, ...]
    tile_ns: tuple[int, ...]
    why: str
    inherited: bool = True  # a caller's own launch on this architecture is refused it too (Note [sm90 refusals])


@dataclasses.dataclass(frozen=True)
class Launch:
    block_m: int
    num_warps: int
    tile_n: int
    waves_per_eu: int = 0  # AMD only; 0: the compiler's choice
    dot_modes: tuple[str, ...] = ("bf16", "fp8", "scaled")  # the dot modes that compile there
    num_stages: int = 0  # software-pipelining depth of the KV loads; 0: Triton's default
    kv_tile_offsets: bool = False  # the exact twin's K/V addresses: Note [KV addresses] in kernel.py
    refusals: tuple[Refusal, ...] = ()  # Note [sm90 refusals]

    def refusal(self, head_dim: int, tile_n: int, kernel: str):
        """The ``Refusal`` covering this kernel ("exact" or a dot mode) at this head dim and tile, or None."""
        for refusal in self.refusals:
            if head_dim == refusal.head_dim and tile_n in refusal.tile_ns and kernel in refusal.kernels:
                return refusal
        return None

    def options(self, arch: str) -> dict:
        """Triton launch/compile options (``waves_per_eu`` only where Triton's HIP backend takes it,
        ``num_stages`` only where set)."""
        options = {"num_warps": self.num_warps}
        if arch.startswith("gfx") and self.waves_per_eu:
            options["waves_per_eu"] = self.waves_per_eu
        if self.num_stages:
            options["num_stages"] = self.num_stages
        return options


# Note [sm90 refusals]
_SM90_HEAD_DIM_32 = (
    "wrong outputs or an illegal memory access on the H200 (Triton 3.6.0, 2026-12-01; Note [sm90 refusals] in "
    "aiter_fused/launch.py)"
)
_SM90_SHARED_MEMORY = "needs more shared memory than an H200 block has (232,448 bytes; Note [sm90 refusals])"
SM90_REFUSALS = (
    Refusal(32, ("bf16", "scaled"), (64, 128), _SM90_HEAD_DIM_32),
    Refusal(256, ("exact",), (64, 128), _SM90_SHARED_MEMORY, inherited=False),
    Refusal(256, ("bf16", "scaled"), (128,), _SM90_SHARED_MEMORY, inherited=False),
)

# Note [Launch table]
LAUNCHES = {
    "gfx950": Launch(block_m=128, num_warps=4, tile_n=64),
    "gfx942": Launch(block_m=128, num_warps=4, tile_n=64, dot_modes=("bf16", "fp8")),
    "sm90": Launch(block_m=128, num_warps=8, tile_n=128, num_stages=3, refusals=SM90_REFUSALS),  # tile offsets off
    "default": Launch(block_m=64, num_warps=4, tile_n=128),
    "interpreter": Launch(block_m=16, num_warps=4, tile_n=128),
}


def arch_of(device: torch.device) -> str:
    """The launch table's key for a device: the AMD architecture name (``gfx950``, ...) on ROCm,
    ``sm<major><minor>`` on CUDA, ``interpreter`` on the CPU (Triton's interpreter)."""
    if device.type != "cuda":
        return "interpreter"
    props = torch.cuda.get_device_properties(device)
    if getattr(torch.version, "hip", None):
        return getattr(props, "gcnArchName", "").split(":")[0]
    return f"sm{props.major}{props.minor}"


def launch_for(device: torch.device) -> tuple[str, Launch]:
    """(architecture, launch) for a device; architectures without an entry take ``LAUNCHES["default"]``."""
    arch = arch_of(device)
    return arch, LAUNCHES.get(arch, LAUNCHES["default"])
