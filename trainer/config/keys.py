"""The trainer config described once: each key's type, range and meaning, and the rules.

`KEYS` lists every key of `configs/base.py` (and the source and split options
each dataset and split accept); `RULES` the relations between keys. `check`
validates a config against both before anything runs (no data is read, no
array made, nothing traced) and raises `schema.ConfigError` with one line,

    config.model.dropout_rate=1.5: a finite number in [0, 1)

The keys table of docs/trainer.md is generated from these entries
(`python -m trainer.config.keys --update docs/trainer.md`), and a test
checks that it is current. Adding a config key is one `key(...)` line here
plus its default (and comment) in `configs/base.py`.

The commands that read a workdir (`trainer.evaluate`, `trainer.recommend`,
`trainer.export`) check the config saved with the run with `check`, and their
flags are described here too (`COMMAND_FLAGS`, `COMMAND_RULES`; parsed by
`trainer/commands/cli.py`), in the docs table with the config keys.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from etils import epath

from cutbce.backends import BACKEND_CHOICES
from trainer.workdir import paths
from trainer.data import ciao, engine, files, prepare, sources, splits, windows, yambda
from trainer.config.schema import (BOOL, FLOAT, INT, INTS, STR, STRS, ConfigError, Rule, above,
                            at_least, flatten, fraction, key, one_of, sections_of, unit)
from trainer.config import budget, schema

__all__ = ["COMMAND_FLAGS", "COMMAND_FLAG_DEFAULTS", "COMMAND_RULES", "ConfigError", "Context",
           "KEYS", "RULES", "check", "check_overrides", "explain_flag_error", "markdown",
           "metric_names", "name", "prepared_folder"]

_SYNTHETIC = ("data.dataset", ("synthetic", "synthetic_topics"))
_SUCCESSORS = ("data.dataset", ("synthetic",))
_TOPICS = ("data.dataset", ("synthetic_topics",))
_MOVIELENS = ("data.dataset", ("ml-1m", "ml-100k"))
_YAMBDA = ("data.dataset", ("yambda",))
_FILES = ("data.dataset", ("files",))
_GTS = ("data.split", ("gts",))
_INT32_IDS = schema.Range(1, 2**31 - 1)
# The sampled baselines' settings (`trainer/sampled.py` imports them from here).
SAMPLED_KINDS = ("sampled_softmax", "gbce", "in_batch")
SAMPLERS = ("uniform", "popularity")
NEGATIVES_PER = ("batch", "sequence", "position")
LOSS_KINDS = ("bce", "softmax_ce") + SAMPLED_KINDS
_SOFTMAX_KINDS = ("softmax_ce", "sampled_softmax", "in_batch")

KEYS: tuple[schema.Key, ...] = (
    key("seed", INT, at_least(0), "seed of parameter init, dropout and the data shuffle"),
    key("train_steps", INT, at_least(1), "optimizer steps to train for"),
    key("batch_size", INT, at_least(1), "global training batch (sequences per step)"),
    key("eval_batch_size", INT, at_least(1), "global evaluation batch (users per step)"),
    key("seq_len", INT, at_least(1), "N: inputs per training window and evaluation history"),
    key("num_targets", INT, at_least(1), "L: next items per position used as positive labels"),
    key("eval_every", INT, at_least(1), "evaluate on `eval.split` every k steps"),
    key("checkpoint_every", INT, at_least(1), "save a checkpoint every k steps"),
    key("log_every", INT, at_least(1), "log a progress line every k steps"),
    key("max_checkpoints", INT, at_least(1), "latest checkpoints kept (None: all); the best "
        "one (`checkpoint.best_metric`) is kept beside them", none_ok=True),
    key("checkpoint.best_metric", STR, None, "also keep the checkpoint with the best value of "
        "this validation metric: 'mrr', or 'recall@k', 'ndcg@k', 'hit@k' with k in "
        "`eval.ks` (None: keep the latest ones only)", none_ok=True),
    key("checkpoint.patience", INT, at_least(1), "stop training once `checkpoint.best_metric` "
        "has not risen in this many evaluations (early stopping; None: train every "
        "`train_steps`)", none_ok=True),
    key("mesh.axis_names", STRS, None, "names of the device mesh axes", sequence="distinct"),
    key("mesh.shape", INTS, at_least(1), "sizes of the mesh axes (one may be -1: the "
        "devices the others leave)", sequence="nonempty"),
    key("mesh.dcn_shape", INTS, at_least(1), "of each size, how many slices it spans "
        "(over DCN); None: one slice", sequence="nonempty", none_ok=True),
    key("mesh.token_axes", STRS, None, "axes splitting the batch (tokens)", sequence="distinct"),
    key("mesh.vocab_axis", STR, None, "axis splitting the item table by rows (None: replicated)",
        none_ok=True),
    key("model.dim", INT, at_least(1), "D: hidden size and item embedding size"),
    key("model.num_layers", INT, at_least(0), "transformer blocks"),
    key("model.num_heads", INT, at_least(1), "attention heads per block"),
    key("model.mlp_dim", INT, at_least(1), "hidden size of each block's feed-forward"),
    key("model.dropout_rate", FLOAT, fraction(), "dropout probability (attention, blocks)"),
    key("model.dtype", STR, one_of("float32", "bfloat16"), "compute dtype (params are float32)"),
    key("model.item_bias", BOOL, None, "a learned logit bias per item (init -log V)"),
    key("model.block", STR, one_of("pre_ln", "sasrec"), "transformer block: 'pre_ln' "
        "(pre-LayerNorm, GELU) or 'sasrec' (the original SASRec block that SASRec+ trains: "
        "LayerNorm on the queries only, ReLU; trainer/model.py)"),
    key("model.positions", STR, one_of("window", "from_first"), "position embeddings by "
        "slot in the window ('window': the newest item is slot N - 1) or counted from the "
        "window's first item ('from_first', as right-padded implementations do)"),
    key("model.init", STR, one_of("flax", "sasrec_plus", "pytorch"), "initializers: flax's "
        "(embeddings normal(D^-1/2)), SASRec+'s code's (normal(0.02)) or PyTorch's defaults "
        "(gSASRec's code: embeddings normal(1)); trainer/model.py"),
    key("model.embedding_std", FLOAT, above(0), "std of the item, position (and output) "
        "tables' normal init over `model.init`'s; the linear layers keep `model.init`'s "
        "(None: `model.init`'s)", none_ok=True),
    key("model.scale_embeddings", BOOL, None, "multiply the input item embeddings by "
        "sqrt(D) (SASRec, SASRec+; gSASRec does not)"),
    key("model.output_table", STR, one_of("tied", "separate"), "the items' output table: "
        "the input embedding ('tied') or a second table ('separate', gSASRec's default)"),
    key("optimizer.learning_rate", FLOAT, above(0), "peak learning rate of AdamW"),
    key("optimizer.warmup_steps", INT, at_least(0), "linear warm-up steps from 0"),
    key("optimizer.schedule", STR, one_of("constant", "cosine"), "after warm-up: constant, "
        "or cosine decay to 0 at `train_steps`"),
    key("optimizer.b1", FLOAT, fraction(), "AdamW first-moment decay"),
    key("optimizer.b2", FLOAT, fraction(), "AdamW second-moment decay"),
    key("optimizer.weight_decay", FLOAT, at_least(0), "AdamW weight decay (matrices only)"),
    key("optimizer.clip_norm", FLOAT, above(0), "gradients clipped to this global norm "
        "(None: not clipped)", none_ok=True),
    key("data.dataset", STR, one_of(*sources.SOURCE_NAMES), "the `trainer.data` source"),
    key("data.prepared_dir", STR, None, "folder of the prepared data, local or gs://... "
        "(None: WORKDIR/data); `{process}` in it is replaced by the process index",
        none_ok=True),
    key("data.prepare_per_host", BOOL, None, "every process prepares its own copy into its "
        "local `data.prepared_dir` (a barrier after), instead of process 0 alone into a folder "
        "every host reads"),
    key("data.prepare_memory_limit", STR, None, "memory limit of the out-of-core preparation "
        "of files and yambda (e.g. '4GB'; past it DuckDB spills to the temporary folder); "
        "None: half of the host's RAM", none_ok=True),
    key("data.prepare_shards", INT, at_least(1), "event arrays prepared in this many user "
        "shards (a multiple of the process count: each process reads only its shards)"),
    key("data.min_item_count", INT, at_least(0), "keep items with >= k interactions "
        "(None: 5 for MovieLens, 1 for Yambda and files, 0 = whole catalog for synthetic)",
        none_ok=True),
    key("data.split", STR, one_of(*splits.SPLITS), "leave-one-out or global temporal split"),
    key("data.train_windows", STR, one_of(*windows.TRAIN_WINDOWS), "training windows of an "
        "epoch: 'all' non-overlapping windows of every history, or 'last', each user's most "
        "recent window (one sequence per user, as the published SASRec recipes)"),
    key("data.num_threads", INT, at_least(0), "grain read threads"),
    key("data.prefetch_buffer_size", INT, at_least(0), "batches read ahead"),
    key("data.source_options.num_users", INT, _INT32_IDS, "synthetic users",
        when=_SYNTHETIC, required=False),
    key("data.source_options.num_items", INT, _INT32_IDS, "synthetic catalog size V",
        when=_SYNTHETIC, required=False),
    key("data.source_options.interactions_per_user", INT, at_least(1),
        "mean synthetic sequence length", when=_SUCCESSORS, required=False),
    key("data.source_options.zipf_exponent", FLOAT, above(0), "Zipf exponent of popularity",
        when=_SYNTHETIC, required=False),
    key("data.source_options.transition_prob", FLOAT, unit(),
        "probability that the next item is the planted successor", when=_SYNTHETIC,
        required=False),
    key("data.source_options.num_topics", INT, _INT32_IDS, "synthetic_topics: K topics "
        "(rank r in topic r mod K; at most num_items)", when=_TOPICS, required=False),
    key("data.source_options.topics_per_user", INT, at_least(1), "synthetic_topics: interest "
        "slots per user, topics drawn by topic popularity", when=_TOPICS, required=False),
    key("data.source_options.topic_concentration", FLOAT, above(0), "synthetic_topics: "
        "Dirichlet concentration of a user's slot weights", when=_TOPICS, required=False),
    key("data.source_options.topic_stay_prob", FLOAT, unit(), "synthetic_topics: probability "
        "that an event keeps the previous event's slot (else one drawn from the weights)",
        when=_TOPICS, required=False),
    key("data.source_options.length_log_mean", FLOAT, None, "synthetic_topics: mean of log "
        "history length (ML-1M: 4.6047)", when=_TOPICS, required=False),
    key("data.source_options.length_log_std", FLOAT, at_least(0), "synthetic_topics: std of "
        "log history length (ML-1M: 0.9906)", when=_TOPICS, required=False),
    key("data.source_options.min_length", INT, at_least(1), "synthetic_topics: shortest "
        "history (ML-1M: 18)", when=_TOPICS, required=False),
    key("data.source_options.max_length", INT, at_least(1), "synthetic_topics: longest "
        "history (ML-1M: 2,277)", when=_TOPICS, required=False),
    key("data.source_options.repeat_prob", FLOAT, unit(), "synthetic_topics: probability that "
        "an event repeats one of the previous repeat_window items (ML-1M: 0)", when=_TOPICS,
        required=False),
    key("data.source_options.repeat_window", INT, at_least(1), "synthetic_topics: previous "
        "items a repeat chooses from", when=_TOPICS, required=False),
    key("data.source_options.seed", INT, at_least(0), "seed of the synthetic data",
        when=_SYNTHETIC, required=False),
    key("data.source_options.mean_gap_seconds", INT, at_least(1),
        "mean time between two synthetic events", when=_SYNTHETIC, required=False),
    key("data.source_options.horizon_seconds", INT, at_least(1),
        "range of synthetic user start times", when=_SYNTHETIC, required=False),
    key("data.source_options.cache_dir", STR, None, "wheel cache (None: $CUTBCE_DATA or "
        "~/.cache/cutbce)", none_ok=True, when=_MOVIELENS, required=False),
    key("data.source_options.path", STR, None, "yambda: folder of the parquet files; files: "
        "a file, folder or glob of parquet, CSV, TSV or JSON lines files; ciao: "
        "rating_with_timestamp.mat or its folder",
        when=("data.dataset", ("yambda", "files", "ciao"))),
    key("data.source_options.event", STR, one_of(*yambda.EVENTS), "Yambda event file",
        when=_YAMBDA, required=False),
    key("data.source_options.min_played_ratio", INT, schema.Range(0, 100),
        "keep listens with played_ratio_pct >= this", when=_YAMBDA, required=False),
    key("data.source_options.user_col", STR, None, "column of user ids (integers or strings)",
        when=_FILES),
    key("data.source_options.item_col", STR, None, "column of item ids (integers or strings)",
        when=_FILES),
    key("data.source_options.time_col", STR, None, "column of event times (numbers, "
        "date-times or ISO-8601 strings)", when=_FILES),
    key("data.source_options.filter", STR, None, "keep rows where '<column> <op> <value>' "
        "holds, op one of >= <= > < == != (None: every row)", none_ok=True, when=_FILES,
        required=False),
    key("data.source_options.time_unit", STR, one_of(*files.TIME_UNITS), "what one unit of a "
        "numeric time is; timestamps and split windows are counts of it", when=_FILES,
        required=False),
    key("data.split_options.test_window", INT, at_least(1), "test window (timestamp units)",
        when=_GTS),
    key("data.split_options.validation_window", INT, at_least(0),
        "validation window (0: no validation examples)", when=_GTS),
    key("data.split_options.gap", INT, at_least(0), "gap before each window", when=_GTS,
        required=False),
    key("loss.kind", STR, one_of(*LOSS_KINDS), "the loss: full-catalog BCE "
        "(`cut_bce`) or full-catalog softmax cross-entropy (`cut_softmax_ce`), or a sampled "
        "baseline over k negatives: sampled softmax, gSASRec's gBCE, or in-batch negatives "
        "(`trainer/sampled.py`)"),
    key("loss.num_negatives", INT, at_least(1), "k: negatives per batch or per position of "
        "the sampled kinds (None: in_batch with every target slot of the batch)",
        none_ok=True),
    key("loss.sampler", STR, one_of(*SAMPLERS), "sampled_softmax, gbce: negatives "
        "drawn uniformly over the catalog or in proportion to the items' training counts"),
    key("loss.negatives_per", STR, one_of(*NEGATIVES_PER), "sampled kinds: one set "
        "of k negatives shared by every position of the batch, k distinct ones per sequence "
        "(without replacement; SASRec+'s draw), or k per position"),
    key("loss.logq", BOOL, None, "sampled_softmax, in_batch: subtract log(k q(item)) from "
        "each negative's logit (q: the probability the sampler draws the item)"),
    key("loss.gbce_t", FLOAT, unit(), "gbce: calibration t; beta = 1 + t (k / (V - 1) - 1) "
        "is the positive term's exponent (t = 0: plain BCE over the sampled items)"),
    key("loss.backend", STR, one_of(*BACKEND_CHOICES), "`cutbce` backend of the loss"),
    key("loss.vocab_reduction", STR, one_of("mean", "sum"), "l_t divided by V (mean) or not"),
    key("loss.target_reduction", STR, one_of("sum", "mean"), "softmax_ce, sampled_softmax, "
        "in_batch: a position's terms over its distinct targets added (sum) or averaged (mean)"),
    key("loss.exclude", STR, one_of("none", "window"), "'window': each position's negatives "
        "leave out the items of its training window (passed as `exclude`; targets stay "
        "targets); 'none': every item not a target is a negative"),
    key("loss.pos_weight", FLOAT, above(0), "weight of positive labels (None: 1)",
        none_ok=True),
    key("loss.label_smoothing", FLOAT, fraction(), "labels y (1 - e) + e / 2"),
    key("loss.logit_soft_cap", FLOAT, above(0), "logits become c tanh(x / c) (None: off)",
        none_ok=True),
    key("loss.focal_gamma", FLOAT, at_least(0), "focal exponent (None: no focal factor)",
        none_ok=True),
    key("loss.focal_alpha", FLOAT, unit(), "focal class balance (None: off)", none_ok=True),
    key("loss.one_pass", BOOL, None, "loss and gradients in one tiled pass (None: when "
        "the reduction allows; False: two passes, smaller residuals)", none_ok=True),
    key("eval.split", STR, one_of("validation", "test"), "split evaluated during training"),
    key("eval.filter_seen", BOOL, None, "exclude each user's history from the ranking"),
    key("eval.ks", INTS, at_least(1), "cut-offs of recall, ndcg and hit", sequence="increasing"),
    key("eval.max_batches", INT, at_least(1), "global batches per evaluation (None: all users)",
        none_ok=True),
    key("eval.backend", STR, one_of(*BACKEND_CHOICES), "`cutbce` backend of the ranking"),
    key("compile.num_items", INT, _INT32_IDS, "V that `python -m trainer.compile` (which reads "
        "no data) compiles for (None: its `--num_items` flag is needed)", none_ok=True),
    key("compile.eval_targets", INT, at_least(1), "L of the evaluation batch `trainer.compile` "
        "compiles for (None: `num_targets`)", none_ok=True),
    key("compile.eval_exclude", INT, at_least(1), "E, history ids excluded per user in the "
        "evaluation batch `trainer.compile` compiles for (None: `seq_len`)", none_ok=True),
    key("profile.start_step", INT, at_least(0), "first step of the jax.profiler trace"),
    key("profile.num_steps", INT, at_least(0), "steps traced (0: no trace)"),
)

_INDEX = {k.path: k for k in KEYS}
_SECTIONS = sections_of(KEYS)


class Context(NamedTuple):
  """What the rules check a config against besides itself.

  Attributes:
    device_count: devices the mesh must cover (`jax.device_count()`).
    process_count: processes of the run (`jax.process_count()`).
    process_index: this process (only process 0 prepares data).
    workdir: the run's directory, or None: then the rules that look at files
      (raw data needed because nothing is prepared yet) are skipped.
    slice_count: TPU slices of the run (distinct `slice_index` of the
      devices), or its processes off TPU; what the
      product of `mesh.dcn_shape` must equal.
    memory_bytes: memory of this process's devices together
      (`budget.memory_bytes()`), or None: the steps' activations are not
      bounded by memory (`trainer.compile`, whose compiler reports the fit),
      only by the int32 index limit.
  """

  device_count: int
  process_count: int = 1
  process_index: int = 0
  workdir: str | None = None
  slice_count: int = 1
  memory_bytes: int | None = None


def name(path: str) -> str:
  """How messages show a key: as its override flag is spelled, `config.model.dim`."""
  return "config." + path


PROCESS_PLACEHOLDER = "{process}"


def prepared_folder(prepared_dir: str | None, workdir: str | os.PathLike,
                    process_index: int = 0) -> epath.Path:
  """Where process `process_index` reads the prepared data: `prepared_dir`, else WORKDIR/data.

  `{process}` in `prepared_dir` is replaced by the process index (with
  `data.prepare_per_host`: a copy per process, e.g. several processes on one
  machine). Local paths come back absolute, `gs://...` as given.

  >>> str(prepared_folder("/data/prepared-{process}", "gs://bucket/run", 1))
  '/data/prepared-1'
  >>> str(prepared_folder(None, "gs://bucket/run"))
  'gs://bucket/run/data'
  """
  if prepared_dir is None:
    return paths.as_path(workdir) / "data"
  return paths.as_path(prepared_dir.replace(PROCESS_PLACEHOLDER, str(process_index)))


def token_shards(values: Mapping[str, Any]) -> int:
  """Product of the token axes' sizes (the batch is split into this many shards)."""
  sizes = dict(zip(values["mesh.axis_names"], values["mesh.shape"]))
  return math.prod(sizes[axis] for axis in values["mesh.token_axes"])


