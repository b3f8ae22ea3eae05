"""The config schema: every key rejects bad values, every rule holds, the docs are current.

Walks `config_keys.KEYS` and `RULES` (and `python -m trainer.data`'s
`FLAG_KEYS`, and the flags of `trainer.evaluate`, `recommend` and `export` in
`config_keys.COMMAND_FLAGS`): for each key, values of the wrong type, out of range, not
finite, not a choice, and (for tuples) empty, repeated or unsorted must each
stop with one `bad config: <key>=<value>: ...` line and exit status 2. No
training: everything here checks values only.
"""

import importlib
import inspect
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from configs import base, smoke
from trainer import loop, main as main_lib
from trainer.config import keys as config_keys, schema
from trainer.data import __main__ as data_cli
from trainer.data import sources, splits

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KEYS = config_keys.KEYS
EIGHT = config_keys.Context(device_count=8)

# --------------------------------------------------------------------------- #
# Bad values, derived from each key's description.                             #
# --------------------------------------------------------------------------- #

_WRONG_TYPES = {
    schema.INT: ("7", 2.5, True),
    schema.FLOAT: ("0.1", math.nan, math.inf, -math.inf),
    schema.STR: (3, ("a",)),
    schema.BOOL: (1, "yes"),
    schema.INTS: (5, ("a",), (1.5,)),
    schema.STRS: ("data", (1,)),
}


def _outside(allowed, integer: bool):
  """Values just outside a Range, or a value that is not among the choices."""
  if isinstance(allowed, schema.OneOf):
    return ["no-such-choice"]
  if isinstance(allowed, schema.Range):
    step = 1 if integer else 0.5
    values = []
    if allowed.low is not None:
      values.append(allowed.low if allowed.low_open else allowed.low - step)
    if allowed.high is not None:
      values.append(allowed.high if allowed.high_open else allowed.high + step)
    return values
  assert allowed is None, f"no bad values known for constraint {allowed!r}: extend the test"
  return []


def bad_values(k: schema.Key) -> list:
  """Every kind of invalid value the description of `k` implies."""
  values = list(_WRONG_TYPES[k.type])
  if not k.none_ok:
    values.append(None)
  if k.type in (schema.INTS, schema.STRS):
    values += [(v,) for v in _outside(k.allowed, k.type == schema.INTS)]
    good = 1 if k.type == schema.INTS else "data"
    if k.sequence:
      values.append(())  # every sequence rule asks for at least one element
    if k.sequence in ("distinct", "increasing"):
      values.append((good, good))
    if k.sequence == "increasing":
      values.append((2, 1))
  else:
    values += _outside(k.allowed, k.type == schema.INT)
  return values


def _set(tree: dict, path: str, value) -> None:
  *parents, last = path.split(".")
  for part in parents:
    tree = tree.setdefault(part, {})
  tree[last] = value


def _delete(tree: dict, path: str) -> None:
  *parents, last = path.split(".")
  for part in parents:
    tree = tree[part]
  del tree[last]


# How to make a config where a conditional key exists (its `when`).
_SETUPS = {
    ("data.dataset", "synthetic"): lambda config, folder: None,
    ("data.dataset", "synthetic_topics"): lambda config, folder: config["data"].update(
        dataset="synthetic_topics", source_options={"num_users": 200, "num_items": 300,
                                                    "num_topics": 10, "seed": 0}),
    ("data.dataset", "ml-1m"): lambda config, folder: config["data"].update(
        dataset="ml-1m", source_options={}),
    ("data.dataset", "yambda"): lambda config, folder: config["data"].update(
        dataset="yambda", source_options={"path": str(folder)}),
    ("data.dataset", "ciao"): lambda config, folder: config["data"].update(
        dataset="ciao", source_options={"path": str(folder)}),
    ("data.dataset", "files"): lambda config, folder: config["data"].update(
        dataset="files", source_options={"path": str(folder), "user_col": "uid",
                                         "item_col": "item_id", "time_col": "timestamp"}),
    ("data.split", "gts"): lambda config, folder: config["data"].update(
        split="gts", split_options={"test_window": 100, "validation_window": 100}),
}


