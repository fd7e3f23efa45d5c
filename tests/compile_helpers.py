"""What the SM90 and SM100 compile tests share (test_compile_sm90.py, test_compile_sm100.py): the compiled
CI matrix, one configuration's result, and the checks every architecture must pass.

Assertions here are rewritten by pytest (`register_assert_rewrite` in conftest.py).
"""

import re
from pathlib import Path

from fa4_rowmax.testing import compile_check
from fa4_rowmax.testing.sass import split_instruction

DEFAULT_CONFIG = compile_check.DEFAULT_CONFIG  # what a configuration not otherwise given compiles with


def compile_configs(arch: str, configs: list[dict], tmp_path_factory, name: str) -> dict:
    """`configs` (plus stock FA4, last) compiled for `arch`, each in its own subprocess; the cubins stay in
    `report["workdir"]` for `sass`."""
    workdir = tmp_path_factory.mktemp(name)
    return dict(compile_check.check_matrix(arch, configs, workdir), workdir=str(workdir))


def compile_configs_sm103(configs: list[dict], tmp_path_factory, name: str = "sm103") -> dict:
    """`compile_configs` for sm_103a (B300)."""
    return compile_configs("sm103", configs, tmp_path_factory, name)


def ci_report(arch: str, tmp_path_factory, extra_configs: tuple[dict, ...] = ()) -> dict:
    """The CI matrix of `compile_check`, plus `extra_configs` compiled in the same pool."""
    return compile_configs(arch, compile_check.ci_matrix(arch) + list(extra_configs), tmp_path_factory, arch)


def result(report: dict, **config) -> dict:
    """The result of `DEFAULT_CONFIG` updated by `config` (stock FA4 excluded)."""
    want = dict(DEFAULT_CONFIG, **config)
    return next(r for r in report["results"][:-1] if r["config"] == want)


def assert_every_configuration_compiled(report: dict) -> None:
    failed = [(r["config"], r.get("error", "")[-600:]) for r in report["results"] if not r["ok"]]
    assert not failed, failed


def assert_mufu_count_falls_as_beta_grows(report: dict) -> None:
    assert report["checks"]["mufu_falls_with_beta_rowmax_h15"]
    ex2 = dict(report["checks"]["mufu_by_beta_rowmax_h15"])
    assert ex2[0.0] >= report["stock"]["counts"]["MUFU.EX2"]  # beta 0: every weight through the MUFU
    assert result(report, mode="exact", beta=1.0)["counts"]["MUFU.EX2"] < ex2[0.5] < ex2[0.0]


def assert_serving_layouts_compile_with_h15(report: dict, arch: str) -> None:
    """Note [Serving layouts on the CPU]: each varlen / paged configuration compiled with the H15 stage, and its
    per-element exp2 left the MUFU as on the dense kernel (only per-row rescale factors stay there)."""
    layouts = compile_check.serving_layouts(arch)
    results = [r for r in report["results"][:-1] if r["config"] in layouts]
    assert len(results) == len(layouts), [r["config"] for r in results]
    stock_ex2 = report["stock"]["counts"]["MUFU.EX2"]
    for r in results:
        assert r["ok"], (r["config"], r.get("error", "")[-600:])
        assert r["counts"]["MUFU.EX2"] * 10 < stock_ex2, (r["config"], r["counts"]["MUFU.EX2"], stock_ex2)


def assert_full_matrix_passes(arch: str, tmp_path: Path) -> None:
    report = compile_check.check_matrix(arch, compile_check.full_matrix(arch), tmp_path)
    assert all(v for k, v in report["checks"].items() if not k.startswith("mufu_by_beta")), report["checks"]


# --- per-element instruction patterns (Note [SASS weight chains]) ----------------------------------------------------

