"""The row filter of the `files` source: a small grammar, parsed whole or refused.

    filter     := or_clause
    or_clause  := and_clause ("OR" and_clause)*
    and_clause := term ("AND" term)*
    term       := condition | "(" or_clause ")"
    condition  := <column> <op> <literal>        op: >= <= > < == !=
    literal    := a number | 'quoted text' | "quoted text" | a bare word

`AND` binds tighter than `OR` (as in SQL); the keywords are case-insensitive
and must stand apart from their neighbours (spaces or parentheses). A bare
word is one token: a value holding spaces, parentheses, operators or the
words AND / OR is written quoted (`title == 'rock and roll'`). Every token
of the text must belong to the tree: `item >= 30 AND item < 40` is two
conditions, never one condition whose value is the text after `>=` (the
cause of issue 41's silent filter).

Each literal is typed by its column when the filter is applied: a bare
number compares numerically (a text column is read as numbers, and one that
holds a non-number is an error naming it), a quoted literal or a bare word
compares text (a numeric column compared with text is an error, not a
string comparison), `true` / `false` compare a boolean column. A row where
a condition's column is null fails that condition (`keep_null`: passes it).
"""

from __future__ import annotations

import math
import re
from typing import NamedTuple, Union

import pyarrow as pa
import pyarrow.compute as pc

from trainer.data.sources import DataError, DataTypeError

OPERATORS = {">=": "greater_equal", "<=": "less_equal", ">": "greater",
             "<": "less", "==": "equal", "!=": "not_equal"}
KEYWORDS = ("AND", "OR")
# One token: a quoted string, a parenthesis, an operator, or a bare word.
_TOKEN = re.compile(r"""\s*(?:('[^']*'|"[^"]*")|([()])|(>=|<=|==|!=|>|<)|([^\s()<>=!'"]+)"""
                    r"""|(\S))""")
_NUMBER = r"^\s*[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?\s*$"
_EXPECTED = ("expected '<column> <op> <value>' (op one of >= <= > < == !=), or such "
             "conditions joined by AND / OR (parentheses allowed), e.g. "
             "'played_ratio_pct>=50' or \"item >= 30 AND event == 'listen'\"")


class Filter(NamedTuple):
  """One condition: ``column op value``.

  Attributes:
    column: the column compared.
    op: one of :data:`OPERATORS`.
    value: the literal: an int or float (numeric comparison) or a str.
    text: the filter as written, for messages.
    quoted: the literal was quoted (always compared as text).
  """

  column: str
  op: str
  value: int | float | str
  text: str
  quoted: bool = False


class Combined(NamedTuple):
  """Conditions joined by one keyword.

  Attributes:
    keyword: "AND" or "OR".
    parts: two or more `Filter` or `Combined`.
    text: the filter as written, for messages.
  """

  keyword: str
  parts: tuple
  text: str


Node = Union[Filter, Combined]


class _Tokens:
  """The tokens of a filter, `(kind, text)` with kind quoted/paren/op/word/keyword."""

  def __init__(self, text: str):
    self.text, self.items, position = text, [], 0
    while position < len(text):
      match = _TOKEN.match(text, position)
      if match is None:  # only spaces are left
        break
      position = match.end()
      quoted, paren, op, word, stray = match.groups()
      if stray is not None:
        raise self.error(f"{stray!r} is not part of a condition")
      if word is not None and word.upper() in KEYWORDS:
        self.items.append(("keyword", word.upper()))
      else:
        kind = ("quoted" if quoted is not None else "paren" if paren is not None
                else "op" if op is not None else "word")
        self.items.append((kind, quoted or paren or op or word))
    self.index = 0

  def error(self, why: str) -> ValueError:
    return ValueError(f"filter {self.text!r}: {why}; {_EXPECTED}")

  def peek(self) -> tuple[str, str] | None:
    return self.items[self.index] if self.index < len(self.items) else None

  def take(self, kind: str, what: str) -> str:
    token = self.peek()
    if token is None or token[0] != kind:
      found = "the end" if token is None else repr(token[1])
      raise self.error(f"{what} expected, found {found}")
    self.index += 1
    return token[1]


def _literal(kind: str, text: str) -> int | float | str:
  """A quoted literal as text; a bare one as an int or finite float when it reads as one."""
  if kind == "quoted":
    return text[1:-1]
  for number_type in (int, float):
    try:
      number = number_type(text)
    except ValueError:
      continue
    if math.isfinite(number):
      return number
  return text


def _condition(tokens: _Tokens) -> Node:
  token = tokens.peek()
  if token == ("paren", "("):
    tokens.index += 1
    node = _or_clause(tokens)
    tokens.take("paren", "')'")
    return node
  column = tokens.take("word", "a column name")
  op = tokens.take("op", f"an operator after {column!r}")
  token = tokens.peek()
  if token is None or token[0] not in ("quoted", "word"):
    found = "the end" if token is None else repr(token[1])
    raise tokens.error(f"a value after {column!r} {op} expected, found {found}")
  tokens.index += 1
  return Filter(column, op, _literal(*token), tokens.text, token[0] == "quoted")


