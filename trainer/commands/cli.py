"""The command lines after training: flags described once, one-line errors, progress.

`python -m trainer.evaluate`, `trainer.recommend` and `trainer.export` are absl
apps whose flags are `trainer.config.schema` keys (`config_keys.COMMAND_FLAGS`).
Each command's flags live in their own `absl.flags.FlagValues`, not in the
global `FLAGS`, so the three commands and `trainer.main` (which all have a
`--workdir`) can be imported into one process (the tests do). Every flag is
parsed as text and then typed and checked by the schema, so a bad value, a
missing or unknown flag, or a workdir without `config.json` stops the
command with exit status 2 and one line,

    bad config: --top_k='abc': an integer >= 1

Flag names take underscores or dashes (`--top_k`, `--top-k`). Missing data
(`data unavailable: ...`) also exits 2. `main(argv) -> int` runs a command
in-process; `app_main(main)` is the `__main__` / console-script entry.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from absl import app, flags, logging

from trainer import libtpu_env
from trainer.workdir import logs, outputs, paths
from trainer.config import keys as config_keys, schema
from trainer.config.keys import flag_name

_HELP = ("--help", "-h", "--helpshort", "--helpfull")


def _flag_values(command: str) -> flags.FlagValues:
  values = flags.FlagValues()
  for k in config_keys.COMMAND_FLAGS[command]:
    default = config_keys.COMMAND_FLAG_DEFAULTS.get(k.path)
    if k.type == schema.BOOL:
      flags.DEFINE_bool(k.path, default, k.doc, flag_values=values)
    else:  # Typed and checked by the schema, so every message is the same.
      flags.DEFINE_string(k.path, None if default is None else str(default), k.doc,
                          flag_values=values)
  return values


def _underscores(arg: str) -> str:
  """`--top-k=5` -> `--top_k=5` (the value is left alone)."""
  if not arg.startswith("--"):
    return arg
  name, equals, value = arg[2:].partition("=")
  return "--" + name.replace("-", "_") + equals + value


def usage(command: str) -> str:
  """The flags of `command`, one per line, with what each allows."""
  lines = [f"python -m trainer.{command} flags:"]
  for k in config_keys.COMMAND_FLAGS[command]:
    defaults = config_keys.COMMAND_FLAG_DEFAULTS
    shown = f"default {defaults[k.path]!r}" if k.path in defaults else "required"
    lines.append(f"  {flag_name(k.path)}: {k.doc} ({k.describe()}; {shown})")
  return "\n".join(lines)


def parse(argv: Sequence[str], command: str) -> dict[str, Any]:
  """Parses and checks `command`'s flags.

  Args:
    argv: the command line, program name first.
    command: a key of `config_keys.COMMAND_FLAGS`.

  Returns:
    `{flag: typed value}`; flags left unset that have no default are absent.

  Raises:
    schema.ConfigError: a bad, missing or unknown flag (one line).
    SystemExit: `--help` (status 0, after printing the flags).
  """
  keys = config_keys.COMMAND_FLAGS[command]
  argv = [argv[0]] + [_underscores(arg) for arg in argv[1:]]
  if any(arg in _HELP for arg in argv[1:]):
    print(usage(command))
    raise SystemExit(0)
  parsed = _flag_values(command)
  try:
    rest = parsed(argv)
  except flags.UnrecognizedFlagError as error:
    known = ", ".join(flag_name(k.path) for k in keys)
    raise schema.ConfigError(f"--{error.flagname}: unknown flag; the flags are {known}") from None
  except flags.Error as error:
    raise schema.ConfigError(_explain(str(error), keys)) from None
  if len(rest) > 1:
    raise schema.ConfigError(f"{' '.join(rest[1:])}: unexpected arguments; "
                             f"see python -m trainer.{command} --help")
  index = {k.path: k for k in keys}
  values = {path: schema.from_text(index[path], parsed[path].value)
            for path in index if parsed[path].value is not None}
  schema.check(values, keys, config_keys.COMMAND_RULES, name=flag_name)
  return values


def _probe(folder: str, flag: str, path: str) -> None:
  reason = paths.write_error(folder)
  if reason is not None:
    raise schema.ConfigError(f"{flag}={path}: cannot write in {folder} ({reason})")


def _make_folder(folder: str, flag: str, path: str) -> None:
  if os.path.exists(folder) and not os.path.isdir(folder):
    raise schema.ConfigError(f"{flag}={path}: {folder} is a file, not a folder")
  try:
    os.makedirs(folder, exist_ok=True)
  except OSError as error:
    raise schema.ConfigError(f"{flag}={path}: cannot create {folder} "
                             f"({error.strerror or error})") from None


def check_out_file(path: str, flag: str = "--out", *, protected: Sequence[str] = ()) -> None:
  """Before any work: `path` can be written as a file (its folder made if needed).

  Remote paths (gs://) are not checked. Raises `schema.ConfigError`, one line:
  a folder, device, FIFO, socket or symlink at `path`, one of `protected`
  (a run's own files, `trainer.workdir.outputs.run_paths`), a parent that is
  a file, or a folder that cannot be created or written.
  """
  paths.check_remote(path)
  if paths.is_remote(path):
    return
  outputs.check_file(path, flag, protected=protected)
  folder = os.path.dirname(os.path.abspath(path))
  _make_folder(folder, flag, path)
  _probe(folder, flag, path)


def check_out_folder(path: str, flag: str = "--out", *, format_tag: str | None = None,
                     protected: Sequence[str] = ()) -> None:
  """Before any work: `path` is (or can be made) a folder this user can write.

  With `format_tag`, also one that is new, empty or an earlier output of
  that format, and none of `protected` (`trainer.workdir.outputs.check_folder`).
  Remote paths (gs://) are not checked. Raises `schema.ConfigError`, one line.
  """
  paths.check_remote(path)
  if paths.is_remote(path):
    return
  if os.path.exists(path) and not os.path.isdir(path):
    raise schema.ConfigError(f"{flag}={path}: a folder (this path is a file)")
  if format_tag is not None:
    outputs.check_folder(path, flag, format_tag=format_tag, protected=protected)
  _make_folder(path, flag, path)
  _probe(path, flag, path)


def _explain(message: str, keys) -> str:
  """absl's message about a flag's value as the schema says it."""
  for k in keys:
    prefix = f"flag --{k.path}="
    if message.startswith(prefix):
      value = message[len(prefix):].split(":", 1)[0]
      return f"{flag_name(k.path)}={value!r}: {k.describe()}"
    if message == f"Missing value for flag --{k.path}":
      return f"{flag_name(k.path)}: missing value; {k.describe()} ({k.doc})"
  return message


def run_command(command: str, body: Callable[[dict[str, Any]], int | None],
                argv: Sequence[str]) -> int:
  """Parses the flags and runs `body(values)`; returns the exit status.

  A `schema.ConfigError` (flags, or a value the run cannot serve) prints
  `bad config: ...`, a `WorkdirError` (a file of the run that is a folder or
  damaged, a `gs://` path without gcsfs) `bad workdir: ...`, unreadable
  prepared data `bad data: ...` and a missing data file `data unavailable:
  ...`, one line each on stderr, status 2.
  """
  from trainer.data import movielens, sources  # pylint: disable=import-outside-toplevel
  try:
    values = parse(argv, command)
    return body(values) or 0
  except schema.ConfigError as error:
    print(f"bad config: {error}", file=sys.stderr)
    return 2
  except paths.WorkdirError as error:  # a file of the run damaged, gs:// without gcsfs
    print(f"bad workdir: {error}", file=sys.stderr)
    return 2
  except sources.DataError as error:  # prepared data that cannot be read
    print(f"bad data: {error}", file=sys.stderr)
    return 2
  except (FileNotFoundError, movielens.RegistryUnavailableError) as error:
    print(f"data unavailable: {error}", file=sys.stderr)
    return 2


def app_main(main: Callable[[list[str]], int]) -> None:
  """Runs `main(argv)` as an absl app (the `__main__` and console-script entry)."""
  libtpu_env.quiet_probe_without_tpu()  # before jax starts a backend

  def flags_parser(argv):
    flags.FLAGS([argv[0]])  # absl's own flags stay at their defaults
    return argv

  def absl_main(argv):
    logging.set_verbosity(logging.WARNING)  # progress goes to stdout
    end_on_thread_failure()
    sys.exit(main(argv))

  app.run(absl_main, flags_parser=flags_parser)


def end_on_thread_failure() -> None:
  """An exception that no thread catches ends the process with it: one line, status 1.

  Without this, a worker thread's failure (grain's prefetch, orbax's writer,
  a state built on another thread) is printed as a traceback and the main
  thread waits forever for what that thread would have made (issue 41).
  `os._exit`: the main thread may be blocked where it cannot unwind.
  """
  def hook(args) -> None:
    if issubclass(args.exc_type, SystemExit) or sys.is_finalizing():
      return
    name = args.thread.name if args.thread is not None else "a thread"
    message = f"{args.exc_type.__name__}: {args.exc_value}".replace("\n", " ")
    print(f"error on thread {name}: {message}; stopping", file=sys.stderr, flush=True)
    os._exit(1)  # pylint: disable=protected-access

  threading.excepthook = hook


def bad_config(error: Exception) -> NoReturn:
  """Exits with status 2 and one line `bad config: <error>` on stderr."""
  print(f"bad config: {error}", file=sys.stderr)
  sys.exit(2)


def parse_config_flags(argv: list[str]) -> list[str]:
  """absl's parsing of the global flags, with mistakes in `--config` and its overrides as one line.

  The flags parser of the commands that take a config file (`trainer.main`,
  `trainer.compile`): unknown override keys, values of the wrong type and a
  missing config file exit with status 2 and `bad config: ...`; other flag
  errors as absl does; `--help` (absl's usage) exits 0. `--config.<key>=None`
  sets a key whose documented value may be None, and a tuple of names may be
  written bare (`--config.mesh.axis_names=(data,model)`):
  `config_keys.rewrite_overrides`.
  """
  try:
    config_keys.check_overrides(argv)
    # `=None` of a key that may be None, and bare tuples of names, as meant.
    argv, nones = config_keys.rewrite_overrides(argv)
    rest = flags.FLAGS(argv)
    if nones and flags.FLAGS["config"].value is not None:
      config_keys.set_nones(flags.FLAGS["config"].value, nones)
    return rest
  except SystemExit as done:
    # absl prints the help of --help and friends, then exits 1; a help asked
    # for is a success, as in every other command.
    if done.code == 1 and any(arg.partition("=")[0] in _HELP for arg in argv[1:]):
      raise SystemExit(0) from None
    raise
  except schema.ConfigError as error:
    bad_config(error)
  except (flags.Error, AttributeError, KeyError) as error:
    explained = config_keys.explain_flag_error(error, argv)
    if explained is not None:
      bad_config(explained)
    if not isinstance(error, flags.Error):
      raise
    sys.stderr.write(f"FATAL Flags parsing error: {error}\n"
                     "Pass --helpshort or --helpfull to see help on flags.\n")
    sys.exit(1)


def notice(message: str) -> None:
  """A progress or notice line, on stderr (stdout holds only the command's results)."""
  print(message, file=sys.stderr, flush=True)


class Progress:
  """Progress lines of a long loop: about every tenth of the way, and at the end."""

  def __init__(self, what: str, total: int, unit: str, say: Callable[[str], None] | None = None):
    self._what, self._total, self._unit, self._say = what, total, unit, say or notice
    self._every = max(1, total // 10)
    self._start = time.perf_counter()
    self._next = self._every

  def __call__(self, done: int) -> None:
    if done < self._next and done < self._total:
      return
    self._next = done + self._every
    elapsed = max(time.perf_counter() - self._start, 1e-9)
    rate = done / elapsed
    eta = (self._total - done) / rate if rate > 0 else 0.0
    self._say(f"{self._what}: {done:,}/{self._total:,} {self._unit}  {rate:.1f} {self._unit}/s  "
              f"ETA {logs.format_duration(eta)}")