def valid_config(k: schema.Key, folder) -> dict:
  """The smoke config as a plain nested dict, set up so that `k` exists; checked valid."""
  config = smoke.get_config().to_dict()
  if k.when is not None:
    assert (k.when[0], k.when[1][0]) in _SETUPS, f"no setup for {k.when}: extend _SETUPS"
    _SETUPS[(k.when[0], k.when[1][0])](config, folder)
  config_keys.check(config, EIGHT)
  return config


def assert_one_bad_config_line(capsys, excinfo, prefix: str) -> str:
  assert excinfo.value.code == 2
  captured = capsys.readouterr()
  lines = captured.err.splitlines()
  assert len(lines) == 1 and lines[0].startswith(prefix), captured.err
  assert "Traceback" not in captured.err
  return lines[0]


CASES = [(k.path, value) for k in KEYS for value in bad_values(k)]


@pytest.mark.parametrize("path,value", CASES, ids=[f"{p}={v!r}" for p, v in CASES])
def test_every_key_rejects_each_kind_of_bad_value(path, value, tmp_path, capsys):
  config = valid_config(next(k for k in KEYS if k.path == path), tmp_path)
  _set(config, path, value)
  with pytest.raises(SystemExit) as excinfo:
    main_lib.check_or_exit(config, workdir=None)
  line = assert_one_bad_config_line(capsys, excinfo, f"bad config: config.{path}={value!r}: ")
  assert line.endswith(next(k for k in KEYS if k.path == path).describe())


@pytest.mark.parametrize("k", [k for k in KEYS if k.required], ids=lambda k: k.path)
def test_every_required_key_is_required(k, tmp_path):
  config = valid_config(k, tmp_path)
  _delete(config, k.path)
  with pytest.raises(schema.ConfigError, match=rf"^config\.{k.path} is missing: "):
    config_keys.check(config, EIGHT)


@pytest.mark.parametrize("section", sorted(schema.sections_of(KEYS)))
def test_unknown_keys_are_rejected_with_the_known_ones(section):
  config = smoke.get_config().to_dict()
  _set(config, section + ".no_such_key", 1)
  with pytest.raises(schema.ConfigError) as excinfo:
    config_keys.check(config, EIGHT)
  message = str(excinfo.value)
  assert message.startswith(f"config.{section}.no_such_key=1: unknown key; config.{section} holds ")
  if section == "model":
    assert "dim, num_layers, num_heads, mlp_dim, dropout_rate, dtype" in message


def test_unknown_top_level_key_and_section_given_a_value():
  config = smoke.get_config().to_dict()
  config["sead"] = 1
  with pytest.raises(schema.ConfigError, match=r"^config\.sead=1: unknown key; the top level "
                     r"holds seed, train_steps"):
    config_keys.check(config, EIGHT)
  config = smoke.get_config().to_dict()
  config["model"] = 3
  with pytest.raises(schema.ConfigError, match=r"^config\.model=3: a section, not a value"):
    config_keys.check(config, EIGHT)


def test_options_of_another_dataset_or_split_are_rejected():
  config = smoke.get_config().to_dict()
  config["data"]["source_options"]["path"] = "/data"
  with pytest.raises(schema.ConfigError, match=(
      r"^config\.data\.source_options\.path='/data': not a key when config\.data\.dataset="
      r"'synthetic' \(only for 'yambda', 'files', 'ciao'\); config\.data\.source_options holds num_users, ")):
    config_keys.check(config, EIGHT)
  config = smoke.get_config().to_dict()
  config["data"]["split_options"]["gap"] = 10
  with pytest.raises(schema.ConfigError, match=r"^config\.data\.split_options\.gap=10: not a key"):
    config_keys.check(config, EIGHT)


