"""SASRec quality on MovieLens-1M: train, collect the metrics, compare losses.

Protocol (the published SASRec numbers' one): leave-one-out (validation = the
second to last item of each user, test = the last), the held-out item ranked
among all 3,416 items with the user's history excluded (filter-seen), every
user. Metrics come from the trainer's own evaluation (`cutbce.target_ranks`
+ `cutbce.rank_metrics`); one target per user, so HR@k = recall@k.

    # train (8 simulated CPU devices), then write docs/results/ml1m_metrics.json
    python benchmarks/ml1m_quality.py train --config configs/ml1m.py --workdir runs/ml1m \
        [--set optimizer.learning_rate=2e-3 ...]

    # one run per seed (each resumable), then per-seed and mean metrics with
    # their spread, and the validation curves
    python benchmarks/ml1m_quality.py seeds --config configs/ml1m.py --workdir runs/ml1m_seeds \
        --seeds 0 1 2 [--set ...] --out docs/results/ml1m_metrics.json

    # seeds trained elsewhere (their `train` reports) -> the same per-seed and mean JSON
    python benchmarks/ml1m_quality.py summarize runs/a/seed_0.json runs/b/seed_1.json ... \
        --out docs/results/ml1m_quality/recipe.json

    # the same JSON from a finished trainer workdir (same --config / --set as its run)
    python benchmarks/ml1m_quality.py collect --config configs/ml1m.py --workdir runs/ml1m

    # the per-step training losses of two runs that differ only in loss.backend
    python benchmarks/ml1m_quality.py compare --cutbce runs/a --dense runs/b

The JSON holds test `hr@10`, `ndcg@10`, `mrr` (and every other metric of both
splits), the config, the step count, the wall time, a most-popular baseline
computed here with the same protocol (items ranked by their number of
training interactions, the user's history excluded), and the published
figures for context.
"""

from __future__ import annotations

import os

_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"
if _DEVICE_FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _DEVICE_FLAG).strip()

import argparse  # noqa: E402
import ast  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import cutbce  # noqa: E402

# Published SASRec-family results on ML-1M, leave-one-out, full-catalog ranking,
# seen items filtered (as quoted in issue 13).
PUBLISHED = {
    "HSTU-large, sampled softmax (d=50, 8 blocks, N=200)": {"ndcg@10": 0.1893, "hr@10": 0.3294},
    "SASRec+ with 3,000 sampled negatives, CE (d=64, 2 blocks, N=200)": {
        "ndcg@10": 0.1857, "hr@10": 0.3159},
    "SASRec+ full softmax CE": {"ndcg@10": 0.1821, "hr@10": 0.3152},
    "gSASRec, gBCE with 256 negatives (d=128, N=200)": {"ndcg@10": 0.1726, "hr@10": 0.3003},
    "SASRec, sampled softmax": {"ndcg@10": 0.1603, "hr@10": 0.2853},
    "SASRec, BCE with 1 negative": {"ndcg@10": "0.126-0.134", "hr@10": "0.239-0.250"},
}


