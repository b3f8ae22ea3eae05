"""Reading collectives out of a compiled program's HLO text.

`collective_report(compiled.as_text())` counts the cross-device collectives
(all-gather, all-reduce, reduce-scatter, all-to-all, collective-permute; an
async `-start`/`-done` pair counts once) and tells which of them sit in the
body of a while loop, directly or through called computations. Tests and
benchmarks use it to check that no collective runs once per vocabulary tile.
"""

from __future__ import annotations

import re
from typing import NamedTuple

COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")

_COMPUTATION = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_OP = re.compile(r"=\s*[^=]*?\b(" + "|".join(COLLECTIVES) + r")(-start)?\(")
_CALLEE = re.compile(
    r"\b(?:body|condition|to_apply|calls|branch_computations|true_computation|"
    r"false_computation)=\{?%?([\w.\-]+(?:,\s*%?[\w.\-]+)*)\}?"
)
_WHILE_BODY = re.compile(r"\bwhile\(.*\bbody=%?([\w.\-]+)")


class CollectiveReport(NamedTuple):
  """Collectives of one compiled program.

  Attributes:
    ops: op name of every collective, in text order.
    in_loop: op names of those reachable from a while-loop body.
  """

  ops: tuple[str, ...]
  in_loop: tuple[str, ...]

  @property
  def count(self) -> int:
    return len(self.ops)


def _computations(hlo_text: str) -> dict[str, list[str]]:
  computations, name = {}, None
  for line in hlo_text.splitlines():
    match = _COMPUTATION.match(line.strip()) if not line.startswith(" ") else None
    if match:
      name = match.group(1)
      computations[name] = []
    elif name is not None:
      computations[name].append(line)
  return computations


def _callees(lines: list[str]) -> set[str]:
  names = set()
  for line in lines:
    for match in _CALLEE.finditer(line):
      names.update(n.strip().lstrip("%") for n in match.group(1).split(","))
  return names


def collective_report(hlo_text: str) -> CollectiveReport:
  """Counts collectives in `hlo_text` and finds those inside while-loop bodies."""
  computations = _computations(hlo_text)
  ops_by_computation = {
      name: [m.group(1) for line in lines if (m := _OP.search(line))]
      for name, lines in computations.items()
  }
  loop_bodies = {
      m.group(1) for lines in computations.values() for line in lines
      if (m := _WHILE_BODY.search(line))
  }
  in_loop, seen, stack = [], set(), list(loop_bodies)
  while stack:
    name = stack.pop()
    if name in seen or name not in computations:
      continue
    seen.add(name)
    in_loop.extend(ops_by_computation[name])
    stack.extend(_callees(computations[name]))
  ops = tuple(op for name in computations for op in ops_by_computation[name])
  return CollectiveReport(ops=ops, in_loop=tuple(in_loop))
