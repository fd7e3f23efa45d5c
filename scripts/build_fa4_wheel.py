#!/usr/bin/env python3
"""Build flash_attn_4-4.0.0b36+rowmax-*.whl: the entry point of `fa4_rowmax.patched_wheel` (see there)."""

import sys

from fa4_rowmax.patched_wheel import main

if __name__ == "__main__":
    sys.exit(main())
