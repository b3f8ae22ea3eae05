"""Settings described once: each key's type and allowed values, and rules between keys.

A `Key` is one setting: its dotted path, its type, what values it allows, and
a line of documentation. A `Rule` is a relation between keys (`model.dim`
divisible by `model.num_heads`). `check` validates a flat mapping of values
against both and raises `ConfigError` with one line,

    <key>=<value>: <what is allowed>

before anything runs. The trainer config (`trainer/config/keys.py`) and the
command lines (`python -m trainer.data`) are described this way, and the docs
tables of their keys are generated from the same entries (`markdown_table`),
so the checks and the docs cannot drift. Adding a setting is one `key(...)`
line.

Example:
  >>> keys = (key("dim", INT, at_least(1), "hidden size"),
  ...         key("dropout_rate", FLOAT, fraction(), "dropout probability"))
  >>> check({"dim": 64, "dropout_rate": 0.1}, keys)
  >>> check({"dim": 64, "dropout_rate": 1.5}, keys)
  Traceback (most recent call last):
  ...
  trainer.config.schema.ConfigError: dropout_rate=1.5: a finite number in [0, 1)
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

# Value types of a key.
INT, FLOAT, STR, BOOL, INTS, STRS = "int", "float", "str", "bool", "ints", "strs"
TYPES = (INT, FLOAT, STR, BOOL, INTS, STRS)
_NOUNS = {INT: "an integer", FLOAT: "a finite number", STR: "a string", BOOL: "True or False",
          INTS: "integers", STRS: "strings"}
# What a tuple key asks of its elements as a whole.
SEQUENCE_RULES = ("", "nonempty", "distinct", "increasing")


class ConfigError(ValueError):
  """A setting has a value that cannot run; the message is one line, key first."""


@dataclasses.dataclass(frozen=True, slots=True)
class Range:
  """Numbers between `low` and `high` (None: unbounded), ends closed unless `*_open`."""

  low: float | None = None
  high: float | None = None
  low_open: bool = False
  high_open: bool = False

  def __call__(self, value) -> bool:
    if self.low is not None and (value <= self.low if self.low_open else value < self.low):
      return False
    return self.high is None or (value < self.high if self.high_open else value <= self.high)

  def __str__(self) -> str:
    if self.low is not None and self.high is not None:
      return (f"in {'(' if self.low_open else '['}{self.low:_}, "
              f"{self.high:_}{')' if self.high_open else ']'}")
    if self.low is not None:
      return f"{'>' if self.low_open else '>='} {self.low:_}"
    if self.high is not None:
      return f"{'<' if self.high_open else '<='} {self.high:_}"
    return ""


@dataclasses.dataclass(frozen=True, slots=True)
class OneOf:
  """One of a fixed tuple of choices."""

  choices: tuple

  def __call__(self, value) -> bool:
    return value in self.choices

  def __str__(self) -> str:
    return "one of " + ", ".join(repr(choice) for choice in self.choices)


def at_least(low) -> Range:
  return Range(low)


def above(low) -> Range:
  return Range(low, low_open=True)


def fraction() -> Range:
  """[0, 1): a probability that cannot be 1 (dropout, label smoothing)."""
  return Range(0, 1, high_open=True)


def unit() -> Range:
  """[0, 1]."""
  return Range(0, 1)


def one_of(*choices) -> OneOf:
  return OneOf(tuple(choices))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Key:
  """One setting.

  Attributes:
    path: dotted path ("model.dim"); the parents are its sections.
    type: one of `TYPES`; INTS and STRS are tuples (or lists) of them.
    allowed: a `Range` or `OneOf` the value (each element of a tuple) must
      satisfy, or None (any value of the type).
    doc: what the setting does, one line.
    none_ok: None is allowed (and means the documented default).
    sequence: for tuples, one of `SEQUENCE_RULES`: "nonempty", "distinct"
      (non-empty, no repeats) or "increasing" (non-empty, strictly).
    when: `(path, choices)`: the key exists only while the key at `path` has
      one of `choices` (the options of one dataset); None: always.
    required: the key must be present (where it exists).
  """

  path: str
  type: str
  doc: str
  allowed: Range | OneOf | None = None
  none_ok: bool = False
  sequence: str = ""
  when: tuple[str, tuple] | None = None
  required: bool = True

  def __post_init__(self):
    if self.type not in TYPES or self.sequence not in SEQUENCE_RULES:
      raise ValueError(f"key {self.path}: bad type {self.type!r} or sequence {self.sequence!r}")
    if self.sequence and self.type not in (INTS, STRS):
      raise ValueError(f"key {self.path}: sequence rules apply to INTS and STRS only")

  def applies(self, values: Mapping[str, Any]) -> bool:
    """Whether the key exists for these values (its `when` holds)."""
    return self.when is None or values.get(self.when[0]) in self.when[1]

  def allows(self, value) -> bool:
    """Whether `value` has the type and satisfies `allowed` and `sequence`."""
    if value is None:
      return self.none_ok
    if self.type in (INTS, STRS):
      if not isinstance(value, (tuple, list)):
        return False
      element = INT if self.type == INTS else STR
      if not all(_has_type(item, element) and (self.allowed is None or self.allowed(item))
                 for item in value):
        return False
      if self.sequence and not value:
        return False
      if self.sequence == "distinct" and len(set(value)) != len(value):
        return False
      return self.sequence != "increasing" or all(a < b for a, b in zip(value, value[1:]))
    return _has_type(value, self.type) and (self.allowed is None or self.allowed(value))

  def describe(self) -> str:
    """What is allowed, as a phrase ("an integer >= 1", "None or one of 'a', 'b'")."""
    if self.type in (INTS, STRS):
      adjective = {"": "", "nonempty": "non-empty ", "distinct": "non-empty ",
                   "increasing": "non-empty, strictly increasing "}[self.sequence]
      noun = "distinct " + _NOUNS[self.type] if self.sequence == "distinct" else _NOUNS[self.type]
      text = f"a {adjective}tuple of {noun}"
      if self.allowed is not None:
        text += f" {self.allowed}"
    elif isinstance(self.allowed, OneOf):
      text = str(self.allowed)
    else:
      text = _NOUNS[self.type] + (f" {self.allowed}" if self.allowed is not None else "")
    return ("None or " + text) if self.none_ok else text


def key(path: str, type_: str, allowed: Range | OneOf | None, doc: str, **options) -> Key:
  """`Key(path=..., type=..., allowed=..., doc=..., **options)`, one line per setting."""
  return Key(path=path, type=type_, allowed=allowed, doc=doc, **options)


def from_text(k: Key, value):
  """A command-line string as `k`'s type; text that does not parse is returned as is.

  (`check` then rejects it, naming the key and what is allowed.) Non-strings
  (argparse defaults) pass through.
  """
  if not isinstance(value, str) or k.type == STR:
    return value
  if k.none_ok and value == "None":
    return None
  parse = {INT: int, FLOAT: float, BOOL: {"true": True, "false": False}.__getitem__}
  try:
    if k.type in (INTS, STRS):
      items = [item.strip() for item in value.strip("()[] ").split(",") if item.strip()]
      return tuple(int(item) for item in items) if k.type == INTS else tuple(items)
    return parse[k.type](value.lower() if k.type == BOOL else value)
  except (KeyError, ValueError):
    return value


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Rule:
  """A relation between keys, checked once every key has a valid value.

  Attributes:
    name: short identifier ("heads_divide_dim").
    keys: the keys it relates; the first is the one the message names.
    doc: the rule in words, for the docs table.
    check: `(values, context) -> None` when the rule holds, else what is
      allowed (the message's tail); `values` holds the keys present.
  """

  name: str
  keys: tuple[str, ...]
  doc: str
  check: Callable[[Mapping[str, Any], Any], str | None]


def _has_type(value, type_: str) -> bool:
  if isinstance(value, bool):
    return type_ == BOOL
  if type_ == INT:
    return isinstance(value, numbers.Integral)
  if type_ == FLOAT:
    return isinstance(value, numbers.Real) and math.isfinite(value)
  if type_ == STR:
    return isinstance(value, str)
  return False


def flatten(tree, sections: Iterable[str] = (), prefix: str = "") -> dict[str, Any]:
  """`{dotted path: value}` of a nested mapping (ConfigDict, dict).

  Only mappings at a path in `sections` are opened (with no `sections`, every
  mapping); any other value, a mapping included, is a leaf.
  """
  sections = set(sections)
  flat = {}
  for name, value in tree.items():
    path = prefix + str(name)
    if hasattr(value, "items") and (not sections or path in sections):
      flat.update(flatten(value, sections, path + "."))
    else:
      flat[path] = value
  return flat


def sections_of(keys: Iterable[Key]) -> set[str]:
  """Every proper prefix of the keys' paths ("data", "data.source_options", ...)."""
  parts = (k.path.split(".") for k in keys)
  return {".".join(p[:i]) for p in parts for i in range(1, len(p))}


def known_keys(path: str, keys: Sequence[Key], values: Mapping[str, Any] | None = None,
               *, name: Callable[[str], str] = lambda path: path) -> str:
  """What the nearest section of `path` holds ("config.model holds dim, ..."), for messages.

  Args:
    path: a dotted path that is not a key.
    keys: the description.
    values: the current values; keys whose `when` does not hold for them are
      left out (None: every key is listed).
    name: how a path is shown.
  """
  sections = sections_of(keys)
  parent = path
  while "." in parent:
    parent = parent.rsplit(".", 1)[0]
    if parent in sections:
      break
  else:
    parent = ""
  depth = parent.count(".") + 1 if parent else 0
  children = []
  conditions = set()
  for k in keys:
    if parent and not k.path.startswith(parent + "."):
      continue
    conditions.add(k.when[0] if k.when else None)
    if values is not None and not k.applies(values):
      continue
    child = k.path.split(".")[depth]
    if child not in children:
      children.append(child)
  where = name(parent) if parent else "the top level"
  text = f"{where} holds {', '.join(children) or 'nothing'}"
  if values is not None and len(conditions) == 1 and None not in conditions:
    # A section of options of one choice (the dataset's, the split's): say which.
    condition = conditions.pop()
    text += f" when {name(condition)}={values.get(condition)!r}"
  return text


def check(values: Mapping[str, Any], keys: Sequence[Key], rules: Sequence[Rule] = (),
          context: Any = None, *, name: Callable[[str], str] = lambda path: path) -> None:
  """Checks flat `values` against `keys`, then `rules`; raises on the first problem.

  Order: unknown keys, keys without `when` (in `keys` order), keys whose
  `when` does not hold, the other keys, then `rules` (in order).

  Args:
    values: `{dotted path: value}` (see `flatten`); absent optional keys may
      be missing.
    keys: the description; a `when` must name a key without `when`.
    rules: relations between keys, run when every key is valid.
    context: passed to each rule (device count, working directory, ...).
    name: how a path is shown ("config." + path, "--" + flag name).

  Raises:
    ConfigError: `<name>=<value>: <what is allowed>` for the first problem.
  """
  index = {k.path: k for k in keys}
  _check_names(values, keys, index, name, conditional=False)
  for k in keys:
    if k.when is None:
      _check_key(k, values, name)
  _check_names(values, keys, index, name, conditional=True)
  for k in keys:
    if k.when is not None:
      _check_key(k, values, name)
  for rule in rules:
    problem = rule.check(values, context)
    if problem:
      raise ConfigError(f"{name(rule.keys[0])}={values.get(rule.keys[0])!r}: {problem}")


def _check_key(k: Key, values: Mapping[str, Any], name) -> None:
  if k.path not in values:
    if k.required and k.applies(values):
      condition = (f" when {name(k.when[0])}={values.get(k.when[0])!r}" if k.when else "")
      raise ConfigError(f"{name(k.path)} is missing: it is required{condition}; "
                        f"{k.describe()} ({k.doc})")
    return
  if k.applies(values) and not k.allows(values[k.path]):
    raise ConfigError(f"{name(k.path)}={values[k.path]!r}: {k.describe()}")


def _check_names(values: Mapping[str, Any], keys: Sequence[Key], index, name, *,
                 conditional: bool) -> None:
  """Unknown paths (`conditional=False`), or keys whose `when` does not hold (True)."""
  sections = sections_of(keys)
  for path, value in values.items():
    k = index.get(path)
    if k is None and not conditional:
      what = "a section, not a value" if path in sections else "unknown key"
      known = known_keys(path, keys, values, name=name)
      raise ConfigError(f"{name(path)}={value!r}: {what}; {known}")
    if k is not None and conditional and not k.applies(values):
      condition, current = k.when[0], values.get(k.when[0])
      raise ConfigError(
          f"{name(path)}={value!r}: not a key when {name(condition)}={current!r} "
          f"(only for {', '.join(map(repr, k.when[1]))}); "
          f"{known_keys(path, keys, values, name=name)}")


def markdown_table(keys: Sequence[Key], defaults: Mapping[str, Any] | None = None,
                   *, name: Callable[[str], str] = lambda path: path) -> str:
  """The docs table of `keys`: key, allowed values, default, meaning."""
  lines = ["| key | allowed | default | meaning |", "|---|---|---|---|"]
  for k in keys:
    allowed = k.describe()
    if k.when is not None:
      allowed += f" (when {name(k.when[0])} is {' or '.join(map(repr, k.when[1]))})"
    if not k.required:
      allowed += "; optional"
    default = "" if defaults is None or k.path not in defaults else f"`{defaults[k.path]!r}`"
    lines.append(f"| `{name(k.path)}` | {_cell(allowed)} | {default} | {_cell(k.doc)} |")
  return "\n".join(lines)


def rules_table(rules: Sequence[Rule], *, name: Callable[[str], str] = lambda path: path) -> str:
  """The docs table of `rules`: name, keys, rule."""
  lines = ["| rule | keys | what must hold |", "|---|---|---|"]
  for rule in rules:
    keys = ", ".join(f"`{name(path)}`" for path in rule.keys)
    lines.append(f"| `{rule.name}` | {keys} | {_cell(rule.doc)} |")
  return "\n".join(lines)


def _cell(text: str) -> str:
  return text.replace("|", "\\|")