def load_config(path: str, overrides: list[str]):
  """The config of a config file with `key.sub=value` overrides (Python literals)."""
  spec = importlib.util.spec_from_file_location("experiment_config", ROOT / path
                                                if not os.path.isabs(path) else path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  config = module.get_config()
  for item in overrides or ():
    key, _, text = item.partition("=")
    try:
      value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
      value = text
    node = config
    *parents, leaf = key.split(".")
    for name in parents:
      node = node[name]
    node[leaf] = value
  return config


def _prepared_dir(config, workdir: str) -> str:
  return config.data.prepared_dir or os.path.join(workdir, "data")


def popularity_baseline(prepared_dir: str, ks=(10, 50, 100)) -> dict:
  """Most-popular ranking, filter-seen, leave-one-out: metrics per split.

  Score of an item = its number of training interactions (validation and test
  items not counted). Rank of the held-out item = 1 + the number of other
  items outside the user's history with a score at least as large: ties count
  against the target, as in `cutbce.target_ranks` (so equal counts never
  flatter the baseline).
  """
  from trainer import data as data_lib  # pylint: disable=import-outside-toplevel
  data = data_lib.load_prepared(prepared_dir)
  items, offsets, train_lengths = (np.asarray(data.items), np.asarray(data.offsets),
                                   np.asarray(data.train_lengths))
  num_items = data.num_items
  train_mask = np.arange(items.shape[0]) < np.repeat(offsets[:-1] + train_lengths,
                                                     np.diff(offsets))
  counts = np.bincount(items[train_mask], minlength=num_items).astype(np.float64)
  out = {}
  for split in ("validation", "test"):
    ranks = []
    for user, history_length, start, _ in np.asarray(data.examples(split)):
      base = offsets[user]
      target = items[base + start]
      allowed = np.ones(num_items, bool)
      allowed[items[base:base + history_length]] = False
      allowed[target] = False  # the others only
      ranks.append(1 + int(np.sum(allowed & (counts >= counts[target]))))
    metrics = cutbce.rank_metrics(np.asarray(ranks, np.int32)[:, None], ks=ks)
    out[split] = {k: float(v) for k, v in jax.device_get(metrics).items()}
  return out


def read_metrics(workdir: str) -> list[dict]:
  """The run's metrics.jsonl records (a torn last line skipped, with a warning)."""
  from trainer import logs  # pylint: disable=import-outside-toplevel
  return logs.read_metrics(workdir)


def final_evals(records: list[dict]) -> tuple[int, dict]:
  """Step and metrics of the final evaluation of each split.

  When the run kept a best checkpoint other than the last (kinds "best/<split>",
  by validation `checkpoint.best_metric`), its metrics are the result, as a
  user of the run would take them (`python -m trainer.evaluate` reads the best
  one); otherwise the last step's.
  """
  evals, best = {}, {}
  step = None
  for record in records:
    if record["kind"].startswith("eval/"):
      evals[record["kind"][5:]] = record
      step = record["step"]
    elif record["kind"].startswith("best/"):
      best[record["kind"][5:]] = record
  if "test" in best:
    return int(best["test"]["checkpoint_step"]), best
  return step, evals


def validation_curve(records: list[dict]) -> list[dict]:
  """Validation NDCG@10 and HR@10 by step (the newest record of a step counts once)."""
  by_step = {r["step"]: r for r in records if r["kind"] == "eval/validation"}
  return [{"step": step, "ndcg@10": r["ndcg@10"], "hit@10": r["hit@10"]}
          for step, r in sorted(by_step.items())]


def finished(workdir: str, train_steps: int) -> bool:
  """Whether `workdir` holds a run that reached `train_steps`, or stopped early
  (`checkpoint.patience`), and evaluated the test split there."""
  if not (pathlib.Path(workdir) / "metrics.jsonl").exists():
    return False
  records = read_metrics(workdir)
  ends = {train_steps} | {r["step"] for r in records if r["kind"] == "early_stop"}
  return any(r["kind"] == "eval/test" and r["step"] in ends for r in records)


def train_time_from_log(records: list[dict]) -> float:
  """Training seconds implied by the logged rates (evaluation time excluded)."""
  seconds, last = 0.0, 0
  for record in records:
    if record["kind"] == "train" and record.get("steps_per_second"):
      seconds += (record["step"] - last) / record["steps_per_second"]
      last = record["step"]
  return seconds


def write_report(config, workdir: str, out: str, *, wall_s: float | None, command: str):
  records = read_metrics(workdir)
  step, evals = final_evals(records)
  if "test" not in evals:
    raise SystemExit(f"{workdir}/metrics.jsonl has no test evaluation: the run did not finish")
  test = evals["test"]
  report = {
      "dataset": config.data.dataset,
      "protocol": "leave-one-out, full catalog, seen items excluded",
      "hr@10": test["hit@10"], "ndcg@10": test["ndcg@10"], "mrr": test["mrr"],
      "step": step,
      "wall_s": None if wall_s is None else round(wall_s, 1),
      "train_s_from_log": round(train_time_from_log(records), 1),
      "test": {k: v for k, v in test.items() if k not in ("step", "kind")},
      "validation": {k: v for k, v in evals.get("validation", {}).items()
                     if k not in ("step", "kind")},
      "validation_curve": validation_curve(records),
      "loss_kind": config.loss.get("kind", "bce"),
      "loss_backend": config.loss.backend,
      "config": _recorded_config(config),
      "command": command,
      "machine": {"cpu_count": os.cpu_count(), "devices": len(jax.devices()),
                  "platform": jax.default_backend(),
                  "processor": platform.processor() or platform.machine()},
      "popularity_baseline": popularity_baseline(_prepared_dir(config, workdir)),
      # The published figures are ML-1M's; other data (e.g. synthetic_topics) has none.
      "published": PUBLISHED if config.data.dataset == "ml-1m" else None,
  }
  path = pathlib.Path(out)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(report, indent=2) + "\n")
  pop = report["popularity_baseline"]["test"]
  print(f"test at step {step}: HR@10 {report['hr@10']:.4f}  NDCG@10 {report['ndcg@10']:.4f}  "
        f"MRR {report['mrr']:.4f}")
  print(f"most popular (test): HR@10 {pop['hit@10']:.4f}  NDCG@10 {pop['ndcg@10']:.4f}  "
        f"MRR {pop['mrr']:.4f}")
  print(f"wrote {path}")