# --------------------------------------------------------------------------- #
# Rules between keys.                                                          #
# --------------------------------------------------------------------------- #


def _prepared_manifest(folder, dataset, seq_len):
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, "manifest.json"), "w", encoding="utf-8") as file:
    json.dump({"dataset": dataset, "train_windows": {str(seq_len): 1}}, file)


def _yambda_missing(config, tmp_path):
  config["data"].update(dataset="yambda", source_options={"path": str(tmp_path / "missing")})
  return config_keys.Context(device_count=8, workdir=str(tmp_path / "work"))


def _ciao_missing(config, tmp_path):
  _SETUPS[("data.dataset", "ciao")](config, tmp_path / "missing")
  return config_keys.Context(device_count=8, workdir=str(tmp_path / "work"))


def _files_missing(config, tmp_path):
  _SETUPS[("data.dataset", "files")](config, tmp_path / "missing.parquet")
  return config_keys.Context(device_count=8, workdir=str(tmp_path / "work"))


def _prepared_otherwise(config, tmp_path):
  """An explicit prepared_dir holding ML-1M while the config asks for synthetic data."""
  config["data"]["prepared_dir"] = str(tmp_path / "prepared")
  _prepared_manifest(tmp_path / "prepared", "ml-1m", config["seq_len"])
  return config_keys.Context(device_count=8, workdir=str(tmp_path / "work"))


def _set_all(**values):
  def change(config, tmp_path):
    del tmp_path
    for path, value in values.items():
      _set(config, path.replace("__", "."), value)
    return EIGHT
  return change


def _model_too_big(config, tmp_path):
  """Issue 41: dim 100,000 needs ~640 GB of state per device; the activations fit 64 GiB."""
  del tmp_path
  _set(config, "model.dim", 100_000)
  _set(config, "model.num_heads", 1)
  return EIGHT._replace(memory_bytes=64 * 2**30)


# Rule name -> a change of the smoke config (and the context) that breaks it.
RULE_BREAKERS = {
    "model_fits": _model_too_big,
    "negatives_fit": _set_all(loss__kind="in_batch", loss__num_negatives=2**31 - 1,
                              loss__vocab_reduction="sum"),
    "mesh_lengths": _set_all(mesh__shape=(4, 2)),
    "mesh_covers_devices": _set_all(mesh__shape=(4,)),
    "dcn_shape_fits": _set_all(mesh__dcn_shape=(2,)),
    "token_axes_in_mesh": _set_all(mesh__token_axes=("batch",)),
    "vocab_axis_in_mesh": _set_all(mesh__vocab_axis="model"),
    "batch_divides_token_shards": _set_all(batch_size=12),
    "eval_batch_divides_token_shards": _set_all(eval_batch_size=3),
    "batch_divides_processes": lambda config, tmp_path: config_keys.Context(8, process_count=3),
    "eval_batch_divides_processes": lambda config, tmp_path: (
        config.update(batch_size=48), config_keys.Context(8, process_count=3))[1],
    "heads_divide_dim": _set_all(model__dim=7, model__num_heads=2),
    "yambda_folder_exists": _yambda_missing,
    "ciao_file_exists": _ciao_missing,
    "files_path_matches": _files_missing,
    "files_filter_parses": lambda config, tmp_path: (
        _SETUPS[("data.dataset", "files")](config, tmp_path),
        config["data"]["source_options"].update(filter="played=5"), EIGHT)[-1],
    "prepared_dir_matches": _prepared_otherwise,
    "memory_limit_parses": _set_all(data__prepare_memory_limit="lots"),
    "per_host_folder_is_local": _set_all(data__prepare_per_host=True),
    "process_placeholder_needs_per_host": _set_all(data__prepared_dir="/data/prepared-{process}"),
    "target_mean_is_softmax_ce": _set_all(loss__target_reduction="mean"),
    "softmax_ce_has_no_variants": _set_all(loss__kind="softmax_ce", loss__focal_gamma=2.0),
    "sampled_has_no_variants": _set_all(loss__kind="gbce", loss__pos_weight=2.0),
    "num_negatives_fits": _set_all(loss__kind="sampled_softmax", loss__num_negatives=None),
    "sampler_draws_from_catalog": _set_all(loss__sampler="popularity"),
    "logq_is_for_softmax": _set_all(loss__logq=True),
    "best_metric_is_evaluated": _set_all(checkpoint__best_metric="ndcg@7"),
    "patience_has_a_metric": _set_all(checkpoint__patience=3, checkpoint__best_metric=None),
    "seq_len_fits": _set_all(seq_len=2**31),
    "batch_fits": _set_all(batch_size=2**40),
    "eval_batch_fits": _set_all(eval_batch_size=2**36),
}