# Note [SASS weight chains]
# A weight chain is the instruction sequence that turns one element's x (the FFMA2 of FA4's scale_subtract_rowmax)
# into its weight w, followed through the registers: an instruction's sources are what the last earlier instruction
# that wrote them left (textual order: a chain sits in one basic block), a `.F32x2` operand or a packed destination
# (FADD2/FFMA2/FMUL2) being the register pair Rn:Rn+1. A chain counts only when w then reaches both P (an F2FP
# conversion) and the row sum (FADD/FADD2) before it is overwritten, possibly through `nan_row_weight`'s FFMA
# d = RZ * t + w. The templates are the SM100 stage's fragments as ptxas lowers them:
# - H15, ALU pair: FMNMX.FTZ c0, x0, -127 and c1, x1, -127 (x0 != x1) into one FADD2.FTZ {c0, c1} + 6291456
#   (1.5 * 2^22), each lane then LEA w = (lane << 22) + 0x3f800000;
# - H15, MUFU: FMNMX.FTZ -127, FADD.FTZ +6291456, FADD.FTZ -6291456, MUFU.EX2, VIADD (or IADD3) +0x200000,
#   LOP3.LUT & 0xffc00000;
# - PoT, ALU: FMNMX.FTZ -20, FADD.FTZ +12582912 (1.5 * 2^23), LEA (<< 23) + 0x3f800000, SEL w, RZ on FSETP.NEU x, -INF
#   of the same x.

_REGISTER = re.compile(r"^[-|!]*(R\d+|P\d)((?:\.\w+)*)\|?$")
_PACKED = ("FADD2", "FFMA2", "FMUL2")


def _operand_registers(operand: str) -> list[str]:
    """The registers an operand names: `R72` -> R72, `R72.F32x2.HI_LO` -> R72 and R73, `-R5`, `R0.reuse.F32`, `P3`."""
    match = _REGISTER.match(operand)
    if not match:
        return []
    register, suffix = match.group(1), match.group(2)
    return [register, f"R{int(register[1:]) + 1}"] if ".F32x2" in suffix else [register]


class SassFlow:
    """A SASS stream with, before each instruction, the last writer of every register (Note [SASS weight chains])."""

    def __init__(self, instructions: list[str]):
        self.parsed = [split_instruction(ins) for ins in instructions]
        self._writers: list[dict[str, int]] = []
        last: dict[str, int] = {}
        for i in range(len(self.parsed)):
            self._writers.append(dict(last))
            last.update((register, i) for register in self.writes(i))

    def writes(self, i: int) -> list[str]:
        mnemonic, operands = self.parsed[i]
        if not operands or not _REGISTER.match(operands[0]) or mnemonic.startswith(("ST", "BAR", "BRA", "RED")):
            return []
        register = _operand_registers(operands[0])[0]
        return [register, f"R{int(register[1:]) + 1}"] if mnemonic.split(".")[0] in _PACKED else [register]

    def writer(self, i: int, register: str) -> int | None:
        return self._writers[i].get(register)

    def source(self, i: int, register: str, mnemonic: str, *tail: str) -> int | None:
        """The last writer of `register` before i if it is `mnemonic` with operands[2:] starting with `tail`."""
        j = self.writer(i, register)
        if j is None or self.parsed[j][0] != mnemonic or tuple(self.parsed[j][1][2 : 2 + len(tail)]) != tail:
            return None
        return j

    def operand_source(self, i: int, k: int, mnemonic: str, *tail: str) -> int | None:
        registers = _operand_registers(self.parsed[i][1][k])
        return self.source(i, registers[0], mnemonic, *tail) if registers else None

    def indices(self, mnemonic: str, *tail: str) -> list[int]:
        return [i for i, (m, ops) in enumerate(self.parsed) if m == mnemonic and tuple(ops[2 : 2 + len(tail)]) == tail]

    def reaches_p_and_row_sum(self, i: int) -> bool:
        """Whether what instruction i writes reaches an F2FP and an FADD/FADD2 before it is overwritten."""
        live, seen = set(self.writes(i)[:1]), set()
        for j in range(i + 1, len(self.parsed)):
            mnemonic, operands = self.parsed[j]
            read = {r for op in operands[1:] for r in _operand_registers(op)}
            if live & read:
                seen.update(
                    kind
                    for kind, hit in (
                        ("p", mnemonic.startswith("F2FP")),
                        ("row_sum", mnemonic.split(".")[0] in ("FADD", "FADD2")),
                    )
                    if hit
                )
            if seen == {"p", "row_sum"}:
                return True
            written = set(self.writes(j))
            carried = mnemonic == "FFMA" and operands[1] == "RZ" and live & set(_operand_registers(operands[3]))
            live = (live - written) | (written if carried else set())
            if not live:
                return False
        return False


