"""Gradient error against float64 at confident targets: cut ops (xla) vs the dense reference.

The inputs of tests/cutbce/test_precision.py (one target per position at a
logit from -30 to +30, several at +7, the same sweep for both losses): the
largest per-row error of dh and dE relative to the row's largest float64
entry. Prints a Markdown table; `--out` also stores the rows in a JSON file
under `--label` (other labels already there are kept). Runs in seconds on CPU.

    python -m benchmarks.precision_table --label after --out docs/results/precision.json

For the previous code, run it from a folder where `cutbce` is the older
package and `tests` and `benchmarks` are this checkout's (same inputs), with
`--label before`.
"""

from __future__ import annotations

import argparse
import functools
import json
import os

import jax.numpy as jnp
import numpy as np

import cutbce
from tests.cutbce import test_precision as tp


def _errors(kind, dtype, fn):
  kwargs = dict(vocab_reduction="sum") if kind == "bce" else {}
  got = tp._grads(fn, dtype, **kwargs)
  oracle = tp._oracle(kind, dtype)
  dh = tp._row_errors(got[0].reshape(tp.B * tp.N, tp.D),
                      np.asarray(oracle[0]).reshape(tp.B * tp.N, tp.D)).max()
  de = tp._row_errors(got[1], np.asarray(oracle[1])).max()
  return float(dh), float(de)


def main():
  parser = argparse.ArgumentParser(description=__doc__)
  parser.add_argument("--out", default=None)
  parser.add_argument("--label", default="current")
  args = parser.parse_args()
  rows = []
  for kind, cut, dense in (("bce", cutbce.cut_bce, cutbce.dense_bce),
                           ("softmax", cutbce.cut_softmax_ce, cutbce.dense_softmax_ce)):
    for dtype, name in ((jnp.float32, "f32"), (jnp.bfloat16, "bf16")):
      d = _errors(kind, dtype, dense)
      c = _errors(kind, dtype, functools.partial(cut, backend="xla", plan=tp.PLANS["xla"]))
      rows.append(dict(loss=kind, dtype=name, dense_dh=d[0], dense_dE=d[1], xla_dh=c[0],
                       xla_dE=c[1]))
  print(f"| loss | dtype | dense dh | dense dE | xla dh ({args.label}) | xla dE ({args.label}) |")
  print("|---|---|---:|---:|---:|---:|")
  for r in rows:
    print(f"| {r['loss']} | {r['dtype']} | {r['dense_dh']:.2g} | {r['dense_dE']:.2g} | "
          f"{r['xla_dh']:.2g} | {r['xla_dE']:.2g} |")
  if args.out:
    stored = {}
    if os.path.exists(args.out):
      with open(args.out) as f:
        stored = json.load(f)
    stored[args.label] = rows
    with open(args.out, "w") as f:
      json.dump(stored, f, indent=1)


if __name__ == "__main__":
  main()
