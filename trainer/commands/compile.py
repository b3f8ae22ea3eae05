"""Does my job fit this TPU slice? The trainer's steps compiled for it, with no TPU.

    python -m trainer.compile --config=configs/yambda50m_v6e8.py --topology=v6e-8
        [--num_slices=1] [--num_items=V] [--config.key=value ...]

builds the real train step, evaluation step (full-catalog ranks) and top-k
step (`trainer.recommend`'s) from the config, exactly as `trainer.main` and
the commands do, for the devices of a named TPU slice (`--topology`, one of
`cutbce.kernels.compiler.TOPOLOGIES`; `--num_slices` for several slices over
DCN, with `mesh.dcn_shape`), and compiles them with the TPU compiler (libtpu,
`pip install 'cutbce[tpu]'`): XLA:TPU and Mosaic, as on the slice. Nothing
runs and no data is read: the catalog size is `config.compile.num_items` (or
`--num_items`); the evaluation batch has `config.compile.eval_targets`
targets and `config.compile.eval_exclude` excluded ids per user.

Prints per step and per chip: arguments, temporaries and peak (arguments +
outputs - donated + temporaries, the compiler's `memory_analysis()`), the
chip's HBM, whether it fits and by what margin, the compile time, and the
compiler's own cost estimate (flops, `optimal_seconds`: an estimate, not a
timing). The last stdout line is one JSON object. Exit status 0 when every
step fits, 1 when one does not (XLA:TPU refuses to compile a program whose
temporaries exceed HBM: that is reported with both figures, not as a
traceback), 2 for a bad config or flag.

The Pallas kernels are planned for the slice's chip (`tiling.target_chip`),
not for this host.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from absl import app, flags, logging
from ml_collections import config_flags

from trainer import libtpu_env
from trainer.commands import cli


def _define_flags() -> dict[str, Any]:
  """The command's flags, defined when it runs, not on import.

  `trainer.main` defines its own `--config`; a module that both (or a test
  process) imports must not define it twice.
  """
  defined = {
      "config": config_flags.DEFINE_config_file("config", None, "Trainer config file.",
                                                lock_config=True),
      "topology": flags.DEFINE_string(
          "topology", None, "TPU slice to compile for: v5e-8, v6e-8, v6e-16, v5p-8, tpu7x-8, ... (an "
          "unknown name lists the known ones)."),
      "num_slices": flags.DEFINE_integer(
          "num_slices", 1, "Slices of --topology, joined over DCN (the config's mesh.dcn_shape "
          "spans them).", lower_bound=1),
      "num_items": flags.DEFINE_integer(
          "num_items", None, "Catalog size V to compile for (default config.compile.num_items).",
          lower_bound=1),
  }
  flags.mark_flags_as_required(["config", "topology"])
  return defined


_FLAGS: dict[str, Any] = {}

GIB = 1024**3


def _cost(compiled) -> dict[str, float]:
  """The compiler's flops and optimal_seconds (a list of dicts in older jax)."""
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):
    cost = cost[0] if cost else {}
  flops, seconds = cost.get("flops"), cost.get("optimal_seconds")
  # The compiler says -1 (or nothing) where it has no estimate.
  known = lambda value: None if value is None or value < 0 else float(value)  # noqa: E731
  return {"flops": known(flops), "optimal_seconds": known(seconds)}