def cmd_train(args):
  from trainer import loop  # pylint: disable=import-outside-toplevel
  config = load_config(args.config, args.set)
  start = time.perf_counter()
  loop.train_and_evaluate(config, args.workdir)
  wall = time.perf_counter() - start
  write_report(config, args.workdir, args.out, wall_s=wall, command=_command())


SUMMARY_METRICS = ("ndcg@10", "hr@10", "mrr")


def cmd_seeds(args):
  """Trains `--config` once per seed (resuming a finished or cut-off seed's run),
  then writes per-seed and mean metrics with their spread, and the curves."""
  from trainer import loop  # pylint: disable=import-outside-toplevel
  per_seed = []
  for seed in args.seeds:
    config = load_config(args.config, args.set + [f"seed={seed}"])
    workdir = os.path.join(args.workdir, f"seed_{seed}")
    out = os.path.join(args.workdir, f"seed_{seed}.json")
    if finished(workdir, config.train_steps):
      # Collected, not trained again; the wall time is the one of the run that trained it.
      print(f"== seed {seed}: {workdir} finished, collecting its metrics", flush=True)
      previous = pathlib.Path(out)
      wall_s = json.loads(previous.read_text())["wall_s"] if previous.exists() else None
    else:
      print(f"== seed {seed}: {workdir}", flush=True)
      start = time.perf_counter()
      loop.train_and_evaluate(config, workdir)
      wall_s = time.perf_counter() - start
    write_report(config, workdir, out, wall_s=wall_s, command=_command())
    per_seed.append({"seed": seed, **json.loads(pathlib.Path(out).read_text())})
  write_summary(summarize(per_seed), args.out)
  if args.plot:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for run in per_seed:
      curve = run["validation_curve"]
      ax.plot([c["step"] for c in curve], [c["ndcg@10"] for c in curve], "o-",
              label=f"seed {run['seed']}")
    ax.set_xlabel("step")
    ax.set_ylabel("validation NDCG@10")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    print(f"wrote {args.plot}")


def summarize(per_seed: list[dict]) -> dict:
  """Mean, sample std and range of SUMMARY_METRICS over reports of one recipe's seeds.

  The reports must differ in nothing but their seed and mesh (each seed's
  mesh and machine are kept in `per_seed`).
  """
  from trainer.config.schema import flatten  # pylint: disable=import-outside-toplevel
  # As a report holds them (tuples become lists). A report written before a
  # config key existed ran with its default (new keys default to the
  # behaviour before them): its missing keys are the defaults'.
  defaults = flatten(json.loads(json.dumps(load_config("configs/base.py", []).to_dict())))
  # Neither the seed nor the mesh is the recipe: a run on 8 simulated CPU
  # devices and on one GPU (the same global batch) give the same numbers
  # (docs/results.md, "Same numbers on CPU and GPU"). Each seed's mesh is kept.
  configs = [{key: value for key, value in {**defaults, **flatten(run["config"])}.items()
              if key != "seed" and not key.startswith("mesh.")} for run in per_seed]
  for config, run in zip(configs[1:], per_seed[1:]):
    differ = sorted(key for key in config.keys() | configs[0].keys()
                    if config.get(key) != configs[0].get(key))
    if differ:
      raise SystemExit(f"the reports differ in more than their seed ({', '.join(differ)} of "
                       f"seed {run['config']['seed']}): not seeds of one recipe")
  summary = {"seeds": [run["config"]["seed"] for run in per_seed],
             "config": per_seed[0]["config"], "command": _command(),
             "published": per_seed[0].get("published"),
             "popularity_baseline": per_seed[0]["popularity_baseline"],
             "machine": _one_or_all([run.get("machine") for run in per_seed])}
  for name in SUMMARY_METRICS:
    values = np.array([run[name] for run in per_seed])
    summary[name] = float(values.mean())
    summary[f"{name}_std"] = float(values.std(ddof=1)) if len(values) > 1 else 0.0
    summary[f"{name}_min_max"] = [float(values.min()), float(values.max())]
  summary["per_seed"] = [
      {"seed": run["config"]["seed"], "machine": run.get("machine"),
       "mesh": run["config"].get("mesh"), "step": run["step"],
       "wall_s": run["wall_s"],
       "train_s_from_log": run["train_s_from_log"], "command": run.get("command"),
       **{name: run[name] for name in SUMMARY_METRICS}, "test": run["test"],
       "validation_curve": run["validation_curve"]} for run in per_seed]
  return summary


def _one_or_all(values: list):
  """The one value all seeds share, else each seed's (seeds run on different machines)."""
  return values[0] if all(value == values[0] for value in values) else values