def test_every_rule_has_a_breaking_case():
  assert set(RULE_BREAKERS) == {rule.name for rule in config_keys.RULES}


@pytest.mark.parametrize("rule", config_keys.RULES, ids=lambda rule: rule.name)
def test_every_rule_is_enforced_naming_its_first_key(rule, tmp_path):
  config = smoke.get_config().to_dict()
  context = RULE_BREAKERS[rule.name](config, tmp_path)
  with pytest.raises(schema.ConfigError, match=rf"^config\.{rule.keys[0]}=") as excinfo:
    config_keys.check(config, context)
  # The message is the rule's own, not a per-key one.
  assert rule.check(schema.flatten(config, schema.sections_of(KEYS)), context) in str(
      excinfo.value)


def test_yambda_folder_is_not_needed_once_prepared(tmp_path):
  config = smoke.get_config().to_dict()
  context = _yambda_missing(config, tmp_path)
  _prepared_manifest(tmp_path / "work" / "data", "yambda", config["seq_len"])
  config_keys.check(config, context)
  # Without the workdir (no run), files are not looked at.
  _yambda_missing(config, tmp_path / "elsewhere")
  config_keys.check(config, EIGHT)


def test_the_six_cases_of_the_issue():
  """Each was accepted, or failed later with a traceback, before the schema."""
  cases = {
      "config.model.dim=7: a multiple of config.model.num_heads=2": {"model.dim": 7},
      "config.eval.ks=(0,): a non-empty, strictly increasing": {"eval.ks": (0,)},
      "config.model.dropout_rate=1.5: a finite number in [0, 1)": {"model.dropout_rate": 1.5},
      "config.optimizer.clip_norm=-1.0: None or a finite number > 0": {"optimizer.clip_norm": -1.0},
      "config.data.min_item_count=-1: None or an integer >= 0": {"data.min_item_count": -1},
      "config.optimizer.learning_rate=nan: a finite number > 0": {
          "optimizer.learning_rate": math.nan},
  }
  for message, change in cases.items():
    config = smoke.get_config().to_dict()
    for path, value in change.items():
      _set(config, path, value)
    with pytest.raises(schema.ConfigError) as excinfo:
      config_keys.check(config, EIGHT)
    assert str(excinfo.value).startswith(message), excinfo.value


# --------------------------------------------------------------------------- #
# The description against the code and the docs.                              #
# --------------------------------------------------------------------------- #


def test_base_config_has_exactly_the_unconditional_keys():
  flat = schema.flatten(base.get_config(), schema.sections_of(KEYS))
  always = {k.path for k in KEYS if k.when is None}
  assert {path for path in flat if ".source_options." not in path} == always


def test_source_and_split_options_are_the_loaders_arguments():
  for dataset in sources.SOURCE_NAMES:
    arguments = set(inspect.signature(sources.get_source(dataset)).parameters)
    described = {k.path.rsplit(".", 1)[1] for k in KEYS
                 if k.path.startswith("data.source_options.") and dataset in k.when[1]}
    assert described == arguments, dataset
  arguments = set(inspect.signature(splits.global_temporal_split).parameters) - {"sequences"}
  assert {k.path.rsplit(".", 1)[1] for k in KEYS
          if k.path.startswith("data.split_options.")} == arguments


