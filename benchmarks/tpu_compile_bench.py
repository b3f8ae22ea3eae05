"""The paper's memory table, from the TPU compiler: Yambda-50M's train step, dense vs CutBCE.

The step is the trainer's own (`trainer.compile.step_programs`: SASRec,
`sharded_cut_bce` or the dense loss, AdamW, donated state) for
`configs/yambda50m_v6e8.py` (mesh data=2 x model=4, N = 256, L = 8, D = 128,
bf16), with only `loss.backend` changed: "dense" (materialized logits under
XLA's partitioner) or "auto" (CutBCE; the Pallas kernels when compiled for
TPU). Compiled with libtpu for v6e-8 and v5e-8 slices without a TPU; each
figure is the compiler's per-chip `memory_analysis()` (peak = arguments +
outputs - donated + temporaries), or, for a program over HBM, the
compiler's refusal with the bytes it needed. `optimal_seconds` is the
compiler's own cost model, an estimate, not a timing.

  paper   batch 64, V = 876,939: peak per chip, beside the paper's 22.37 / 7.67 GiB
  batch   the largest global batch (64 x 2^k, up to --max-batch) each one fits
  vocab   V in 131,072 / 876,939 / 2M / 5M / 10M at batch 64: where dense stops fitting
  softmax the paper's setting with loss.kind="softmax_ce": dense CE against cut CE

    python benchmarks/tpu_compile_bench.py [--parts paper batch vocab softmax] [--chips v6e v5e]

Needs the `tpu` extra. Prints tables and writes JSON to
docs/results/tpu_compile_bench.json (kept between runs: a compiled case is not
compiled again unless --fresh). Each compile takes 0.2-2 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from absl import logging  # noqa: E402

from configs import yambda50m_v6e8  # noqa: E402
from cutbce.kernels import compiler  # noqa: E402
from trainer.commands import compile as compile_lib  # noqa: E402
from trainer.config import mesh as config_mesh  # noqa: E402

GIB = 2**30
PAPER = {"chip": "TPU v6e x 8", "batch": 64, "vocab": 876_939,
         "peak_hbm_gib": {"dense": 22.37, "cutbce": 7.67}, "peak_reduction": 0.657}
BACKENDS = {"dense": "dense", "cutbce": "auto"}
# The softmax CE step (loss.kind="softmax_ce"): dense logits against cut_softmax_ce.
SOFTMAX = {"dense_ce": "dense", "cut_ce": "auto"}
VOCABS = (131_072, 876_939, 2_000_000, 5_000_000, 10_000_000)


def loss_overrides(backend: str) -> dict:
  """The `config.loss` fields of one of BACKENDS or SOFTMAX."""
  if backend in SOFTMAX:
    return {"kind": "softmax_ce", "backend": SOFTMAX[backend]}
  return {"backend": BACKENDS[backend]}


def train_step(chip: str, backend: str, *, batch: int, vocab: int,
               loss: dict | None = None) -> dict:
  """The compiled train step's per-chip memory (or the compiler's refusal).

  `backend` names the case; `loss` (default `loss_overrides(backend)`) is
  what it sets in the config's `config.loss` (`benchmarks/loss_cost.py`
  passes the sampled kinds' fields).
  """
  topology = f"{chip}-8"
  config = yambda50m_v6e8.get_config()
  config.batch_size = batch
  config.loss.update(loss_overrides(backend) if loss is None else loss)
  devices = compiler.topology_devices(topology)
  config_mesh.check_config(config, devices=devices)
  mesh = config_mesh.make_mesh(config, devices)
  jitted, args = compile_lib.step_programs(config, num_items=vocab, mesh=mesh)["train"]
  hbm = compiler.tiling_chip(topology).hbm_capacity_bytes
  result = compile_lib.compile_step("train", jitted, args, devices=devices, hbm_bytes=hbm)
  return {"chip": chip, "backend": backend, "batch": batch, "vocab": vocab, **result}


def _gib(value) -> str:
  return "-" if value is None else f"{value / GIB:.2f}"


def _row(r: dict) -> str:
  need = r.get("peak_bytes", r.get("required_bytes"))
  seconds = r.get("compiler_optimal_seconds")
  est = "-" if seconds is None else f"{seconds * 1e3:.2f}"
  return (f"{r['chip']:>4} {r['backend']:>8} {r['batch']:>6} {r['vocab']:>11,} "
          f"{_gib(need):>9} {'yes' if r['fits'] else 'NO':>5} {est:>10} {r['compile_s']:>8.1f}")


HEADER = (f"{'chip':>4} {'loss':>8} {'batch':>6} {'V':>11} {'peak GiB':>9} {'fits':>5} "
          f"{'est. ms*':>10} {'compile':>8}")


class Cache:
  """Results by case, saved after each compile.

  The cases are the file's `section` (other keys of the file are kept;
  `header` is written beside them); `losses` maps a case name to its
  `config.loss` fields (default: BACKENDS and SOFTMAX).
  """

  def __init__(self, path: pathlib.Path, fresh: bool, *, section: str = "cases",
               header: dict | None = None, losses: dict | None = None):
    self.path, self.section, self.losses = path, section, losses or {}
    self.header = {"paper": PAPER} if header is None else header
    saved = json.loads(path.read_text()) if path.exists() else {}
    self.results = {} if fresh else saved.get(section, {})

  def get(self, chip, backend, batch, vocab) -> dict:
    key = f"{chip}/{backend}/b{batch}/v{vocab}"
    if key not in self.results:
      self.results[key] = train_step(chip, backend, batch=batch, vocab=vocab,
                                     loss=self.losses.get(backend))
      self.path.parent.mkdir(parents=True, exist_ok=True)
      saved = json.loads(self.path.read_text()) if self.path.exists() else {}
      saved.update(self.header)
      saved[self.section] = self.results
      self.path.write_text(json.dumps(saved, indent=1) + "\n")
    result = self.results[key]
    print(_row(result), flush=True)
    return result


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--parts", nargs="+", default=["paper", "batch", "vocab"])
  parser.add_argument("--chips", nargs="+", default=["v6e", "v5e"])
  parser.add_argument("--max-batch", type=int, default=4096)
  parser.add_argument("--fresh", action="store_true")
  parser.add_argument("--out", default="docs/results/tpu_compile_bench.json")
  args = parser.parse_args(argv)
  logging.set_verbosity(logging.WARNING)
  reason = compiler.libtpu_missing_reason()
  if reason:
    raise SystemExit(reason)
  cache = Cache(pathlib.Path(args.out), args.fresh)
  if "paper" in args.parts:
    print(f"\n== the paper's setting: batch 64, V = 876,939; paper (v6e-8): dense "
          f"{PAPER['peak_hbm_gib']['dense']} GiB, CutBCE {PAPER['peak_hbm_gib']['cutbce']} GiB ==")
    print(HEADER)
    for chip in args.chips:
      got = {b: cache.get(chip, b, 64, PAPER["vocab"]) for b in BACKENDS}
      if all("peak_bytes" in r for r in got.values()):
        dense, cut = got["dense"]["peak_bytes"], got["cutbce"]["peak_bytes"]
        seconds = [got[b].get("compiler_optimal_seconds") for b in ("dense", "cutbce")]
        ratio = ("no estimate from the compiler" if None in seconds
                 else f"{seconds[0] / seconds[1]:.2f}x (an estimate)")
        print(f"{chip}: CutBCE peak {1 - cut / dense:.1%} below dense (paper 65.7%); compiler's "
              f"estimated step time dense / CutBCE: {ratio}")
  if "softmax" in args.parts:
    print("\n== softmax CE (loss.kind=softmax_ce), batch 64, V = 876,939 ==")
    print(HEADER)
    for chip in args.chips:
      got = {b: cache.get(chip, b, 64, PAPER["vocab"]) for b in SOFTMAX}
      if all("peak_bytes" in r for r in got.values()):
        dense, cut = got["dense_ce"]["peak_bytes"], got["cut_ce"]["peak_bytes"]
        print(f"{chip}: cut softmax CE peak {1 - cut / dense:.1%} below dense softmax CE")
  if "batch" in args.parts:
    print("\n== the largest global batch that fits, V = 876,939 ==")
    print(HEADER)
    for chip in args.chips:
      for backend in BACKENDS:
        batch, largest = 64, None
        while batch <= args.max_batch:
          if not cache.get(chip, backend, batch, PAPER["vocab"])["fits"]:
            break
          largest, batch = batch, 2 * batch
        print(f"{chip} {backend}: largest batch that fits {largest} "
              f"(tried up to {min(batch, args.max_batch)})")
  if "vocab" in args.parts:
    print("\n== peak per chip against V, batch 64 ==")
    print(HEADER)
    for chip in args.chips:
      for vocab in VOCABS:
        for backend in BACKENDS:
          cache.get(chip, backend, 64, vocab)
  print(f"wrote {cache.path}")


if __name__ == "__main__":
  main()