def _mesh_text(values) -> str:
  return str(dict(zip(values["mesh.axis_names"], values["mesh.shape"])))


def _mesh_lengths(values, context):
  del context
  if len(values["mesh.shape"]) != len(values["mesh.axis_names"]):
    return f"one size per name of config.mesh.axis_names={tuple(values['mesh.axis_names'])!r}"
  return None


def _mesh_devices(values, context):
  shape = tuple(values["mesh.shape"])
  if math.prod(shape) != context.device_count:
    return (f"sizes whose product is the {context.device_count} devices present "
            f"(jax.device_count()); {shape} covers {math.prod(shape)}")
  return None


def _dcn_shape(values, context):
  dcn = values.get("mesh.dcn_shape")
  if dcn is None:
    return None
  shape, dcn = tuple(values["mesh.shape"]), tuple(dcn)
  if len(dcn) != len(shape):
    return f"one number of slices per size of config.mesh.shape={shape}"
  if any(size % count for size, count in zip(shape, dcn)):
    return f"numbers of slices that divide the sizes of config.mesh.shape={shape}"
  if math.prod(dcn) != context.slice_count:
    return (f"numbers of slices whose product is the {context.slice_count} slices of the "
            f"run (its processes, off TPU); {dcn} covers "
            f"{math.prod(dcn)}")
  return None


