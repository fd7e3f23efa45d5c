"""Fused-Softmax attention for AMD AITER: a Triton kernel (`attention`, `kernel`), torch custom ops
(`ops`), and an override that routes AITER's flash-attention forward to the kernel (`override`).

Importing this package needs neither a GPU nor Triton nor AITER.
"""

from aiter_fused.override import (
    FusedFormat,
    current_format,
    install,
    is_installed,
    set_format,
    supports,
    uninstall,
    unsupported_reason,
    use_format,
)

__all__ = [
    "FusedFormat",
    "current_format",
    "install",
    "is_installed",
    "set_format",
    "supports",
    "uninstall",
    "unsupported_reason",
    "use_format",
]
