"""Reading SASS instruction streams (`compile_check.disassemble`'s lines): mnemonics and their counts, and the
stream of one result of a `compile_check.check_matrix` report."""

import hashlib
from collections import Counter
from pathlib import Path

from fa4_rowmax.testing import compile_check


def split_instruction(instruction: str) -> tuple[str, list[str]]:
    """(mnemonic, operands) of one SASS instruction, its guard predicate (`@P0`) dropped."""
    if instruction.startswith("@"):
        instruction = instruction.split(None, 1)[1]
    mnemonic, _, operands = instruction.partition(" ")
    return mnemonic, [op.strip() for op in operands.split(",") if op.strip()]


def mnemonic_counts(instructions: list[str]) -> Counter:
    """How often each full mnemonic (with its modifiers: `FMNMX3.NAN`, `FMNMX.FTZ`) occurs."""
    return Counter(split_instruction(ins)[0] for ins in instructions)


def count(mnemonics: Counter, op: str) -> int:
    """The instructions of `mnemonic_counts` that are `op` with any modifiers (`FADD` counts `FADD.FTZ`)."""
    return sum(n for name, n in mnemonics.items() if name == op or name.startswith(op + "."))


def sass(report: dict, compiled: dict) -> list[str]:
    """The SASS instructions of one compiled result of `report` (`check_matrix`'s, with the "workdir" it compiled
    in), its cubin found by the hash it reported."""
    by_hash = report.setdefault("sass_by_sha256", {})
    cubins = iter(sorted(Path(report["workdir"]).glob(f"dump_*/{compiled['cubin']}")))
    while compiled["sass_sha256"] not in by_hash:
        cubin = next(cubins, None)
        if cubin is None:
            raise LookupError(f"no {compiled['cubin']} under {report['workdir']} has the reported SASS hash")
        instructions = compile_check.disassemble(cubin)
        by_hash[hashlib.sha256("\n".join(instructions).encode()).hexdigest()] = instructions
    return by_hash[compiled["sass_sha256"]]