def _token_axes_in_mesh(values, context):
  del context
  names = tuple(values["mesh.axis_names"])
  if not set(values["mesh.token_axes"]) <= set(names):
    return f"a non-empty tuple of names of config.mesh.axis_names={names!r}"
  return None


def _vocab_axis_in_mesh(values, context):
  del context
  names = tuple(values["mesh.axis_names"])
  if values["mesh.vocab_axis"] is not None and values["mesh.vocab_axis"] not in names:
    return f"None or a name of config.mesh.axis_names={names!r}"
  return None


def _divides_token_shards(batch_key: str):
  def check_rule(values, context):
    del context
    shards = token_shards(values)
    if values[batch_key] % shards:
      return (f"a multiple of the {shards} shards of the token axes "
              f"{tuple(values['mesh.token_axes'])} (mesh {_mesh_text(values)})")
    return None
  return check_rule


def _divides_processes(batch_key: str):
  def check_rule(values, context):
    if values[batch_key] % context.process_count:
      return f"a multiple of the {context.process_count} processes"
    return None
  return check_rule


def _heads_divide_dim(values, context):
  del context
  if values["model.dim"] % values["model.num_heads"]:
    return f"a multiple of config.model.num_heads={values['model.num_heads']}"
  return None


def _softmax_ce_has_no_variants(values, context):
  del context
  if values["loss.kind"] != "softmax_ce":
    return None
  on = [k for k in ("loss.pos_weight", "loss.logit_soft_cap", "loss.focal_gamma",
                    "loss.focal_alpha")
        if values[k] is not None]
  if on:
    return (f"'bce' to use {', '.join('config.' + k for k in on)} (BCE variants; "
            "the softmax cross-entropy takes only loss.label_smoothing)")
  return None