def write_summary(summary: dict, out: str) -> None:
  path = pathlib.Path(out)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(summary, indent=2) + "\n")
  print("  ".join(f"{name} {summary[name]:.4f} +- {summary[name + '_std']:.4f}"
                  for name in SUMMARY_METRICS) + f" over seeds {summary['seeds']}")
  print(f"wrote {path}")


def cmd_summarize(args):
  """Seeds of one recipe trained elsewhere (their reports) -> the seeds JSON."""
  per_seed = [json.loads(pathlib.Path(report).read_text()) for report in args.reports]
  write_summary(summarize(per_seed), args.out)


def cmd_collect(args):
  config = load_config(args.config, args.set)
  write_report(config, args.workdir, args.out, wall_s=None, command=_command())


def cmd_compare(args):
  """Per-step train losses of two runs (same config, different loss.backend)."""
  def losses(workdir, key="loss"):
    return {r["step"]: r[key] for r in read_metrics(workdir) if r["kind"] == "train"}
  cut, dense = losses(args.cutbce), losses(args.dense)
  cut_norm, dense_norm = losses(args.cutbce, "grad_norm"), losses(args.dense, "grad_norm")
  steps = sorted(set(cut) & set(dense))
  if not steps:
    raise SystemExit("no common logged step")
  rel = [abs(cut[s] - dense[s]) / max(abs(dense[s]), 1e-12) for s in steps]
  print(f"{'step':>6} {'cutbce':>12} {'dense':>12} {'rel diff':>10}")
  for s, r in zip(steps, rel):
    print(f"{s:>6} {cut[s]:>12.5f} {dense[s]:>12.5f} {r:>10.2e}")
  report = {"steps": steps, "cutbce_loss": [cut[s] for s in steps],
            "dense_loss": [dense[s] for s in steps], "relative_diff": rel,
            "max_relative_diff": max(rel),
            "cutbce_grad_norm": [cut_norm[s] for s in steps],
            "dense_grad_norm": [dense_norm[s] for s in steps],
            "max_grad_norm_relative_diff": max(
                abs(cut_norm[s] - dense_norm[s]) / max(abs(dense_norm[s]), 1e-12) for s in steps),
            "command": _command()}
  path = pathlib.Path(args.out)
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(report, indent=2) + "\n")
  print(f"max relative difference {max(rel):.2e} (loss), "
        f"{report['max_grad_norm_relative_diff']:.2e} (gradient norm) over {len(steps)} "
        f"logged steps; wrote {path}")
  if args.plot:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, report["dense_loss"], "o-", label="dense BCE", alpha=0.7)
    ax.plot(steps, report["cutbce_loss"], "x--", label="CutBCE (xla)")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("train loss")
    ax.set_title("ML-1M SASRec: same config, two loss backends")
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.plot, dpi=120)
    print(f"wrote {args.plot}")


def _recorded_config(config) -> dict:
  """The config as JSON, without the (machine-specific) prepared-data folder."""
  recorded = json.loads(config.to_json())
  recorded["data"]["prepared_dir"] = None
  return recorded


def _command() -> str:
  """This command line, without the (machine-specific) prepared-data folder."""
  args = [a for a in sys.argv[1:] if not a.startswith("data.prepared_dir=")]
  args = [a for i, a in enumerate(args) if not (a == "--set" and (
      i + 1 == len(args) or args[i + 1].startswith("--")))]
  return "python " + " ".join([os.path.relpath(sys.argv[0], ROOT)] + args)


def main():
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  sub = parser.add_subparsers(dest="command", required=True)
  for name in ("train", "collect", "seeds"):
    p = sub.add_parser(name)
    p.add_argument("--config", default="configs/ml1m.py")
    p.add_argument("--workdir", required=True,
                   help="the run's directory (seeds: one seed_<s> folder per seed in it)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override, e.g. optimizer.learning_rate=2e-3")
    if name == "seeds":
      p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
      p.add_argument("--plot", default="docs/results/ml1m_seeds.png")
    p.add_argument("--out", default="docs/results/ml1m_metrics.json")
  p = sub.add_parser("summarize", help="mean and spread of one recipe's seed reports")
  p.add_argument("reports", nargs="+", help="report JSONs of `train`, one per seed")
  p.add_argument("--out", required=True)
  p = sub.add_parser("compare")
  p.add_argument("--cutbce", required=True)
  p.add_argument("--dense", required=True)
  p.add_argument("--out", default="docs/results/ml1m_dense_vs_cutbce.json")
  p.add_argument("--plot", default="docs/results/ml1m_dense_vs_cutbce.png")
  args = parser.parse_args()
  {"train": cmd_train, "collect": cmd_collect, "seeds": cmd_seeds,
   "summarize": cmd_summarize, "compare": cmd_compare}[args.command](args)


if __name__ == "__main__":
  main()