def test_docs_table_is_generated_from_the_schema():
  with open(os.path.join(ROOT, "docs", "trainer.md"), encoding="utf-8") as file:
    text = file.read()
  expected = config_keys.markdown(config_keys.base_defaults())
  assert expected in text, ("docs/trainer.md's config keys are stale: run "
                            "`python -m trainer.config.keys --update docs/trainer.md`")


def test_non_finite_message_when_no_checkpoint_exists_yet():
  message = loop.non_finite_message(math.nan, math.inf, 2, None, "/w")
  assert "No checkpoint was saved yet" in message and "None" not in message
  assert "The last good checkpoint is step 10 in /w/checkpoints" in loop.non_finite_message(
      math.nan, 1.0, 13, 10, "/w")


# --------------------------------------------------------------------------- #
# python -m trainer.data: its flags, described the same way.                  #
# --------------------------------------------------------------------------- #


def _cli_bad_values(k: schema.Key) -> list[str]:
  """Command-line texts `k` must reject (everything arrives as a string)."""
  values = {schema.INT: ["abc", "2.5"], schema.FLOAT: ["abc", "nan", "inf"]}.get(k.type, [])
  values += [str(v) for v in _outside(k.allowed, k.type == schema.INT)]
  return values


# Flags whose every string is a valid value; their other checks are named here.
_CLI_OTHER_CHECKS = {"out": "required", "yambda_path": "rule yambda_folder_exists",
                     "cache_dir": "any folder (created when missing)",
                     "path": "rules files_path_matches, ciao_file_exists",
                     "user_col": "rule files_user_col_given",
                     "item_col": "rule files_item_col_given",
                     "time_col": "rule files_time_col_given",
                     "filter": "rule files_filter_parses",
                     "memory_limit": "rule memory_limit_parses (test_data_engine.py)",
                     "temp_dir": "any local folder (created when missing)"}
CLI_CASES = [(k.path, v) for k in data_cli.FLAG_KEYS for v in _cli_bad_values(k)]


def test_every_cli_flag_is_described_and_checked():
  dests = {action.dest for action in data_cli._parser()._actions if action.dest != "help"}
  assert dests == {k.path for k in data_cli.FLAG_KEYS}
  for k in data_cli.FLAG_KEYS:
    assert _cli_bad_values(k) or k.path in _CLI_OTHER_CHECKS, k.path


@pytest.mark.parametrize("path,text", CLI_CASES, ids=[f"{p}={v}" for p, v in CLI_CASES])
def test_every_cli_flag_rejects_bad_values(path, text, tmp_path, capsys):
  flag = data_cli.flag_name(path)
  argv = ["--dataset", "synthetic", "--out", str(tmp_path / "out"), flag, text]
  if path == "dataset":
    argv = argv[2:]
  assert data_cli.main(argv) == 2
  err = capsys.readouterr().err
  assert err.startswith(f"bad config: {flag}=") and err.count("\n") == 1, err
  assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("flags,start", [
    (["--dataset", "synthetic"], "bad config: the following arguments are required: --out"),
    # An abbreviation is not taken for the flag it starts.
    (["--dataset", "synthetic", "--out", "OUT", "--num-user", "3"],
     "bad config: --num-user 3: unknown flag; the flags are --dataset, --out,"),
    (["--dataset", "yambda", "--out", "OUT", "--yambda-path", "/no/such/folder"],
     "bad config: --yambda-path='/no/such/folder': an existing folder"),
    (["--dataset", "yambda", "--out", "OUT"], "bad config: --yambda-path=None: an existing"),
])
def test_cli_missing_unknown_and_rule_breaking_flags(flags, start, tmp_path, capsys):
  out = str(tmp_path / "out")
  assert data_cli.main([out if flag == "OUT" else flag for flag in flags]) == 2
  err = capsys.readouterr().err
  assert err.startswith(start) and err.count("\n") == 1, err
  assert not os.path.exists(out)


