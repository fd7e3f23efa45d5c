"""The benchmark grid: attention shapes, their FLOP count, and the plan (which kernels run at which shape).

A *group* is one shape plus the kernels timed against each other at that shape, in the same interleaved
rounds, with FA4 stock always among them (every speed-up is a ratio to FA4 stock from the same group).

Note [Constant tokens]
~~~~~~~~~~~~~~~~~~~~~~
`batch * seqlen` is held at `TOKENS` (32K) for every seqlen so the GPU has the same amount of work in
flight: at 1K the batch is 32, at 32K it is 1. With 16 query heads and tiles of 128 rows that is
4,096 query tiles per call, enough to fill the 132 SMs of an H200 many times over at every seqlen.
A seqlen that does not divide `TOKENS` gets `batch = max(1, TOKENS // seqlen)` (recorded in each row).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import re
from typing import Iterable, Sequence

from bench.kernels import (
    BASELINE,
    DEFAULT_KERNELS,
    FP8_KERNELS,
    FP8_LEVER_KERNELS,
    FP8_MAP_KERNELS,
    KERNELS,
    MAP_KERNELS,
    QUICK_KERNELS,
)

TOKENS = 32 * 1024
HEADS_Q = 16
GQA_HEADS_KV = 4
FOCUS_SEQLEN = 8192  # the threshold x beta map and the dtype / head-dim / GQA variants live here
QUICK_SEQLENS = (8192, 2048)
FULL_SEQLENS = (1024, 2048, 4096, 8192, 16384, 32768)
DTYPES = ("bf16", "fp16", "fp8")
MASKS = ("causal", "non-causal")
MAP_MASK_CHOICES = ("causal", "non-causal", "both", "none")
# The --fp8 preset (issue 11): FP8 inputs over these, both masks, MHA and GQA 16/4; the FP8 H15 map at the
# focus seqlen, head dim 128, MHA.
FP8_SEQLENS = (2048, 4096, 8192, 16384, 32768)
FP8_HEAD_DIMS = (128, 64)
FP8_FOCUS_SEQLENS = (8192, 16384)  # the goal's shapes (head dim 128), run first


@dataclasses.dataclass(frozen=True)
class Shape:
    """One attention call: FlashAttention layout q (batch, seqlen, heads_q, head_dim), k/v with heads_kv."""

    seqlen: int
    causal: bool
    dtype: str
    head_dim: int
    heads_q: int
    heads_kv: int
    batch: int

    def __post_init__(self):
        for name in ("seqlen", "head_dim", "heads_q", "heads_kv", "batch"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.causal, bool):
            raise TypeError(f"causal must be a bool, got {type(self.causal).__name__}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.heads_q % self.heads_kv:
            raise ValueError(f"heads_q ({self.heads_q}) must be a multiple of heads_kv ({self.heads_kv})")

    @property
    def mask(self) -> str:
        return "causal" if self.causal else "non-causal"

    @property
    def is_gqa(self) -> bool:
        return self.heads_kv != self.heads_q

    @property
    def label(self) -> str:
        heads = f"h{self.heads_q}" + (f"/{self.heads_kv}" if self.is_gqa else "")
        return f"{format_seqlen(self.seqlen)} {self.mask} {self.dtype} d{self.head_dim} {heads} b{self.batch}"


def make_shape(
    seqlen: int,
    causal: bool,
    dtype: str = "bf16",
    head_dim: int = 128,
    heads_q: int = HEADS_Q,
    heads_kv: int | None = None,
    tokens: int = TOKENS,
) -> Shape:
    """A shape with `batch` chosen so that `batch * seqlen` stays at `tokens` (Note [Constant tokens])."""
    if not isinstance(tokens, int) or tokens < 1:
        raise ValueError(f"tokens must be a positive int, got {tokens!r}")
    if not isinstance(seqlen, int) or seqlen < 1:
        raise ValueError(f"seqlen must be a positive int, got {seqlen!r}")
    return Shape(
        seqlen=seqlen,
        causal=causal,
        dtype=dtype,
        head_dim=head_dim,
        heads_q=heads_q,
        heads_kv=heads_q if heads_kv is None else heads_kv,
        batch=max(1, tokens // seqlen),
    )


def attention_flops(shape: Shape) -> float:
    """FLOPs of one forward: two GEMMs (QK^T and PV), 2 FLOPs per multiply-add, so
    `4 * batch * heads_q * seqlen_q * seqlen_k * head_dim`; causal counts half of that (the
    FlashAttention convention; it ignores the diagonal's extra `seqlen / 2` pairs). Softmax is not counted."""
    flops = 4.0 * shape.batch * shape.heads_q * shape.seqlen * shape.seqlen * shape.head_dim
    return flops / 2 if shape.causal else flops


def tflops(shape: Shape, milliseconds: float) -> float:
    if not milliseconds > 0:
        raise ValueError(f"milliseconds must be > 0, got {milliseconds!r}")
    return attention_flops(shape) / (milliseconds * 1e-3) / 1e12


def parse_seqlen(text: str) -> int:
    """'8K' / '8k' -> 8192, '1000' -> 1000."""
    match = re.fullmatch(r"\s*(\d+)\s*([kK]?)\s*", str(text))
    if not match or int(match.group(1)) < 1:
        raise ValueError(f"seqlen must be a positive integer, optionally with a K suffix (e.g. 8K), got {text!r}")
    return int(match.group(1)) * (1024 if match.group(2) else 1)


def format_seqlen(seqlen: int) -> str:
    return f"{seqlen // 1024}K" if seqlen % 1024 == 0 else str(seqlen)


@dataclasses.dataclass(frozen=True)
class Group:
    shape: Shape
    kernels: tuple[str, ...]


def select_kernels(patterns: Iterable[str], names: Sequence[str]) -> list[str]:
    """Kernel names (in table order) matching any shell-style pattern; a pattern that matches nothing is an error."""
    patterns = list(patterns)
    selected = set()
    for pattern in patterns:
        matched = fnmatch.filter(names, pattern)
        if not matched:
            raise ValueError(f"--kernels: {pattern!r} matches no kernel; known kernels: {', '.join(names)}")
        selected.update(matched)
    return [name for name in names if name in selected]


def build_plan(
    *,
    quick: bool,
    kernel_patterns: Sequence[str] | None = None,
    seqlens: Sequence[int] | None = None,
    map_masks: str = "causal",
    fp8: bool = False,
) -> list[Group]:
    """The groups to run, most informative first (so a run cut short by its time budget keeps them).

    quick: bf16, head dim 128, MHA, both masks at `seqlens` (default 8K and 2K), `QUICK_KERNELS`.
    full:  `DEFAULT_KERNELS` everywhere; first the focus seqlen (8K) groups, carrying the threshold x beta
           map (`MAP_KERNELS`) for the masks in `map_masks`, then FP8 at 8K, then the bf16 hd128 MHA sweep
           over the other seqlens, then the 8K variants (fp16, head dim 64, GQA 16/4). The variants only
           come with 8K in `seqlens`.
    fp8:   FP8 inputs only, `FP8_KERNELS` (the FP8 GEMM ceiling, FA3 FP8 and BF16, cuDNN FP8, vLLM's FA3, FA4
           stock on the inputs upcast to BF16, the FP8 SM90 kernel through flash_attn_func and with each P.V
           accumulation) at head dims 128 and 64, `seqlens` (default 2K-32K), both masks, MHA and GQA 16/4; the 8K
           and 16K head dim 128 MHA groups first, the FP8 H15 map (`FP8_MAP_KERNELS`) and the levers
           (`FP8_LEVER_KERNELS`) at 8K head dim 128 MHA for the masks in `map_masks`.
    `kernel_patterns` replaces the preset's kernel choice (same list at every group); the baseline is
    always kept because every speed-up is quoted against it.
    """
    if map_masks not in MAP_MASK_CHOICES:
        raise ValueError(f"map_masks must be one of {MAP_MASK_CHOICES}, got {map_masks!r}")
    default_seqlens = QUICK_SEQLENS if quick else FP8_SEQLENS if fp8 else FULL_SEQLENS
    seqlens = list(default_seqlens) if seqlens is None else list(seqlens)
    if not seqlens or any(not isinstance(s, int) or s < 1 for s in seqlens):
        raise ValueError(f"seqlens must be a non-empty list of positive ints, got {seqlens!r}")
    seqlens = list(dict.fromkeys(seqlens))  # a repeated seqlen would make two groups of one shape
    chosen = None
    if kernel_patterns:
        chosen = select_kernels(kernel_patterns, list(KERNELS))
        if BASELINE not in chosen:
            chosen = [BASELINE] + chosen

    def group(shape: Shape, preset: Sequence[str]) -> Group:
        return Group(shape, tuple(chosen if chosen is not None else preset))

    masks = (True, False)
    if quick and fp8:
        raise ValueError("quick and fp8 are two presets; choose one")
    if quick:
        return [group(make_shape(s, c), QUICK_KERNELS) for s in seqlens for c in masks]
    if fp8:
        return _fp8_plan(seqlens, map_masks, group)

    map_causal = {"causal": (True,), "non-causal": (False,), "both": (True, False), "none": ()}[map_masks]
    plan: list[Group] = []
    if FOCUS_SEQLEN in seqlens:
        for c in masks:
            with_map = list(DEFAULT_KERNELS) + (list(MAP_KERNELS) if c in map_causal else [])
            plan.append(group(make_shape(FOCUS_SEQLEN, c), with_map))
        fp8_kernels = list(DEFAULT_KERNELS) + [k for k in FP8_KERNELS if k not in DEFAULT_KERNELS]
        plan += [group(make_shape(FOCUS_SEQLEN, c, dtype="fp8"), fp8_kernels) for c in masks]
    plan += [group(make_shape(s, c), DEFAULT_KERNELS) for s in seqlens if s != FOCUS_SEQLEN for c in masks]
    if FOCUS_SEQLEN in seqlens:
        variants = [dict(dtype="fp16"), dict(head_dim=64), dict(heads_kv=GQA_HEADS_KV)]
        plan += [group(make_shape(FOCUS_SEQLEN, c, **v), DEFAULT_KERNELS) for v in variants for c in masks]
    return plan


def _fp8_plan(seqlens: list[int], map_masks: str, group) -> list[Group]:
    map_causal = {"causal": (True,), "non-causal": (False,), "both": (True, False), "none": ()}[map_masks]
    kernels = (BASELINE,) + FP8_KERNELS
    shapes = [
        make_shape(s, c, dtype="fp8", head_dim=d, heads_kv=kv)
        for d in FP8_HEAD_DIMS
        for kv in (HEADS_Q, GQA_HEADS_KV)
        for s in seqlens
        for c in (True, False)
    ]
    # the goal's shapes first, so a run cut short by its time budget keeps them
    first = [s for s in shapes if s.head_dim == 128 and not s.is_gqa and s.seqlen in FP8_FOCUS_SEQLENS]
    plan = []
    for shape in first + [s for s in shapes if s not in first]:
        with_map = (
            shape.seqlen == FOCUS_SEQLEN and shape.head_dim == 128 and not shape.is_gqa and shape.causal in map_causal
        )
        plan.append(group(shape, kernels + (FP8_MAP_KERNELS + FP8_LEVER_KERNELS if with_map else ())))
    return plan