def _clamped_x(flow: SassFlow, i: int, register: str, clamp: str) -> int | None:
    """The FFMA2 (x) behind `register` at i when that is FMNMX.FTZ c, x, clamp, !PT, else None."""
    j = flow.source(i, register, "FMNMX.FTZ", clamp, "!PT")
    return None if j is None else flow.operand_source(j, 1, "FFMA2")


def h15_alu_pair_chains(instructions: list[str]) -> tuple[int, int]:
    """(complete chains, LEAs with H15's shift-add) of `h15_alu_pair` (Note [SASS weight chains])."""
    flow = SassFlow(instructions)
    leas = flow.indices("LEA", "0x3f800000", "0x16")
    complete = 0
    for i in leas:
        j = flow.operand_source(i, 1, "FADD2.FTZ", "6291456")
        if j is None or ".F32x2" not in flow.parsed[j][1][1]:
            continue
        clamps = [flow.source(j, c, "FMNMX.FTZ", "-127", "!PT") for c in _operand_registers(flow.parsed[j][1][1])]
        if None in clamps:
            continue
        xs = [flow.operand_source(k, 1, "FFMA2") for k in clamps]
        two_elements = flow.parsed[clamps[0]][1][1] != flow.parsed[clamps[1]][1][1]
        complete += None not in xs and two_elements and flow.reaches_p_and_row_sum(i)
    return complete, len(leas)


def _snap_add_source(flow: SassFlow, i: int) -> int | None:
    """The MUFU.EX2 behind instruction i when i adds 0x200000 to its result: VIADD d, e, 0x200000 or, as ptxas
    also lowers it, IADD3 d, PT, PT, e, 0x200000, RZ."""
    mnemonic, operands = flow.parsed[i]
    if mnemonic == "VIADD" and operands[2:] == ["0x200000"]:
        return flow.operand_source(i, 1, "MUFU.EX2")
    if mnemonic == "IADD3" and operands[1:3] == ["PT", "PT"] and operands[4:] == ["0x200000", "RZ"]:
        return flow.operand_source(i, 3, "MUFU.EX2")
    return None


def h15_mufu_chains(instructions: list[str]) -> tuple[int, int]:
    """(complete chains, snap LOP3s) of `h15_mufu` (Note [SASS weight chains])."""
    flow = SassFlow(instructions)
    snaps = flow.indices("LOP3.LUT", "0xffc00000", "RZ", "0xc0")
    complete = 0
    for i in snaps:
        add = flow.writer(i, _operand_registers(flow.parsed[i][1][1])[0])
        ex2 = None if add is None else _snap_add_source(flow, add)
        sub = None if ex2 is None else flow.operand_source(ex2, 1, "FADD.FTZ", "-6291456")
        rnd = None if sub is None else flow.operand_source(sub, 1, "FADD.FTZ", "6291456")
        complete += (
            rnd is not None
            and _clamped_x(flow, rnd, _operand_registers(flow.parsed[rnd][1][1])[0], "-127") is not None
            and flow.reaches_p_and_row_sum(i)
        )
    return complete, len(snaps)


def pot_alu_chains(instructions: list[str]) -> tuple[int, int]:
    """(complete chains, LEAs with PoT's shift-add) of `pot_alu` (Note [SASS weight chains])."""
    flow = SassFlow(instructions)
    leas = flow.indices("LEA", "0x3f800000", "0x17")
    complete = 0
    for i in [k for k, (m, ops) in enumerate(flow.parsed) if m == "SEL" and ops[2] == "RZ"]:
        lea = flow.operand_source(i, 1, "LEA", "0x3f800000", "0x17")
        rnd = None if lea is None else flow.operand_source(lea, 1, "FADD.FTZ", "12582912")
        if rnd is None:
            continue
        x = _clamped_x(flow, rnd, _operand_registers(flow.parsed[rnd][1][1])[0], "-20")
        test = flow.writer(i, flow.parsed[i][1][3])
        if x is None or test is None or flow.parsed[test][0] != "FSETP.NEU.AND" or flow.parsed[test][1][3] != "-INF":
            continue
        complete += flow.operand_source(test, 2, "FFMA2") == x and flow.reaches_p_and_row_sum(i)
    return complete, len(leas)