def _target_mean_is_softmax_ce(values, context):
  del context
  kind = values["loss.kind"]
  if values["loss.target_reduction"] == "mean" and kind not in _SOFTMAX_KINDS:
    return (f"'sum' with config.loss.kind={kind!r} (BCE has one term per item, not one per "
            f"target; 'mean' is for {', '.join(map(repr, _SOFTMAX_KINDS))})")
  return None


_BCE_VARIANTS = ("loss.pos_weight", "loss.logit_soft_cap", "loss.focal_gamma",
                 "loss.focal_alpha")


def _sampled_has_no_variants(values, context):
  del context
  kind = values["loss.kind"]
  if kind not in SAMPLED_KINDS:
    return None
  on = [k for k in _BCE_VARIANTS if values[k] is not None]
  if values["loss.label_smoothing"]:
    on.append("loss.label_smoothing")
  if on:
    return (f"'bce' or 'softmax_ce' to use {', '.join('config.' + k for k in on)} (the "
            "sampled losses take no loss variant)")
  if kind == "in_batch" and values["loss.negatives_per"] == "sequence":
    return ("'sampled_softmax' or 'gbce' to use config.loss.negatives_per='sequence' (in_batch "
            "draws the batch's target slots: per 'batch' or per 'position')")
  if values["loss.exclude"] != "none" and (kind == "in_batch"
                                           or values["loss.negatives_per"] != "sequence"):
    return (f"'bce', 'softmax_ce', or 'sampled_softmax' or 'gbce' with "
            f"config.loss.negatives_per='sequence' to use config.loss.exclude="
            f"{values['loss.exclude']!r} (the other sampled draws mask only negatives equal "
            "to a target)")
  if values["loss.vocab_reduction"] != "sum":
    return ("'bce' or 'softmax_ce' to use config.loss.vocab_reduction='mean' (a sampled "
            "loss sums over its sampled items)")
  return None


def _num_negatives_fits(values, context):
  del context
  if values["loss.num_negatives"] is not None:
    return None
  if values["loss.kind"] in ("sampled_softmax", "gbce"):
    return f"an integer >= 1 with config.loss.kind={values['loss.kind']!r}"
  if values["loss.kind"] == "in_batch" and values["loss.negatives_per"] != "batch":
    return ("an integer >= 1 with config.loss.negatives_per='position' (None, every "
            "target slot of the batch, is one set shared by the batch)")
  return None


def _sampler_draws_from_catalog(values, context):
  del context
  if values["loss.sampler"] == "popularity" and values["loss.kind"] not in (
      "sampled_softmax", "gbce"):
    return (f"'uniform' with config.loss.kind={values['loss.kind']!r} (popularity sampling "
            "is for 'sampled_softmax' and 'gbce'; in_batch draws the batch's targets)")
  return None


def _logq_is_for_softmax(values, context):
  del context
  if values["loss.logq"] and values["loss.kind"] not in ("sampled_softmax", "in_batch"):
    return (f"False with config.loss.kind={values['loss.kind']!r} (the logQ correction is "
            "for 'sampled_softmax' and 'in_batch')")
  return None


def _options(values, section: str) -> dict[str, Any]:
  """The `data.<section>.*` values as the loader's (or split's) keyword options."""
  prefix = f"data.{section}."
  return {path[len(prefix):]: v for path, v in values.items() if path.startswith(prefix)}


def prepared_differences(values: Mapping[str, Any], workdir: str,
                         process_index: int = 0) -> list[str]:
  """How the run's data folder differs from the flat config `values` ([]: use it as is).

  See `trainer.data.prepare.prepared_mismatch`.
  """
  folder = prepared_folder(values.get("data.prepared_dir"), workdir, process_index)
  return prepare.prepared_mismatch(
      folder, dataset=values["data.dataset"], source_options=_options(values, "source_options"),
      min_item_count=values.get("data.min_item_count"), split=values["data.split"],
      split_options=_options(values, "split_options"),
      num_shards=values.get("data.prepare_shards") or 1)


def _prepares_here(values, context) -> bool:
  """Whether this process prepares data (process 0, or each with `data.prepare_per_host`)
  and the workdir is known (else files are not looked at)."""
  return context.workdir is not None and (context.process_index == 0
                                          or bool(values.get("data.prepare_per_host")))


def _why_raw_data_is_read(values, context) -> str | None:
  """None when the prepared data is used as it is (or files are not looked at), else why not."""
  if not _prepares_here(values, context):
    return None
  folder = prepared_folder(values.get("data.prepared_dir"), context.workdir,
                           context.process_index)
  if not prepare.has_manifest(folder):
    return f"nothing is prepared in {folder} yet, so the raw files are read"
  if prepared_differences(values, context.workdir, context.process_index):
    return f"the data in {folder} was prepared with other options, so the raw files are read"
  return None  # Prepared already: the raw files are not read.