# --------------------------------------------------------------------------- #
# python -m trainer.evaluate, recommend, export: their flags, the same way.   #
# --------------------------------------------------------------------------- #


def _command_bad_values(k: schema.Key) -> list[str]:
  return _cli_bad_values(k) + (["maybe"] if k.type == schema.BOOL else [])


# Flags whose every string is a valid value; their other checks are named here.
_COMMAND_OTHER_CHECKS = {"workdir": "rule workdir_holds_run", "users": "rule users_file_exists",
                         "out": "any path (created)"}
COMMAND_CASES = [(command, k.path, v) for command, keys in config_keys.COMMAND_FLAGS.items()
                 for k in keys for v in _command_bad_values(k)]


def _command_main(command: str):
  return importlib.import_module(f"trainer.commands.{command}").main


def test_every_command_flag_is_described_and_checked():
  for command, keys in config_keys.COMMAND_FLAGS.items():
    for k in keys:
      assert _command_bad_values(k) or k.path in _COMMAND_OTHER_CHECKS, (command, k.path)
    assert callable(_command_main(command))


@pytest.mark.parametrize("command,path,text", COMMAND_CASES,
                         ids=[f"{c}--{p}={v}" for c, p, v in COMMAND_CASES])
def test_every_command_flag_rejects_bad_values(command, path, text, tmp_path, capsys):
  given = {"workdir": str(tmp_path), "out": str(tmp_path / "out"), "top_k": "3"}
  flags = [f"--{k.path}={given[k.path]}" for k in config_keys.COMMAND_FLAGS[command]
           if k.path in given]
  assert _command_main(command)([command, *flags, f"--{path}={text}"]) == 2
  captured = capsys.readouterr()
  assert captured.err.startswith(f"bad config: --{path}=") and captured.err.count("\n") == 1, (
      captured.err)
  assert captured.out == "" and not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("command", sorted(config_keys.COMMAND_FLAGS))
