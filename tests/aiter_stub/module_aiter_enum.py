"""Stand-in for AITER's JIT-built `module_aiter_enum` (tests only; see README.md).

`import aiter` builds this pybind module from C++ at import time, which needs the ROCm compiler. AITER
only needs the two enum types `ActivationType` and `QuantType` from it, callable with an int and
documented pybind-style (a docstring starting with "Members:", which AITER's argument checker reads).
The members and values are read from the header the installed AITER ships
(`aiter_meta/csrc/include/aiter_enum.h`), so they follow whatever version is installed.
"""

import enum
import importlib.util
import pathlib
import re

_ENUM_NAMES = ("ActivationType", "QuantType")


def _header_path() -> pathlib.Path:
    spec = importlib.util.find_spec("aiter")
    if spec is None or spec.origin is None:
        raise ImportError("module_aiter_enum stand-in: the amd-aiter package is not installed")
    site = pathlib.Path(spec.origin).parent.parent
    return site / "aiter_meta" / "csrc" / "include" / "aiter_enum.h"


def _parse_enums(header_text: str) -> dict[str, dict[str, int]]:
    """`enum class Name : int { A = -1, B, ... };` -> {Name: {A: -1, B: 0, ...}} (C++ numbering rules)."""
    enums = {}
    for name, body in re.findall(r"enum\s+class\s+(\w+)\s*:\s*int\s*\{([^}]*)\}", header_text):
        members, next_value = {}, 0
        for entry in body.split(","):
            entry = re.sub(r"//.*", "", entry).strip()
            if not entry:
                continue
            member, _, value = (part.strip() for part in entry.partition("="))
            next_value = int(value, 0) if value else next_value
            members[member] = next_value
            next_value += 1
        enums[name] = members
    return enums


def _build() -> dict[str, type]:
    parsed = _parse_enums(_header_path().read_text())
    missing = [name for name in _ENUM_NAMES if name not in parsed]
    if missing:
        raise ImportError(f"module_aiter_enum stand-in: {missing} not found in {_header_path()}")
    built = {}
    for name in _ENUM_NAMES:
        enum_type = enum.IntEnum(name, parsed[name], module=__name__)
        enum_type.__doc__ = "Members:\n\n" + "\n\n".join(f"  {member}" for member in parsed[name])
        built[name] = enum_type
    return built


globals().update(_build())
