"""Stand-ins for the ROCm toolchain that let the real AITER package import on a CPU-only machine (tests only)."""