def compile_step(name: str, jitted, args, *, devices, hbm_bytes: int) -> dict[str, Any]:
  """Compiles `jitted(*args)` for `devices`; its memory per chip and whether it fits.

  An out-of-HBM refusal of the compiler is a result (`fits` False, the
  compiler's required and available bytes), not an error.
  """
  from cutbce.kernels import compiler  # pylint: disable=import-outside-toplevel
  start = time.perf_counter()
  try:
    with compiler.planning_for(devices):
      compiled = jitted.lower(*args).compile()
  except Exception as error:  # pylint: disable=broad-exception-caught
    shortfall = compiler.hbm_shortfall(str(error))
    if shortfall is None:
      raise
    required, available = shortfall
    return {"step": name, "fits": False, "required_bytes": required,
            "available_bytes": available, "hbm_bytes": hbm_bytes,
            "compile_s": round(time.perf_counter() - start, 1)}
  seconds = time.perf_counter() - start
  memory = compiled.memory_analysis()
  peak = compiler.peak_bytes(memory)
  return {"step": name, "fits": peak <= hbm_bytes,
          "argument_bytes": int(memory.argument_size_in_bytes),
          "output_bytes": int(memory.output_size_in_bytes),
          "alias_bytes": int(memory.alias_size_in_bytes),
          "temp_bytes": int(memory.temp_size_in_bytes), "peak_bytes": peak,
          "hbm_bytes": hbm_bytes, "margin_bytes": hbm_bytes - peak,
          "compile_s": round(seconds, 1), "mosaic_kernels": len(compiler.mosaic_kernels(compiled)),
          "kernels": compiler.kernel_plans(compiled),
          **{f"compiler_{k}": v for k, v in _cost(compiled).items()}}