def test_command_rules_unknown_and_missing_flags(command, tmp_path, capsys):
  main = _command_main(command)
  keys = {k.path for k in config_keys.COMMAND_FLAGS[command]}
  required = [f"--out={tmp_path / 'out'}"] * ("out" in keys) + ["--top_k=3"] * ("top_k" in keys)
  cases = [
      ([f"--workdir={tmp_path}", *required], f"bad config: --workdir='{tmp_path}': an existing "
       "run directory holding config.json"),
      ([*required], "bad config: --workdir is missing: it is required"),
      ([f"--workdir={tmp_path}", *required, "--no-such-flag=1"],
       "bad config: --no_such_flag: unknown flag; the flags are --workdir, "),
  ]
  run = tmp_path / "run"
  run.mkdir()
  (run / "config.json").write_text("{}")
  cases.append(([f"--workdir={run}", *required],
                f"bad config: {run / 'config.json'}: a config of format 'cutbce-run-config'"))
  if "users" in keys:
    cases.append(([f"--workdir={run}", *required, f"--users={tmp_path / 'none.txt'}"],
                  f"bad config: --users='{tmp_path / 'none.txt'}': None or an existing file"))
  for flags, start in cases:
    assert main([command, *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(start) and err.count("\n") == 1, err


# --------------------------------------------------------------------------- #
# The real commands, as a user runs them (a few: each starts a Python).       #
# --------------------------------------------------------------------------- #


def _run(args, tmp_path):
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
             JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=120)


@pytest.mark.parametrize("overrides,line", [
    (["--config.model.dim=7", "--config.model.num_heads=2"],
     "bad config: config.model.dim=7: a multiple of config.model.num_heads=2"),
    (["--config.model.hidden=3"], "bad config: config.model.hidden='3': unknown key; "
     "config.model holds dim, num_layers, num_heads, mlp_dim, dropout_rate, dtype, "
     "item_bias, block, positions, init, embedding_std, scale_embeddings, output_table"),
    (["--config.model.dropout_rate=abc"],
     "bad config: config.model.dropout_rate='abc': a finite number in [0, 1)"),
])
def test_trainer_main_stops_with_one_line_and_status_2(overrides, line, tmp_path):
  result = _run(["trainer.main", "--config=configs/smoke.py", f"--workdir={tmp_path}",
                 *overrides], tmp_path)
  assert result.returncode == 2, result.stderr[-2000:]
  assert result.stderr.splitlines() == [line]
  assert os.listdir(tmp_path) == []  # no data prepared, nothing written


def test_trainer_data_stops_with_one_line_and_status_2(tmp_path):
  result = _run(["trainer.data", "--dataset", "synthetic", "--out", str(tmp_path / "out"),
                 "--transition-prob", "1.5"], tmp_path)
  assert result.returncode == 2
  assert result.stderr.splitlines() == [
      "bad config: --transition-prob=1.5: None or a finite number in [0, 1]"]


def test_schema_docstring_example_runs():
  import doctest  # pylint: disable=import-outside-toplevel
  assert doctest.testmod(schema).failed == 0


# --------------------------------------------------------------------------- #
# mesh.shape with -1.                                                          #
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize("names,shape,devices,want", [
    (("data",), (-1,), 8, (8,)),
    (("data", "model"), (-1, 4), 8, (2, 4)),
    (("data", "model"), (2, -1), 8, (2, 4)),
    (("data", "model"), (-1, 1), 1, (1, 1)),
])
def test_a_minus_one_in_the_mesh_is_filled_from_the_device_count(names, shape, devices, want):
  from trainer.config import mesh as config_mesh  # pylint: disable=import-outside-toplevel
  config = smoke.get_config()
  config.mesh.axis_names, config.mesh.shape, config.mesh.token_axes = names, shape, names
  config.batch_size = config.eval_batch_size = 64
  config_mesh.check_config(config, devices)
  assert tuple(config.mesh.shape) == want


@pytest.mark.parametrize("shape,message", [
    ((-1, -1), r"^config.mesh.shape=\(-1, -1\): at most one size may be -1"),
    ((-1, 3), r"^config.mesh.shape=\(-1, 3\): the sizes besides -1 multiply to 3, which "
              "does not divide the 8 devices present"),
    ((-2, 4), r"^config.mesh.shape=\(-2, 4\)"),
])
def test_a_bad_minus_one_mesh_is_one_config_error(shape, message):
  from trainer.config import mesh as config_mesh  # pylint: disable=import-outside-toplevel
  config = smoke.get_config()
  config.mesh.axis_names, config.mesh.shape = ("data", "model"), shape
  config.mesh.token_axes = ("data", "model")
  with pytest.raises(schema.ConfigError, match=message):
    config_mesh.check_config(config, 8)


class _FakeDevice:
  """What jax's hybrid mesh reads of a CPU device: id, platform, process."""

  def __init__(self, index, process):
    self.id, self.process_index, self.platform = index, process, "cpu"
    self.device_kind = "cpu"

  def __repr__(self):
    return f"d{self.id}@p{self.process_index}"


def test_dcn_shape_puts_each_process_in_one_block():
  from trainer.config import mesh as config_mesh  # pylint: disable=import-outside-toplevel
  config = smoke.get_config()
  config.mesh.axis_names, config.mesh.shape = ("data", "model"), (4, 2)
  config.mesh.dcn_shape = (2, 1)
  devices = [_FakeDevice(i, i // 4) for i in range(8)]
  grid = config_mesh.mesh_devices(config, devices)
  processes = np.vectorize(lambda d: d.process_index)(grid)
  # The data axis spans the two processes: rows 0-1 on one, rows 2-3 on the other.
  assert processes.tolist() == [[0, 0], [0, 0], [1, 1], [1, 1]]
  assert config_mesh.slice_count(devices) == 2
  config.mesh.dcn_shape = None
  assert config_mesh.mesh_devices(config, devices[:8]).shape == (4, 2)
