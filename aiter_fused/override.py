"""Route AITER's flash-attention forward to the Fused-Softmax kernel for the calls it supports.

After `install()`, `aiter.flash_attn_func` and `aiter.flash_attn_varlen_func` (what vLLM's attention
backend calls) run `torch.ops.aiter_fused.fwd` / `fwd_varlen` when `supports(...)` accepts the call, and
AITER's own forward otherwise. `uninstall()` puts AITER's functions back. `AITER_FUSED_DISABLE=1` turns
`install()` into a logged no-op.

Note [Hook depth]
AITER has no registry of attention backends. Its public functions go through autograd Functions whose
`forward` looks up the module globals `aiter.ops.mha._flash_attn_forward` / `_flash_attn_varlen_forward`
at call time, and those walk AITER's own chain of kernel predicates. Rebinding the two globals is the
shallowest place that sees every argument of every call (public function, autograd Function, direct
callers of the private function), keeps AITER's padding of odd head dims and its output slicing, and
leaves AITER's original one attribute away for the calls we do not serve. Rebinding the names that
`aiter/__init__.py` re-exports would miss the autograd Function's lookup. `tests/test_aiter_canary.py`
fails when that lookup changes.

Note [AITER forward arguments]
Every argument of AITER's forward functions is classified below by name: used by the fused kernel,
required to hold a neutral value (the feature it turns on is not in the kernel), or ignored (it only
tunes AITER's own kernels). A call with an argument in none of these sets (a newer AITER) falls through,
so a new feature is never silently dropped. Arguments are matched by name, not position.

Note [Builds that bypass the hook]
Newer AITER (upstream, 2026) added branches inside the public functions that return before the
autograd Function, so before the hooked globals: with `ENABLE_CK=0` they route to AITER's Triton
kernels (also gfx1250 ASM and FlyDSL branches). Such a call never reaches the fused kernel, whatever
`install()` did. `install()` cannot undo that, so it warns (`bypass_reasons`): when `ENABLE_CK=0` is
set, and when a public function's source no longer calls its autograd Function's `apply`.
The arguments upstream added to the forward functions are classified in Note [AITER forward
arguments]: `sink_size` (0) and `sink_ptr`, `q/k/v_descale` (None) must be neutral, `out` is served,
`num_splits` (a split-KV schedule, no change of value) is ignored.

Note [What the fused path serves]
BF16 q, k, v; head dim 64 or 128, q, k and v alike (the head dims of the models the method targets and
of the benchmarks; the kernel itself takes more, `attention.HEAD_DIMS`); heads_q a multiple of heads_k
(MQA/GQA); causal (bottom-right aligned, as AITER) or not; any softmax_scale; dense or varlen. It falls
through for dropout, attention bias, ALiBi, a sliding window, sinks, logits soft-cap, paged KV
(`block_table`), padded varlen layouts, FP8 descales, a request for the softmax matrix, and whenever q, k
or v requires grad: the kernel is forward-only, and AITER's backward would recompute exact P from the
approximate forward's LSE, which is not the gradient of what was computed.
"""

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import logging
import os
import threading
from typing import Any, Callable, Iterator, Optional

import torch

from aiter_fused import ops
from fa4_rowmax.reference.fused_softmax import check_mx_format

__all__ = [
    "DISABLE_ENV",
    "EXACT_ENV",
    "FORMAT_ENV",
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_DIMS",
    "FusedFormat",
    "bypass_reasons",
    "current_format",
    "env_flag",
    "install",
    "is_installed",
    "set_format",
    "supports",
    "uninstall",
    "unsupported_reason",
    "use_format",
]

logger = logging.getLogger(__name__)

DISABLE_ENV = "AITER_FUSED_DISABLE"
CK_ENV = "ENABLE_CK"  # AITER's own switch; Note [Builds that bypass the hook]
FORMAT_ENV = "AITER_FUSED_FORMAT"
EXACT_ENV = "AITER_FUSED_EXACT"

SUPPORTED_DTYPES = (torch.bfloat16,)
SUPPORTED_HEAD_DIMS = (64, 128)

# The globals of `aiter.ops.mha` that are rebound, and whether each is the varlen forward.
_HOOKED_GLOBALS = {"_flash_attn_forward": False, "_flash_attn_varlen_forward": True}
# The public functions that reach them, through these autograd Functions.
_PUBLIC_ROUTES = {"flash_attn_func": "FlashAttnFunc", "flash_attn_varlen_func": "FlashAttnVarlenFunc"}