def step_programs(config, *, num_items: int, mesh) -> dict[str, tuple[Any, tuple]]:
  """`{name: (jitted, abstract args)}` of the train, evaluation and top-k steps.

  Built as `trainer.loop` and `trainer.recommend` build them; the arguments
  are `jax.ShapeDtypeStruct`s with the run's shardings.
  """
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from trainer import evaluate  # pylint: disable=import-outside-toplevel
  from trainer.config import mesh as config_mesh  # pylint: disable=import-outside-toplevel
  from trainer import train as train_lib  # pylint: disable=import-outside-toplevel
  from trainer.commands import recommend  # pylint: disable=import-outside-toplevel
  vocab_shards = config_mesh.vocab_shard_count(config)
  plan = train_lib.plan_sharded_state(config, num_items=num_items, mesh=mesh,
                                      vocab_shards=vocab_shards)
  settings = train_lib.step_settings(config, mesh=mesh, num_items=num_items)
  batch_sharding = train_lib.batch_sharding(mesh, config.mesh.token_axes)

  def batch(**shapes):
    return {key: jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding)
            for key, (shape, dtype) in shapes.items()}

  b, n = config.batch_size, config.seq_len
  train_batch = batch(inputs=((b, n), np.int32), targets=((b, n, config.num_targets), np.int32),
                      weights=((b, n), np.float32))
  shards = config_mesh.token_shard_count(config)
  eval_b = -(-config.eval_batch_size // shards) * shards
  eval_targets = config.compile.get("eval_targets") or config.num_targets
  eval_exclude = config.compile.get("eval_exclude") or n
  eval_batch = batch(inputs=((eval_b, n), np.int32), targets=((eval_b, eval_targets), np.int32),
                     weights=((eval_b,), np.float32), exclude=((eval_b, eval_exclude), np.int32))
  eval_settings = settings._replace(backend=config.eval.backend)
  params = plan.abstract["params"]
  programs = {
      "train": (train_lib.jit_train_step(plan.graphdef, plan.tx, plan.schedule, settings,
                                         plan.shardings,
                                         tables=_sampler_table(settings, num_items, vocab_shards)),
                (plan.abstract, train_batch)),
      "eval": (evaluate.jit_eval_step(plan.graphdef, eval_settings, plan.shardings["params"],
                                      filter_seen=config.eval.filter_seen,
                                      ks=tuple(config.eval.ks)), (params, eval_batch)),
  }
  k = max(config.eval.ks)
  top_k = jax.jit(
      lambda p, x: recommend.top_k_step(p, x, graphdef=plan.graphdef, settings=eval_settings,
                                        k=k),
      in_shardings=(plan.shardings["params"], batch_sharding))
  top_k_batch = {key: eval_batch[key] for key in ("inputs", "exclude")}
  programs[f"top_{k}"] = (top_k, (params, top_k_batch))
  return programs


def _sampler_table(settings, num_items: int, vocab_shards: int):
  """The popularity sampler's table (`train.sampler_tables`) as a shape, or None."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.sharding import NamedSharding, PartitionSpec  # pylint: disable=import-outside-toplevel
  from trainer import model as model_lib  # pylint: disable=import-outside-toplevel
  from trainer import train as train_lib  # pylint: disable=import-outside-toplevel
  if not train_lib.needs_item_counts(settings):
    return None
  rows = model_lib.padded_vocab_size(num_items, vocab_shards)
  return jax.ShapeDtypeStruct((rows,), np.int32,
                              sharding=NamedSharding(settings.mesh, PartitionSpec()))


def _gib(value) -> str:
  return "-" if value is None else f"{value / GIB:.2f}"


def _scaled(value, factor: float, digits: int) -> str:
  return "-" if value is None else f"{value * factor:.{digits}f}"


def format_table(results: list[dict[str, Any]]) -> str:
  """One line per step; the compiler's cost columns are its estimate, not a timing."""
  lines = [f"{'step':<8} {'args GiB':>9} {'temp GiB':>9} {'peak GiB':>9} {'HBM GiB':>8} "
           f"{'margin GiB':>10} {'fits':>4} {'compile s':>9} {'TFLOP*':>7} {'ms*':>8}"]
  for r in results:
    if "peak_bytes" not in r:
      lines.append(f"{r['step']:<8} {'-':>9} {_gib(r['required_bytes']):>9} {'-':>9} "
                   f"{_gib(r['hbm_bytes']):>8} {'-':>10} {'no':>4} {r['compile_s']:>9.1f} "
                   f"{'-':>7} {'-':>8}")
      continue
    lines.append(
        f"{r['step']:<8} {_gib(r['argument_bytes']):>9} {_gib(r['temp_bytes']):>9} "
        f"{_gib(r['peak_bytes']):>9} {_gib(r['hbm_bytes']):>8} {_gib(r['margin_bytes']):>10} "
        f"{'yes' if r['fits'] else 'no':>4} {r['compile_s']:>9.1f} "
        f"{_scaled(r['compiler_flops'], 1e-12, 3):>7} "
        f"{_scaled(r['compiler_optimal_seconds'], 1e3, 3):>8}")
  lines.append("* the compiler's cost estimate for one call on one chip (flops, "
               "optimal_seconds), not a timing; - where it gives none")
  return "\n".join(lines)


_MIB = 1024**2


def format_plans(results: list[dict[str, Any]]) -> str:
  """Per step, each Pallas kernel's plan beside the VMEM the compiler gave it.

  The plan is the one the kernel chose for the chip compiled for (its tiles,
  token chunks, and TensorCores where the backward's sweep is split on a
  megacore chip); "VMEM used" is the compiler's scoped VMEM for the kernel,
  "planned" the planner's estimate of the same plan, "limit" the
  `vmem_limit_bytes` the kernel was compiled with.
  """
  from cutbce.kernels import tiling  # pylint: disable=import-outside-toplevel
  lines = []
  for r in results:
    for k in r.get("kernels", []):
      chunk = min(k["token_chunk"], k["tokens"] or k["token_chunk"])
      chunks = -(-(k["tokens"] or chunk) // chunk)
      kind = {"rank_logits": "ranks", "softmax_forward": "forward",
              "softmax_backward": "backward"}.get(k["kernel"], k["kernel"])
      planned = None
      if k["dim"] and k["dtype"] in ("bf16", "f32") and kind in tiling.KERNELS:
        planned = tiling.vmem_estimate(
            kind, token_chunk=chunk, block_t=k["block_t"], block_v=k["block_v"], dim=k["dim"],
            itemsize=2 if k["dtype"] == "bf16" else 4, num_targets=8,
            num_tokens=k["tokens"], cores=k["cores"])
      mib = lambda b: "-" if b is None else f"{b / _MIB:.1f}"  # noqa: E731
      lines.append(
          f"{r['step']:<8} {k['kernel']:<17} tiles {k['block_t']} x {k['block_v']}, "
          f"{chunks} chunk(s) of {chunk}, {k['cores']} core(s); VMEM used "
          f"{mib(k['used_bytes'])} MiB, planned {mib(planned)} MiB, limit "
          f"{mib(k['limit_bytes'])} MiB")
  if lines:
    lines.insert(0, "Pallas kernels per step (the plan each chose for this chip; VMEM: the "
                    "compiler's figure, the planner's estimate, the limit):")
  return "\n".join(lines)


def does_not_fit_lines(results: list[dict[str, Any]], topology: str) -> list[str]:
  out = []
  for r in results:
    if r["fits"]:
      continue
    if "peak_bytes" in r:
      out.append(f"does not fit: the {r['step']} step needs {_gib(r['peak_bytes'])} GiB per "
                 f"chip, a {topology} chip has {_gib(r['hbm_bytes'])} GiB of HBM")
    else:
      out.append(f"does not fit: the {r['step']} step needs {_gib(r['required_bytes'])} GiB of "
                 f"temporaries per chip; the compiler found {_gib(r['available_bytes'])} GiB of "
                 f"HBM available on a {topology} chip")
  return out


def compile_config(config, *, topology: str, num_slices: int = 1, num_items: int,
                   say=print) -> dict[str, Any]:
  """Compiles the config's steps for `num_slices` x `topology`; the JSON summary."""
  from cutbce.kernels import compiler, tiling  # pylint: disable=import-outside-toplevel
  from trainer.config import mesh as config_mesh  # pylint: disable=import-outside-toplevel
  devices = compiler.topology_devices(topology, num_slices)
  config_mesh.check_config(config, devices=devices)
  mesh = config_mesh.make_mesh(config, devices)
  chip = compiler.chip_of(devices[0])
  hbm = tiling.chip_spec(chip).hbm_capacity_bytes * int(getattr(devices[0], "num_cores", 1) or 1)
  hosts = len({device.process_index for device in devices})
  say(f"compiling for {num_slices} x {topology}: {len(devices)} x {devices[0].device_kind} "
      f"in {hosts} host(s), mesh {dict(mesh.shape)}, V = {num_items:,}, loss "
      f"{config.loss.kind}/{config.loss.backend}, eval {config.eval.backend}; no TPU is used")
  results = []
  for name, (jitted, args) in step_programs(config, num_items=num_items, mesh=mesh).items():
    say(f"compiling the {name} step ...")
    results.append(compile_step(name, jitted, args, devices=devices, hbm_bytes=hbm))
  return {"topology": topology, "num_slices": num_slices, "chip": chip,
          "devices": len(devices), "hosts": hosts, "mesh": dict(mesh.shape),
          "num_items": num_items, "batch_size": config.batch_size,
          "loss_backend": config.loss.backend, "eval_backend": config.eval.backend,
          "fits": all(r["fits"] for r in results), "steps": results}


def main(argv) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  from cutbce.kernels import compiler  # pylint: disable=import-outside-toplevel
  from trainer.config import mesh as config_mesh, schema  # pylint: disable=import-outside-toplevel
  config = _FLAGS["config"].value
  try:
    compiler.topology(_FLAGS["topology"].value)
  except ValueError as error:
    cli.bad_config(f"--topology: {error}")
  reason = compiler.libtpu_missing_reason()
  if reason is not None:
    print(reason, file=sys.stderr)
    sys.exit(2)
  num_items = _FLAGS["num_items"].value or config.compile.get("num_items")
  if num_items is None:
    cli.bad_config("the catalog size is unknown: pass --num_items=V or set "
                   "config.compile.num_items")
  try:
    summary = compile_config(config, topology=_FLAGS["topology"].value,
                             num_slices=_FLAGS["num_slices"].value,
                             num_items=num_items, say=cli.notice)
  except schema.ConfigError as error:
    cli.bad_config(error)
  print(format_table(summary["steps"]))
  plans = format_plans(summary["steps"])
  if plans:
    print(plans)
  for line in does_not_fit_lines(summary["steps"], _FLAGS["topology"].value):
    print(line)
  print(json.dumps(summary))
  sys.exit(0 if summary["fits"] else 1)


def run() -> None:
  """The console script `cutbce-compile`."""
  libtpu_env.quiet_probe_without_tpu()  # before libtpu is loaded for the topology
  if not _FLAGS:
    _FLAGS.update(_define_flags())
  app.run(main, flags_parser=cli.parse_config_flags)


if __name__ == "__main__":
  run()
