"""What a compiled program sends between devices, how it lowered its scatters, and the constants it
embeds, read from its text.

For tests that check a step's communication (no softmax-sized gather) and for the benchmarks'
bytes per device per step. Only the partitioned program (``jit(...).lower(...).compile()``) has
collectives; a program lowered against an abstract mesh has not been partitioned yet.
``constant_sizes`` is for tests that check that weights reach a program as arguments, and
``loop_body_ops`` for those that check what XLA left inside a loop.
"""

from __future__ import annotations

import dataclasses
import re

_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
}
_OPS = ("all-gather", "all-reduce", "all-to-all", "reduce-scatter", "collective-permute")


def _op_line(ops: tuple[str, ...]) -> re.Pattern:
    """An instruction of one of ``ops`` in HLO text: ``%name = <shape or (tuple)> op(``."""
    return re.compile(r"=\s*(?P<shape>\(.*?\)|\S+)\s+(?P<op>" + "|".join(ops) + r")(?:-start)?\(")


_LINE = _op_line(_OPS)
_SCATTER_LOWERING = _op_line(("scatter", "sort", "while"))
_ARRAY = re.compile(r"\b([a-z]+\d*)\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%(?P<name>[\w.\-]+)\s*\(.*\{\s*$")
_INSTRUCTION_OP = re.compile(r"=\s*(?:\(.*?\)|\S+)\s+(?P<op>[a-z][\w\-]*)\(")
_CALLED = re.compile(r"\b(?:calls|body|to_apply|condition)=%(?P<name>[\w.\-]+)")
_STABLEHLO_CONSTANT = re.compile(r"constant dense<[^>]*>\s*:\s*tensor<((?:\d+x)*)[a-z]+\d*>")


@dataclasses.dataclass(frozen=True)
class Collective:
    op: str
    arrays: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, shape) of each result array

    @property
    def sizes(self) -> list[int]:
        """Element count of each result array."""
        return [_count(shape) for _, shape in self.arrays]

    @property
    def nbytes(self) -> int:
        return sum(_BYTES.get(dtype, 4) * _count(shape) for dtype, shape in self.arrays)

    def wire_bytes(self, n: int) -> float:
        """Bytes each of ``n`` devices sends (ring algorithms; the result is per device)."""
        if n <= 1:
            return 0.0
        if self.op == "all-reduce":
            return 2 * (n - 1) / n * self.nbytes
        if self.op == "collective-permute":
            return float(self.nbytes)
        if self.op == "reduce-scatter":  # the result is 1/n of the operand
            return (n - 1) * self.nbytes
        return (n - 1) / n * self.nbytes  # all-gather (of its result), all-to-all


def _count(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective of a compiled HLO module (``compiled.as_text()``), in program order."""
    out = []
    for line in hlo_text.splitlines():
        m = _LINE.search(line)
        if m:
            arrays = tuple(
                (dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in _ARRAY.findall(m.group("shape"))
            )
            out.append(Collective(m.group("op"), arrays))
    return out


def wire_bytes_per_device(hlo_text: str, n: int) -> dict[str, float]:
    """Bytes each device sends per call, by collective kind (see ``Collective.wire_bytes``)."""
    totals: dict[str, float] = {}
    for c in collectives(hlo_text):
        totals[c.op] = totals.get(c.op, 0.0) + c.wire_bytes(n)
    return totals


def scatter_census(hlo_text: str) -> dict[str, int]:
    """Counts, in a compiled program's HLO text (``compiled.as_text()``), of the ops that say how
    XLA lowered the scatters: ``scatter`` and ``scatter unique`` (``unique_indices=true``), and
    ``sort`` and ``while``, which XLA's deterministic-scatter rewrites emit in a scatter's place
    (a sort and scans, or a loop over the updates one at a time)."""
    census = {"scatter": 0, "scatter unique": 0, "sort": 0, "while": 0}
    for line in hlo_text.splitlines():
        m = _SCATTER_LOWERING.search(line)
        if m:
            census[m.group("op")] += 1
            if m.group("op") == "scatter" and "unique_indices=true" in line[m.end() :]:
                census["scatter unique"] += 1
    return census


def constant_sizes(stablehlo_text: str) -> list[int]:
    """Element count of every constant of a lowered program (``jit(...).lower(...).as_text()``).

    A weight closed over by a jitted function is such a constant, compiled into the program (and
    recompiled with it); one passed as an argument is not.
    """
    return [
        _count(tuple(int(d) for d in m.group(1).split("x") if d)) for m in _STABLEHLO_CONSTANT.finditer(stablehlo_text)
    ]


def loop_body_ops(hlo_text: str) -> set[str]:
    """The ops that the bodies of a compiled program's while loops run (``compiled.as_text()``),
    through the computations they call (fusions, nested loops): an op that XLA hoisted out of a
    loop, or folded into a constant, is not among them."""
    bodies: dict[str, list[str]] = {}
    name = None
    for line in hlo_text.splitlines():
        m = _COMPUTATION.match(line)
        if m:
            name = m.group("name")
            bodies[name] = []
        elif name is not None:
            bodies[name].append(line)
    todo = [m.group(1) for m in re.finditer(r"\bbody=%([\w.\-]+)", hlo_text)]
    seen: set[str] = set()
    ops: set[str] = set()
    while todo:
        name = todo.pop()
        if name in seen or name not in bodies:
            continue
        seen.add(name)
        for line in bodies[name]:
            if m := _INSTRUCTION_OP.search(line):
                ops.add(m.group("op"))
            todo += [c.group("name") for c in _CALLED.finditer(line)]
    return ops