def _yambda_folder_exists(values, context):
  if values["data.dataset"] != "yambda":
    return None
  why = _why_raw_data_is_read(values, context)
  path = os.path.expanduser(values["data.source_options.path"])
  if why is not None and not os.path.isdir(path):
    return f"an existing folder holding the Yambda parquet files ({why})"
  return None


def _ciao_file_exists(values, context):
  if values["data.dataset"] != "ciao":
    return None
  why = _why_raw_data_is_read(values, context)
  if why is None:
    return None
  try:
    ciao.resolve_ciao(values["data.source_options.path"])
  except FileNotFoundError as error:
    return f"Ciao's {ciao.FILE_NAME} or its folder ({why}): {error}"
  return None


def _files_path_matches(values, context):
  if values["data.dataset"] != "files":
    return None
  why = _why_raw_data_is_read(values, context)
  if why is None:
    return None
  try:
    files.resolve_files(values["data.source_options.path"])
  except (FileNotFoundError, ValueError) as error:
    return f"a file, folder or glob of data files ({why}): {error}"
  return None


def _files_filter_parses(values, context):
  del context
  text = values.get("data.source_options.filter")
  if values["data.dataset"] != "files" or text is None:
    return None
  try:
    files.parse_filter(text)
  except ValueError as error:
    return "None or a filter: " + str(error).removeprefix(f"filter {text!r}: ")
  return None


def _prepared_dir_matches(values, context):
  if values.get("data.prepared_dir") is None or not _prepares_here(values, context):
    return None
  folder = prepared_folder(values["data.prepared_dir"], context.workdir, context.process_index)
  if not prepare.has_manifest(folder):
    return None  # Prepared there by this run.
  differences = prepared_differences(values, context.workdir, context.process_index)
  if differences:
    return ("a folder holding nothing yet or this data prepared with these options; it was "
            f"prepared with other options ({'; '.join(differences)}): use another folder, "
            "delete it, or leave config.data.prepared_dir unset (WORKDIR/data)")
  return None


def _memory_limit_parses(values, context):
  del context
  text = values.get("data.prepare_memory_limit")
  if text is None:
    return None
  try:
    engine.parse_memory_limit(text)
  except ValueError:
    return "None or a size of at least 64MiB such as '4GB' or '512MiB'"
  return None


def _per_host_folder_is_local(values, context):
  del context
  folder = values.get("data.prepared_dir")
  if values["data.prepare_per_host"] and (folder is None or paths.is_remote(folder)):
    return ("False, or True with config.data.prepared_dir set to a local folder (each host's "
            f"own disk; {PROCESS_PLACEHOLDER} in it for processes sharing a disk), not "
            f"{'WORKDIR/data' if folder is None else repr(folder)}: copies per host must not "
            "share one folder")
  return None


def _placeholder_needs_per_host(values, context):
  del context
  folder = values.get("data.prepared_dir")
  if folder is not None and PROCESS_PLACEHOLDER in folder and not values["data.prepare_per_host"]:
    return (f"a folder without {PROCESS_PLACEHOLDER}, unless config.data.prepare_per_host=True: "
            "process 0 alone prepares, into one folder that every process reads")
  return None


def metric_names(ks) -> tuple[str, ...]:
  """The names `cutbce.rank_metrics` returns for cut-offs `ks` (all higher-better)."""
  return tuple(f"{m}@{k}" for m in ("recall", "ndcg", "hit") for k in ks) + ("mrr",)


def _best_metric_is_evaluated(values, context):
  del context
  metric = values.get("checkpoint.best_metric")
  if metric is not None and metric not in metric_names(values["eval.ks"]):
    return f"None or one of {', '.join(map(repr, metric_names(values['eval.ks'])))}"
  return None


def _patience_has_a_metric(values, context):
  del context
  if values.get("checkpoint.patience") is not None and values.get("checkpoint.best_metric") is None:
    return "None while `checkpoint.best_metric` is None (early stopping watches that metric)"
  return None


_MODEL_KEYS = ("model.dim", "model.num_layers", "model.num_heads", "model.mlp_dim", "model.dtype")