# Note [AITER forward arguments]
_USED_ARGUMENTS = frozenset(
    {
        "q",
        "k",
        "v",
        "softmax_scale",
        "causal",
        "window_size_left",
        "window_size_right",
        "return_lse",
        "out",
        "cu_seqlens_q",
        "cu_seqlens_k",
        "max_seqlen_q",
        "max_seqlen_k",
    }
)
_NEUTRAL_ARGUMENTS = {
    "dropout_p": 0.0,
    "bias": None,
    "alibi_slopes": None,
    "return_softmax": False,
    "logits_soft_cap": 0.0,
    "block_table": None,
    "cu_seqlens_kv": None,
    "cu_seqlens_q_padded": None,
    "cu_seqlens_k_padded": None,
    "sink_size": 0,
    "sink_ptr": None,
    "q_descale": None,
    "k_descale": None,
    "v_descale": None,
}
_IGNORED_ARGUMENTS = frozenset({"how_v3_bf16_cvt", "min_seqlen_q", "zero_tensors", "num_splits"})
_KNOWN_ARGUMENTS = frozenset(_USED_ARGUMENTS | set(_NEUTRAL_ARGUMENTS) | _IGNORED_ARGUMENTS)


def env_flag(name: str) -> bool:
    """Read a 0/1 environment switch; unset or empty is 0."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"environment variable {name}={value!r}: accepted values are '0', '1' or unset")
    return value == "1"


# ----------------------------------------------------------------------------------------------------
# Which MX format the fused path uses: env default, process-wide setter, scoped override.


@dataclasses.dataclass(frozen=True)
class FusedFormat:
    """How the fused kernel runs: the MX operand format, and `exact` (the kernel's exact-softmax mode)."""

    mx_format: str = "mxfp8"
    exact: bool = False

    def __post_init__(self):
        check_mx_format(self.mx_format)
        if not isinstance(self.exact, bool):
            raise TypeError(f"exact must be a bool, got {type(self.exact).__name__}")


_process_format: Optional[FusedFormat] = None
_scoped_format: contextvars.ContextVar[Optional[FusedFormat]] = contextvars.ContextVar(
    "aiter_fused_format", default=None
)


def _format_from_env() -> FusedFormat:
    mx_format = os.environ.get(FORMAT_ENV, "").strip() or FusedFormat.mx_format
    try:
        check_mx_format(mx_format)
    except ValueError as error:
        raise ValueError(f"environment variable {FORMAT_ENV}: {error}") from None
    return FusedFormat(mx_format, env_flag(EXACT_ENV))


def current_format() -> FusedFormat:
    """The format the next fused call uses: the innermost `use_format`, else `set_format`'s, else the
    environment (`AITER_FUSED_FORMAT`, default mxfp8; `AITER_FUSED_EXACT=1` for exact)."""
    scoped = _scoped_format.get()
    if scoped is not None:
        return scoped
    return _process_format if _process_format is not None else _format_from_env()


def set_format(mx_format: Optional[str] = None, *, exact: Optional[bool] = None) -> FusedFormat:
    """Set the process-wide format (what `use_format` scopes override); None keeps the current value.
    Returns the new format."""
    global _process_format
    base = _process_format if _process_format is not None else _format_from_env()
    _process_format = _merged(base, mx_format, exact)
    return _process_format


@contextlib.contextmanager
def use_format(mx_format: Optional[str] = None, *, exact: Optional[bool] = None) -> Iterator[FusedFormat]:
    """Scope a format to the calls inside the `with` block (per thread / task, nestable); None keeps the
    current value. A diffusion schedule wraps each step: `with aiter_fused.use_format("mxfp6"): ...`."""
    token = _scoped_format.set(_merged(current_format(), mx_format, exact))
    try:
        yield _scoped_format.get()
    finally:
        _scoped_format.reset(token)


def _merged(base: FusedFormat, mx_format: Optional[str], exact: Optional[bool]) -> FusedFormat:
    return FusedFormat(
        base.mx_format if mx_format is None else mx_format,
        base.exact if exact is None else exact,
    )


# ----------------------------------------------------------------------------------------------------
# The predicate.


def unsupported_reason(q: Any, k: Any, v: Any, **arguments: Any) -> Optional[str]:
    """Why the fused kernel cannot serve an AITER forward call, or None when it can.

    Takes the arguments of `aiter.ops.mha._flash_attn_forward` (dense: 4-D q) or
    `_flash_attn_varlen_forward` (varlen: 3-D q), by name; an argument left out counts as neutral.
    See Note [What the fused path serves].
    """
    unknown = sorted(set(arguments) - _KNOWN_ARGUMENTS)
    if unknown:
        return f"argument(s) {unknown} unknown to aiter_fused (a newer AITER?)"
    for name, neutral in _NEUTRAL_ARGUMENTS.items():
        value = arguments.get(name, neutral)
        if neutral is None:
            if value is not None:
                return f"{name} is set"
        elif isinstance(value, torch.Tensor) or value != neutral:
            return f"{name}={value!r} (needs {neutral!r})"
    tensors = {"q": q, "k": k, "v": v}
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            return f"{name} is not a tensor"
        if tensor.dtype not in SUPPORTED_DTYPES:
            return f"{name}.dtype={tensor.dtype} (supported: {list(SUPPORTED_DTYPES)})"
        if tensor.device != q.device:
            return f"{name} is on {tensor.device}, q on {q.device}"
        if tensor.requires_grad:
            return f"{name} requires grad (the fused kernel is forward-only)"
    varlen = q.dim() == 3
    rank = 3 if varlen else 4
    if q.dim() not in (3, 4) or k.dim() != rank or v.dim() != rank:
        return f"ranks q={q.dim()} k={k.dim()} v={v.dim()} (dense: 4, varlen: 3)"
    if varlen:
        reason = _varlen_layout_reason(q, k, arguments)
    else:
        reason = _dense_layout_reason(q, k, v, arguments)
    if reason is not None:
        return reason
    head_dims = (q.shape[-1], k.shape[-1], v.shape[-1])
    if len(set(head_dims)) != 1 or head_dims[0] not in SUPPORTED_HEAD_DIMS:
        return f"head dims q/k/v={head_dims} (supported: equal and in {SUPPORTED_HEAD_DIMS})"
    heads_q, heads_k, heads_v = q.shape[-2], k.shape[-2], v.shape[-2]
    if heads_k != heads_v or heads_k == 0 or heads_q % heads_k != 0:
        return f"heads q/k/v={heads_q}/{heads_k}/{heads_v} (needs heads_k == heads_v dividing heads_q)"
    seqlen_k_bound = arguments.get("max_seqlen_k") if varlen else k.shape[1]
    for side in ("window_size_left", "window_size_right"):
        window = arguments.get(side, -1)
        # AITER itself treats a window at least as long as the keys as no window.
        if window != -1 and not (seqlen_k_bound is not None and window >= seqlen_k_bound):
            return f"{side}={window} (sliding window)"
    return _out_reason(q, v, arguments.get("out"))


def supports(q: Any, k: Any, v: Any, **arguments: Any) -> bool:
    """True when the fused kernel serves an AITER forward call with these arguments (see
    `unsupported_reason`)."""
    return unsupported_reason(q, k, v, **arguments) is None


def _dense_layout_reason(q, k, v, arguments) -> Optional[str]:
    if arguments.get("cu_seqlens_q") is not None:
        return "cu_seqlens_q is set on the dense path (per-batch padding)"
    if not (q.shape[0] == k.shape[0] == v.shape[0]) or k.shape[1] != v.shape[1]:
        return f"shapes q={tuple(q.shape)} k={tuple(k.shape)} v={tuple(v.shape)} do not match"
    if q.shape[1] == 0 or k.shape[1] == 0:
        return "empty sequence"
    return None


def _varlen_layout_reason(q, k, arguments) -> Optional[str]:
    for name in ("cu_seqlens_q", "cu_seqlens_k"):
        cu_seqlens = arguments.get(name)
        if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1:
            return f"{name} is not a 1-D tensor"
        if cu_seqlens.dtype != torch.int32 or cu_seqlens.device != q.device:
            return f"{name} is {cu_seqlens.dtype} on {cu_seqlens.device} (needs int32 on q's device)"
    if arguments["cu_seqlens_q"].numel() != arguments["cu_seqlens_k"].numel():
        return "cu_seqlens_q and cu_seqlens_k have different batch sizes"
    for name in ("max_seqlen_q", "max_seqlen_k"):
        if not isinstance(arguments.get(name), int):
            return f"{name} is not an int"
    if q.shape[0] == 0 or k.shape[0] == 0:
        return "empty sequence"
    return None


def _out_reason(q, v, out) -> Optional[str]:
    if out is None:
        return None
    expected = (*q.shape[:-1], v.shape[-1])
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != expected or out.dtype != q.dtype:
        return f"out is not a {q.dtype} tensor of shape {expected}"
    return None


# ----------------------------------------------------------------------------------------------------
# The hooks.


def _aiter_forward_result(out, lse, arguments):
    """AITER's forward contract: (out, softmax_lse, S_dmask, rng_state). softmax_lse is empty unless
    return_lse; S_dmask is empty without dropout; rng_state is two int64 (unused without dropout)."""
    destination = arguments.get("out")
    if destination is not None:
        destination.copy_(out)
        out = destination
    device = out.device
    if not arguments.get("return_lse", False):
        lse = torch.empty((0,), dtype=torch.float32, device=device)
    s_dmask = torch.empty((0,), dtype=torch.float32, device=device)
    rng_state = torch.zeros((2,), dtype=torch.int64, device=device)
    return out, lse, s_dmask, rng_state


def _run_fused(arguments: dict, varlen: bool):
    fused_format = current_format()
    q, k, v = arguments["q"], arguments["k"], arguments["v"]  # any layout: Note [Operand layouts] in attention.py
    options = dict(
        causal=bool(arguments["causal"]),
        softmax_scale=arguments["softmax_scale"],
        mx_format=fused_format.mx_format,
        exact=fused_format.exact,
    )
    if varlen:
        out, lse = ops.fwd_varlen(
            q,
            k,
            v,
            arguments["cu_seqlens_q"],
            arguments["cu_seqlens_k"],
            arguments["max_seqlen_q"],
            arguments["max_seqlen_k"],
            **options,
            # AITER's own kernels trust the caller's cu_seqlens; reading them back would sync the GPU.
            validate=False,
        )
    else:
        out, lse = ops.fwd(q, k, v, **options)
    return _aiter_forward_result(out, lse, arguments)


def _make_hook(original: Callable, varlen: bool) -> Callable:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def hook(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        reason = unsupported_reason(**arguments)
        if reason is not None:
            logger.debug("%s falls through to AITER: %s", original.__name__, reason)
            return original(*args, **kwargs)
        return _run_fused(arguments, varlen)

    hook.aiter_fused_hook = True
    return hook


# ----------------------------------------------------------------------------------------------------
# install / uninstall.

_lock = threading.Lock()
_originals: dict[str, Callable] = {}  # hooked global name -> AITER's function, while installed


def _aiter_mha_module():
    import aiter.ops.mha

    return aiter.ops.mha


def bypass_reasons(mha) -> list[str]:
    """Why calls of AITER's public functions may not reach the hooked globals (Note [Builds that bypass
    the hook]); empty when nothing is known to bypass them."""
    reasons = []
    if os.environ.get(CK_ENV, "").strip() == "0":
        reasons.append(
            f"{CK_ENV}=0: AITER routes flash_attn_func / flash_attn_varlen_func to its Triton kernels "
            "before the hooked forward"
        )
    for public, function_class in _PUBLIC_ROUTES.items():
        function = getattr(mha, public, None)
        try:
            source = inspect.getsource(function)
        except (TypeError, OSError):
            source = ""
        if f"{function_class}.apply(" not in source:
            reasons.append(f"aiter.ops.mha.{public} does not call {function_class}.apply")
    return reasons


def install() -> bool:
    """Rebind AITER's forward globals to the fused hooks. Idempotent. Returns whether the override is
    installed; False (and an INFO log) when `AITER_FUSED_DISABLE=1`."""
    if env_flag(DISABLE_ENV):
        logger.info("%s=1: the AITER override is not installed", DISABLE_ENV)
        return False
    current_format()  # a bad AITER_FUSED_FORMAT / AITER_FUSED_EXACT fails here, not at the first call
    with _lock:
        if _originals:
            logger.debug("the AITER override is already installed")
            return True
        mha = _aiter_mha_module()
        missing = [name for name in _HOOKED_GLOBALS if not callable(getattr(mha, name, None))]
        if missing:
            raise RuntimeError(
                f"aiter.ops.mha has no callable {missing}: this AITER version dispatches attention "
                "differently (see tests/test_aiter_canary.py)"
            )
        for name, varlen in _HOOKED_GLOBALS.items():
            original = getattr(mha, name)
            unknown = sorted(set(inspect.signature(original).parameters) - _KNOWN_ARGUMENTS)
            if unknown:
                logger.warning(
                    "aiter.ops.mha.%s takes argument(s) %s unknown to aiter_fused: its calls fall through "
                    "to AITER until Note [AITER forward arguments] in %s classifies them",
                    name,
                    unknown,
                    __name__,
                )
            _originals[name] = original
            setattr(mha, name, _make_hook(original, varlen))
        for reason in bypass_reasons(mha):
            logger.warning("the AITER override is installed, but calls may bypass it: %s", reason)
    logger.info(
        "AITER override installed: aiter.ops.mha.%s use the Fused-Softmax kernel when supported (format %s)",
        " and ".join(_HOOKED_GLOBALS),
        current_format(),
    )
    return True


def uninstall() -> bool:
    """Put AITER's original forward functions back. Idempotent. Returns whether anything was undone.
    Raises RuntimeError, restoring nothing, when someone rebound a hooked global after `install()`."""
    with _lock:
        if not _originals:
            return False
        mha = _aiter_mha_module()
        for name, original in _originals.items():
            current = getattr(mha, name, None)
            if not getattr(current, "aiter_fused_hook", False) or current.__wrapped__ is not original:
                raise RuntimeError(
                    f"aiter.ops.mha.{name} was rebound by someone else after install(); not restoring it"
                )
        for name, original in _originals.items():
            setattr(mha, name, original)
        _originals.clear()
    logger.info("AITER override uninstalled")
    return True


def is_installed() -> bool:
    return bool(_originals)