def _joined(tokens: _Tokens, keyword: str, part) -> Node:
  parts = [part(tokens)]
  while tokens.peek() == ("keyword", keyword):
    tokens.index += 1
    parts.append(part(tokens))
  return parts[0] if len(parts) == 1 else Combined(keyword, tuple(parts), tokens.text)


def _or_clause(tokens: _Tokens) -> Node:
  return _joined(tokens, "OR", lambda t: _joined(t, "AND", _condition))


def parse_filter(text: str) -> Node:
  """Parses a filter (the grammar of the module docstring).

  Args:
    text: e.g. ``"played_ratio_pct>=50"`` or ``"item >= 30 AND item < 40"``.

  Returns:
    :class:`Filter` for one condition, :class:`Combined` for several.

  Raises:
    ValueError: the text is not a filter; the message says where, and the form.

  Example:
    >>> parse_filter("played_ratio_pct >= 50")[:3]
    ('played_ratio_pct', '>=', 50)
    >>> parse_filter("item >= 30 and item < 40").keyword
    'AND'
  """
  if not isinstance(text, str) or not text.strip():
    raise ValueError(f"filter {text!r} is empty; {_EXPECTED}")
  tokens = _Tokens(text)
  node = _or_clause(tokens)
  if tokens.peek() is not None:
    kind, rest = tokens.peek()
    hint = (" (quote a value that holds spaces or AND / OR)" if kind in ("word", "quoted")
            else "")
    raise tokens.error(f"{rest!r} after a whole condition, where AND, OR or the end "
                       f"belongs{hint}")
  return node


def columns(node: Node | None) -> list[str]:
  """The columns a filter reads, in order of first use."""
  if node is None:
    return []
  if isinstance(node, Filter):
    return [node.column]
  return list(dict.fromkeys(name for part in node.parts for name in columns(part)))


def _is_text(kind: pa.DataType) -> bool:
  return pa.types.is_string(kind) or pa.types.is_large_string(kind)


def _all_numbers(column) -> bool:
  """Whether every non-null value of a text column reads as a number (a CSV's number column)."""
  valid = pc.drop_null(column)
  return len(valid) > 0 and pc.all(pc.match_substring_regex(valid, _NUMBER)).as_py() is True


def _mask(table: pa.Table, condition: Filter, file, keep_null: bool):
  """The boolean mask of one condition (null where the column is null, unless kept)."""
  column, value = table[condition.column], condition.value
  kind = column.type
  where = f"filter {condition.text!r}: column {condition.column!r} of {file}"
  if pa.types.is_boolean(kind) and str(value).lower() in ("true", "false"):
    value = str(value).lower() == "true"
  elif isinstance(value, (int, float)):
    if _is_text(kind):
      try:
        column = pc.cast(column, pa.float64())
      except pa.ArrowInvalid as error:
        raise DataError(f"{where} holds text that is not a number ({error}); "
                        f"expected numbers to compare with {value}") from None
    elif not (pa.types.is_integer(kind) or pa.types.is_floating(kind)
              or pa.types.is_decimal(kind)):
      raise DataTypeError(f"{where} has type {kind}; expected numbers to compare "
                          f"with {value}")
  elif not _is_text(kind):
    raise DataTypeError(f"{where} has type {kind}; expected text to compare with "
                        f"{value!r} (write a number unquoted to compare numbers)")
  elif not condition.quoted and _all_numbers(column):
    raise DataTypeError(f"{where} holds numbers; {value!r} is not one (quote it to "
                        "compare the column as text)")
  mask = getattr(pc, OPERATORS[condition.op])(column, value)
  if keep_null:
    mask = pc.or_kleene(mask, pc.is_null(column))
  return pc.fill_null(mask, False)


def mask(table: pa.Table, node: Node, file, *, keep_null: bool = False):
  """The rows of `table` where `node` holds, as a boolean mask (no nulls)."""
  if isinstance(node, Filter):
    return _mask(table, node, file, keep_null)
  join = pc.and_ if node.keyword == "AND" else pc.or_
  result = mask(table, node.parts[0], file, keep_null=keep_null)
  for part in node.parts[1:]:
    result = join(result, mask(table, part, file, keep_null=keep_null))
  return result


def apply_filter(table: pa.Table, node: Node, file, *, keep_null: bool = False) -> pa.Table:
  """Rows of ``table`` where the filter holds (a null column fails its condition,
  or passes it with ``keep_null``).

  Raises:
    DataError: a text column compared with a number holds a non-number.
    DataTypeError: a column type the literal cannot be compared with.
  """
  return table.filter(mask(table, node, file, keep_null=keep_null))