def _step_fits(batch_key: str, blamed: str, *, training: bool):
  """A rule: the step over `[batch_key, seq_len]` fits (`budget`), `blamed` to blame."""
  def check_rule(values, context):
    local_devices = max(1, context.device_count // max(1, context.process_count))
    found = budget.check_sizes(
        budget.Model.of(values), sizes={"batch": values[batch_key], "seq_len": values["seq_len"]},
        blame=("batch", "seq_len") if training else ("batch",),
        targets=values["num_targets"] if training else 1, shards=token_shards(values),
        local_devices=local_devices, memory=context.memory_bytes, training=training)
    if found is not None and found[0] == blamed:
      return found[1]
    return None
  return check_rule


def _negatives_fit(values, context):
  """k sampled negatives per set fit the step (`budget.check_negatives`)."""
  k = values["loss.num_negatives"]
  if values["loss.kind"] not in SAMPLED_KINDS or k is None:
    return None
  local_devices = max(1, context.device_count // max(1, context.process_count))
  shards = token_shards(values)
  return budget.check_negatives(
      budget.Model.of(values), tokens=-(-values["batch_size"] // shards) * values["seq_len"],
      global_tokens=values["batch_size"] * values["seq_len"], num_negatives=k,
      per_position=values["loss.negatives_per"] == "position", local_devices=local_devices,
      memory=context.memory_bytes)


def _model_fits(values, context):
  """The model's state (no items yet: the catalog is not known) fits this host's devices."""
  local_devices = max(1, context.device_count // max(1, context.process_count))
  why = budget.check_state(budget.Model.of(values), num_items=0, seq_len=values["seq_len"],
                           vocab_shards=1, local_devices=local_devices,
                           memory=context.memory_bytes)
  return None if why is None else f"a model whose state fits this host: {why}"


RULES: tuple[Rule, ...] = (
    Rule(name="memory_limit_parses", keys=("data.prepare_memory_limit",),
         check=_memory_limit_parses,
         doc="`data.prepare_memory_limit` is None or a size such as '4GB'"),
    Rule(name="mesh_lengths", keys=("mesh.shape", "mesh.axis_names"), check=_mesh_lengths,
         doc="one size per axis name"),
    Rule(name="mesh_covers_devices", keys=("mesh.shape",), check=_mesh_devices,
         doc="the product of the sizes is `jax.device_count()`"),
    Rule(name="dcn_shape_fits", keys=("mesh.dcn_shape", "mesh.shape"), check=_dcn_shape,
         doc="`mesh.dcn_shape` divides `mesh.shape` and covers the run's slices"),
    Rule(name="token_axes_in_mesh", keys=("mesh.token_axes", "mesh.axis_names"),
         check=_token_axes_in_mesh, doc="every token axis is a mesh axis"),
    Rule(name="vocab_axis_in_mesh", keys=("mesh.vocab_axis", "mesh.axis_names"),
         check=_vocab_axis_in_mesh, doc="the vocab axis is None or a mesh axis"),
    Rule(name="batch_divides_token_shards", keys=("batch_size", "mesh.shape", "mesh.token_axes"),
         check=_divides_token_shards("batch_size"),
         doc="`batch_size` is a multiple of the product of the token axes' sizes"),
    Rule(name="eval_batch_divides_token_shards",
         keys=("eval_batch_size", "mesh.shape", "mesh.token_axes"),
         check=_divides_token_shards("eval_batch_size"),
         doc="`eval_batch_size` is a multiple of the product of the token axes' sizes"),
    Rule(name="batch_divides_processes", keys=("batch_size",),
         check=_divides_processes("batch_size"),
         doc="`batch_size` is a multiple of `jax.process_count()`"),
    Rule(name="eval_batch_divides_processes", keys=("eval_batch_size",),
         check=_divides_processes("eval_batch_size"),
         doc="`eval_batch_size` is a multiple of `jax.process_count()`"),
    Rule(name="heads_divide_dim", keys=("model.dim", "model.num_heads"),
         check=_heads_divide_dim, doc="`model.dim` is a multiple of `model.num_heads`"),
    Rule(name="yambda_folder_exists",
         keys=("data.source_options.path", "data.dataset", "data.prepared_dir"),
         check=_yambda_folder_exists,
         doc="for Yambda not yet prepared in the data folder: the parquet folder exists "
         "(checked by each process that prepares, when the workdir is known)"),
    Rule(name="ciao_file_exists",
         keys=("data.source_options.path", "data.dataset", "data.prepared_dir"),
         check=_ciao_file_exists,
         doc="for Ciao not yet prepared in the data folder: its .mat file exists "
         "(checked by each process that prepares, when the workdir is known)"),
    Rule(name="files_path_matches",
         keys=("data.source_options.path", "data.dataset", "data.prepared_dir"),
         check=_files_path_matches,
         doc="for files not yet prepared in the data folder: the path names at least one "
         "data file (checked by each process that prepares, when the workdir is known)"),
    Rule(name="files_filter_parses", keys=("data.source_options.filter", "data.dataset"),
         check=_files_filter_parses, doc="the files filter is '<column> <op> <value>'"),
    Rule(name="prepared_dir_matches",
         keys=("data.prepared_dir", "data.dataset", "data.min_item_count", "data.split"),
         check=_prepared_dir_matches,
         doc="an explicit `data.prepared_dir` that holds a prepared dataset holds this one, "
         "prepared with these options (checked by each process that prepares, when the "
         "workdir is known)"),
    Rule(name="per_host_folder_is_local", keys=("data.prepare_per_host", "data.prepared_dir"),
         check=_per_host_folder_is_local,
         doc="`data.prepare_per_host` needs `data.prepared_dir` set to a local folder (not "
         "WORKDIR/data, not gs://)"),
    Rule(name="process_placeholder_needs_per_host",
         keys=("data.prepared_dir", "data.prepare_per_host"),
         check=_placeholder_needs_per_host,
         doc="`{process}` in `data.prepared_dir` only with `data.prepare_per_host`"),
    Rule(name="target_mean_is_softmax_ce", keys=("loss.target_reduction", "loss.kind"),
         check=_target_mean_is_softmax_ce,
         doc="`loss.target_reduction=\"mean\"` only with a softmax loss (`loss.kind` "
         "'softmax_ce', 'sampled_softmax' or 'in_batch')"),
    Rule(name="sampled_has_no_variants",
         keys=("loss.kind", "loss.pos_weight", "loss.label_smoothing", "loss.logit_soft_cap",
               "loss.focal_gamma", "loss.focal_alpha", "loss.exclude", "loss.vocab_reduction",
               "loss.negatives_per"),
         check=_sampled_has_no_variants,
         doc="the sampled kinds take no loss variant, `loss.exclude=\"none\"` (except "
         "'sampled_softmax' and 'gbce' with `loss.negatives_per=\"sequence\"`) and "
         "`loss.vocab_reduction=\"sum\"`"),
    Rule(name="num_negatives_fits", keys=("loss.num_negatives", "loss.kind",
                                          "loss.negatives_per"),
         check=_num_negatives_fits,
         doc="`loss.num_negatives=None` (every target slot) only with `loss.kind=\"in_batch\"` "
         "and `loss.negatives_per=\"batch\"`"),
    Rule(name="sampler_draws_from_catalog", keys=("loss.sampler", "loss.kind"),
         check=_sampler_draws_from_catalog,
         doc="`loss.sampler=\"popularity\"` only with `loss.kind` 'sampled_softmax' or 'gbce'"),
    Rule(name="logq_is_for_softmax", keys=("loss.logq", "loss.kind"),
         check=_logq_is_for_softmax,
         doc="`loss.logq=True` only with `loss.kind` 'sampled_softmax' or 'in_batch'"),
    Rule(name="softmax_ce_has_no_variants",
         keys=("loss.kind", "loss.pos_weight", "loss.label_smoothing", "loss.logit_soft_cap",
               "loss.focal_gamma", "loss.focal_alpha"),
         check=_softmax_ce_has_no_variants,
         doc="`loss.kind=\"softmax_ce\"` takes no BCE variant but label smoothing"),
    Rule(name="best_metric_is_evaluated", keys=("checkpoint.best_metric", "eval.ks"),
         check=_best_metric_is_evaluated,
         doc="`checkpoint.best_metric` is a metric the evaluation computes (k in `eval.ks`)"),
    Rule(name="patience_has_a_metric", keys=("checkpoint.patience", "checkpoint.best_metric"),
         check=_patience_has_a_metric,
         doc="`checkpoint.patience` needs `checkpoint.best_metric` (the metric it watches)"),
    Rule(name="seq_len_fits", keys=("seq_len", "batch_size", "num_targets") + _MODEL_KEYS,
         check=_step_fits("batch_size", "seq_len", training=True),
         doc="the training step fits (`trainer/config/budget.py`): its `batch_size` x "
         "`seq_len` x `num_targets` ids at most 2^31 - 1 (int32 indices), and a lower bound "
         "of its activations within this host's device memory; names `seq_len` when it is "
         "the further over its limit"),
    Rule(name="batch_fits", keys=("batch_size", "seq_len", "num_targets") + _MODEL_KEYS,
         check=_step_fits("batch_size", "batch", training=True),
         doc="the same bound, naming `batch_size` when it is the further over its limit"),
    Rule(name="negatives_fit",
         keys=("loss.num_negatives", "loss.kind", "loss.negatives_per", "batch_size", "seq_len",
               "model.dim"),
         check=_negatives_fit,
         doc="a sampled loss's `batch_size` x `seq_len` x `num_negatives` logits at most "
         "2^31 - 1 (int32 indices), and its logits and gathered rows within this host's "
         "device memory (`trainer/config/budget.py`)"),
    Rule(name="model_fits", keys=("model.dim", "seq_len") + _MODEL_KEYS[1:],
         check=_model_fits,
         doc="the model's parameters, gradients and AdamW moments (16 bytes per float32 "
         "parameter, `trainer/config/budget.py`) fit this host's device memory before any "
         "item is counted; checked again with the catalog once the data is prepared, before "
         "anything is allocated"),
    Rule(name="eval_batch_fits", keys=("eval_batch_size", "seq_len") + _MODEL_KEYS,
         check=_step_fits("eval_batch_size", "batch", training=False),
         doc="the evaluation step (forward only, one block's activations at a time) fits "
         "the same way"),
)


def check(config, context: Context) -> None:
  """Checks every key of `config` and every rule; raises on the first problem.

  Args:
    config: a ConfigDict of `configs/*.py` (or any nested mapping).
    context: the devices, processes and workdir the run will have.

  Raises:
    ConfigError: one line, `config.<key>=<value>: <what is allowed>`.
  """
  schema.check(flatten(config, _SECTIONS), KEYS, RULES, context, name=name)


# --------------------------------------------------------------------------- #
# Command-line overrides: mistakes found while absl parses `--config.key=...`  #
# --------------------------------------------------------------------------- #


def overrides(argv: Sequence[str]) -> list[tuple[str, str]]:
  """`(path, value text)` of every `--config.<path>=<value>` in `argv`."""
  found = []
  args = list(argv[1:])
  for i, arg in enumerate(args):
    for prefix, negated in (("--config.", False), ("--noconfig.", True)):
      if arg.startswith(prefix):
        path, equals, value = arg[len(prefix):].partition("=")
        if not equals:
          value = "false" if negated else (args[i + 1] if i + 1 < len(args) and
                                           not args[i + 1].startswith("-") else "true")
        found.append((path, value))
  return found


def rewrite_overrides(argv: Sequence[str]) -> tuple[list[str], list[str]]:
  """Overrides as the user means them, where ml_collections would read them otherwise.

  * `--config.<key>=None` for a key whose documented value may be None
    (`loss.num_negatives`, `max_checkpoints`, `loss.pos_weight`, ...): the
    flag parser takes "None" as text of the key's type and refuses it, so it
    is taken out of `argv` and returned, to be set with `set_nones` once the
    config is loaded.
  * a tuple of names written bare (`--config.mesh.axis_names=(data,model)`,
    `data,model`): ml_collections reads a string that is not a Python literal
    as one name; it is rewritten as the literal `('data', 'model')`.

  Returns:
    `(argv with those rewritten, the paths to set to None)`.
  """
  rewritten, nones = [argv[0]], []
  for arg in argv[1:]:
    path, equals, value = arg[len("--config."):].partition("=")
    k = _INDEX.get(path) if arg.startswith("--config.") and equals else None
    if k is not None and value == "None" and k.none_ok:
      nones.append(path)
      continue
    if k is not None and k.type == schema.STRS and not _is_literal_sequence(value):
      arg = f"--config.{path}={tuple(schema.from_text(k, value))!r}"
    rewritten.append(arg)
  return rewritten, nones


def _is_literal_sequence(text: str) -> bool:
  import ast  # pylint: disable=import-outside-toplevel
  try:
    return isinstance(ast.literal_eval(text), (tuple, list))
  except (ValueError, SyntaxError):
    return False


def set_nones(config, nones: Sequence[str]) -> None:
  """Sets each dotted path of `nones` (from `rewrite_overrides`) to None in `config`."""
  for path in nones:
    *parents, leaf = path.split(".")
    section = config
    for part in parents:
      section = getattr(section, part)
    setattr(section, leaf, None)


def check_overrides(argv: Sequence[str]) -> None:
  """Rejects unknown override keys and a missing config file, before absl parses.

  Raises:
    ConfigError: `config.<key>=<value>: unknown key; config.<section> holds ...`.
  """
  for index, arg in enumerate(argv[1:]):
    if arg == "--config" and index + 2 < len(argv):
      arg = "--config=" + argv[index + 2]
    if arg.startswith("--config="):
      file = arg[len("--config="):]
      if not os.path.isfile(file) and not os.path.isfile(file.split(":")[0]):
        raise ConfigError(f"--config={file!r}: an existing config file (configs/*.py)")
  for path, value in overrides(argv):
    if path not in _INDEX:
      what = "a section, not a value" if path in _SECTIONS else "unknown key"
      known = (source_options_by_dataset() if path.startswith("data.source_options.")
               else schema.known_keys(path, KEYS, name=name))
      raise ConfigError(f"{name(path)}={value!r}: {what}; {known}")
  _add_option_keys_when_parsed(argv)


def source_options_by_dataset() -> str:
  """`config.data.source_options holds, by config.data.dataset: 'ml-1m': cache_dir; ...`."""
  by_dataset: dict[str, list[str]] = {dataset: [] for dataset in sources.SOURCE_NAMES}
  for k in KEYS:
    if k.path.startswith("data.source_options."):
      for dataset in k.when[1]:
        by_dataset[dataset].append(k.path.rsplit(".", 1)[1])
  listed = "; ".join(f"{d!r}: {', '.join(names) or 'nothing'}" for d, names in by_dataset.items())
  return f"{name('data.source_options')} holds, by {name('data.dataset')}: {listed}"


# Placeholder types of the option keys an override may add (see `add_option_keys`).
_PLACEHOLDER_TYPES = {INT: int, FLOAT: float, STR: str, BOOL: bool}


def add_option_keys(config, paths: Sequence[str]) -> list[str]:
  """Adds the option keys among `paths` that `config` lacks, so an override can set them.

  `data.source_options` and `data.split_options` hold only the options the
  config file sets (`configs/ml1m.py` sets none), and a locked ConfigDict
  takes no new key; `--config.data.source_options.cache_dir=DIR` could not
  be given. Each described option key (one whose `when` names a dataset or
  split) of `paths` missing from `config` is added, unset (a placeholder of
  the key's type); the override then sets it and `check` checks it.

  Args:
    config: the ConfigDict just loaded from the config file (locked or not).
    paths: dotted key paths, as `overrides` returns them.

  Returns:
    The paths added.
  """
  from ml_collections import config_dict  # pylint: disable=import-outside-toplevel
  added = []
  for path in paths:
    k = _INDEX.get(path)
    if k is None or k.when is None or k.type not in _PLACEHOLDER_TYPES:
      continue
    *parents, leaf = path.split(".")
    holder = config
    for part in parents:
      holder = getattr(holder, part, None)
    if not isinstance(holder, config_dict.ConfigDict) or leaf in holder:
      continue
    with holder.unlocked():
      holder[leaf] = config_dict.placeholder(_PLACEHOLDER_TYPES[k.type])
    added.append(path)
  return added


def _add_option_keys_when_parsed(argv: Sequence[str]) -> None:
  """Makes absl's `--config` flag run `add_option_keys` on the loaded config.

  The config file is loaded inside `flags.FLAGS(argv)`, and the overrides are
  applied right after; this wraps the `--config` flag's file parser (once) so
  that the keys the overrides of `argv` name exist by then. Without a
  `--config` flag defined (no `trainer.main`), nothing happens.
  """
  paths = [path for path, _ in overrides(argv) if path in _INDEX and _INDEX[path].when]
  from absl import flags  # pylint: disable=import-outside-toplevel
  if not paths or "config" not in flags.FLAGS:
    return
  parser = flags.FLAGS["config"].parser
  load = getattr(parser, "_load_config_file", parser.parse)

  def parse(argument):
    config = load(argument)
    add_option_keys(config, paths)
    return config

  parser._load_config_file = load  # pylint: disable=protected-access
  parser.parse = parse


def explain_flag_error(error: BaseException, argv: Sequence[str]) -> ConfigError | None:
  """The `bad config:` line of an error absl or ml_collections raised on an override.

  Args:
    error: what parsing the flags raised: an absl `flags.Error` naming the
      flag (a value of the wrong type), or the AttributeError of a locked
      config that lacks the key.
    argv: the command line.

  Returns:
    A ConfigError naming the key, the value and what is allowed; None when
    the error is not about a `--config.` override.
  """
  message = str(error)
  for path, value in overrides(argv):
    k = _INDEX.get(path)
    if message.startswith((f"flag --config.{path}=", f"flag --noconfig.{path}")):
      allowed = k.describe() if k else message
      return ConfigError(f"{name(path)}={value!r}: {allowed}")
    if isinstance(error, (AttributeError, KeyError)) and repr(path.rsplit(".", 1)[-1]) in message:
      return ConfigError(
          f"{name(path)}={value!r}: this config file does not set the key, so the command "
          f"line cannot add it (the config is locked); set it in the config file")
  return None


# --------------------------------------------------------------------------- #
# The commands after training: trainer.evaluate, trainer.recommend,           #
# trainer.export (`trainer/commands/cli.py` parses and checks their flags)        #
# --------------------------------------------------------------------------- #


def flag_name(path: str) -> str:
  """How messages show a command's flag: `--top_k`."""
  return "--" + path


def _unreachable(path: str) -> str | None:
  """Why a `gs://` path cannot be reached here (its package missing), or None."""
  try:
    paths.check_remote(path)
  except paths.WorkdirError as error:
    return str(error).split(": ", 1)[-1]
  return None


def _workdir_holds_run(values, context):
  del context
  unreachable = _unreachable(values["workdir"])
  if unreachable is not None:
    return f"an existing run directory ({unreachable})"
  if not epath.Path(values["workdir"], "config.json").exists():
    return "an existing run directory holding config.json (written by python -m trainer.main)"
  return None


def _users_file_exists(values, context):
  del context
  if values.get("users") is not None and _unreachable(values["users"]) is not None:
    return f"None or an existing file of raw user ids ({_unreachable(values['users'])})"
  if values.get("users") is not None and not epath.Path(values["users"]).is_file():
    return "None or an existing file of raw user ids, one per line"
  return None


_WORKDIR_FLAG = key("workdir", STR, None, "the training run's directory (holds config.json)")
_CHECKPOINT_FLAG = key("checkpoint", STR, one_of("best", "latest"),
                       "the best checkpoint by `checkpoint.best_metric` (the latest, with a "
                       "notice, when none is best) or the latest")
_STEP_FLAG = key("step", INT, at_least(0), "the checkpoint of this step (overrides --checkpoint)",
                 none_ok=True, required=False)

# Every flag of each command: type, allowed values, meaning.
COMMAND_FLAGS: dict[str, tuple[schema.Key, ...]] = {
    "evaluate": (
        _WORKDIR_FLAG,
        key("split", STR, one_of("validation", "test"), "the split evaluated (None: both)",
            none_ok=True, required=False),
        _CHECKPOINT_FLAG, _STEP_FLAG),
    "recommend": (
        _WORKDIR_FLAG,
        key("top_k", INT, at_least(1), "K: items recommended per user"),
        key("out", STR, None, "output file: one JSON line per user"),
        key("users", STR, None, "file of raw user ids, one per line (None: every user)",
            none_ok=True, required=False),
        key("include_seen", BOOL, None, "also recommend items of the user's history"),
        _CHECKPOINT_FLAG, _STEP_FLAG,
        key("batch_size", INT, at_least(1), "users per step (None: the run's "
            "`eval_batch_size`; rounded up to a multiple of the token shards, at most the users "
            "so rounded; within the memory of the host's devices)", none_ok=True,
            required=False)),
    "export": (
        _WORKDIR_FLAG,
        key("out", STR, None, "output folder"),
        _CHECKPOINT_FLAG, _STEP_FLAG),
}
COMMAND_FLAG_DEFAULTS: dict[str, Any] = {
    "split": None, "checkpoint": "best", "step": None, "users": None, "include_seen": False,
    "batch_size": None}
COMMAND_RULES: tuple[Rule, ...] = (
    Rule(name="workdir_holds_run", keys=("workdir",), check=_workdir_holds_run,
         doc="`--workdir` holds the `config.json` a training run writes at start"),
    Rule(name="users_file_exists", keys=("users",), check=_users_file_exists,
         doc="`--users`, when given, is an existing file"),
)


# --------------------------------------------------------------------------- #
# Docs                                                                         #
# --------------------------------------------------------------------------- #

DOC_BEGIN = "<!-- config keys: generated by `python -m trainer.config.keys`; do not edit -->"
DOC_END = "<!-- end of config keys -->"


def markdown(defaults: Mapping[str, Any] | None = None) -> str:
  """The docs block: the keys table (defaults of `configs/base.py`) and the rules table."""
  commands = []
  for command, keys in COMMAND_FLAGS.items():
    commands += [f"Flags of `python -m trainer.{command}`:", "",
                 schema.markdown_table(keys, COMMAND_FLAG_DEFAULTS, name=flag_name), ""]
  return "\n".join([DOC_BEGIN, "", schema.markdown_table(KEYS, defaults, name=name), "",
                    "Rules between keys:", "", schema.rules_table(RULES, name=name), "",
                    *commands, "Rules between flags:", "",
                    schema.rules_table(COMMAND_RULES, name=flag_name), "", DOC_END])


def base_defaults() -> dict[str, Any]:
  """The flat values of `configs/base.py` (run from the repository root)."""
  from configs import base  # pylint: disable=import-outside-toplevel
  return flatten(base.get_config(), _SECTIONS)


def replace_block(text: str, block: str) -> str:
  """`text` with its generated block (DOC_BEGIN ... DOC_END) replaced by `block`."""
  start, end = text.index(DOC_BEGIN), text.index(DOC_END) + len(DOC_END)
  return text[:start] + block + text[end:]


def main(argv: Sequence[str]) -> int:
  """Prints the docs block, or with `--update FILE` rewrites it in FILE."""
  block = markdown(base_defaults())
  if len(argv) == 3 and argv[1] == "--update":
    with open(argv[2], encoding="utf-8") as file:
      text = file.read()
    with open(argv[2], "w", encoding="utf-8") as file:
      file.write(replace_block(text, block))
    return 0
  print(block)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
