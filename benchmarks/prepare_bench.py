"""Preparation at scale: the in-memory path against the out-of-core engine (and Polars).

For each size, a synthetic parquet file (users uniform over n / 100 ids, items
Zipf over 10^7 ids, times uniform over a year, rows in random user order; one
size with string user and item ids) is prepared by ``python -m trainer.data``
with ``--engine memory`` (today's path; skipped past ``--memory-max-events``)
and ``--engine duckdb --memory-limit LIMIT``, each in its own process under
``/usr/bin/time -v`` (wall time, peak RSS of the process). Disk spilled: the
peak size of the child's temporary folder, polled every 0.5 s. For the
smaller sizes, the core of the same preparation (count items, remap, order by
user, time and file order, write parquet) is also run with Polars' streaming
engine, the other engine compared. The two prepared folders are checked to be
byte-identical where both ran. Prints a table, writes JSON and a plot of peak
RSS against events. ``--share SIZE`` instead measures what each of P
processes opens of a folder prepared in user shards, and, in a fresh process
that reads one whole epoch of process 0's training batches, its memory: peak
RSS, and the file pages of the memory-mapped arrays that stayed resident.

  nice -n 10 python benchmarks/prepare_bench.py --sizes 20M,100M,300M \\
      --memory-limit 2GB --work /tmp/prepare_bench --out docs/results/prepare_bench.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

ROOT = pathlib.Path(__file__).resolve().parent.parent
NUM_ITEMS = 10_000_000
CHUNK = 5_000_000


def parse_size(text: str) -> int:
  """``20M`` -> 20_000_000, ``1B`` -> 10**9."""
  scale = {"K": 10**3, "M": 10**6, "B": 10**9}
  return int(float(text[:-1]) * scale[text[-1].upper()]) if text[-1].isalpha() else int(text)


def generate(path: pathlib.Path, events: int, *, strings: bool, seed: int = 0) -> None:
  """Writes ``events`` synthetic events to one parquet file, ``CHUNK`` rows per row group."""
  if path.exists():
    return
  rng = np.random.default_rng(seed)
  users = max(1, events // 100)
  temporary = path.with_suffix(".tmp")
  writer = None
  for start in range(0, events, CHUNK):
    count = min(CHUNK, events - start)
    user = rng.integers(0, users, count)
    item = (rng.zipf(1.2, count) - 1) % NUM_ITEMS
    time_s = 1_700_000_000 + rng.integers(0, 365 * 86_400, count)
    columns = {"uid": pa.array(user), "item_id": pa.array(item), "timestamp": pa.array(time_s)}
    if strings:
      columns["uid"] = pc.binary_join_element_wise("user-", pa.array(user).cast(pa.string()), "")
      columns["item_id"] = pc.binary_join_element_wise("track-", pa.array(item).cast(pa.string()), "")
    table = pa.table(columns)
    if writer is None:
      writer = pq.ParquetWriter(temporary, table.schema)
    writer.write_table(table, row_group_size=1 << 20)
  writer.close()
  temporary.rename(path)


def _folder_bytes(folder: pathlib.Path) -> int:
  total = 0
  for root, _, names in os.walk(folder):
    for name in names:
      try:
        total += os.path.getsize(os.path.join(root, name))
      except OSError:
        pass
  return total


def run_measured(command: list[str], temp: pathlib.Path) -> dict:
  """Runs ``command`` under /usr/bin/time -v with TMPDIR=temp; wall, peak RSS, peak spill."""
  shutil.rmtree(temp, ignore_errors=True)
  temp.mkdir(parents=True)
  peak = [0]
  done = threading.Event()

  def poll():
    while not done.wait(0.5):
      peak[0] = max(peak[0], _folder_bytes(temp))

  thread = threading.Thread(target=poll, daemon=True)
  thread.start()
  start = time.perf_counter()
  result = subprocess.run(["/usr/bin/time", "-v", *command], cwd=ROOT, capture_output=True,
                          text=True, env=dict(os.environ, TMPDIR=str(temp)), check=False)
  wall = time.perf_counter() - start
  done.set()
  thread.join()
  rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", result.stderr)
  cpu = sum(float(m) for m in re.findall(r"(?:User|System) time \(seconds\): ([\d.]+)",
                                         result.stderr))
  shutil.rmtree(temp, ignore_errors=True)
  if result.returncode != 0:
    return {"error": result.stderr.strip().splitlines()[-3:], "wall_s": wall}
  return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1),
          "peak_rss_gib": round(int(rss.group(1)) / 2**20, 2),
          "spill_gib": round(peak[0] / 2**30, 2), "stdout": result.stdout.strip()}


POLARS_SCRIPT = """
import sys, polars as pl
path, out = sys.argv[1], sys.argv[2]
events = pl.scan_parquet(path).with_row_index("seq")
items = events.group_by("item_id").len().filter(pl.col("len") >= 1).select("item_id") \\
    .sort("item_id").with_row_index("item")
users = events.join(items, on="item_id", how="semi").group_by("uid").len() \\
    .sort("uid").with_row_index("user")
(events.join(users.select("uid", "user"), on="uid").join(items, on="item_id")
    .sort(["user", "timestamp", "seq"]).select("user", "item", "timestamp")
    .sink_parquet(out, engine="streaming"))
"""


def _hashes(folder: pathlib.Path) -> dict:
  return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--sizes", default="20M,100M,300M,1B")
  parser.add_argument("--string-size", default="20M", help="the size also run with string ids")
  parser.add_argument("--memory-limit", default="2GB")
  parser.add_argument("--memory-max-events", default="100M",
                      help="today's in-memory path only up to this many events")
  parser.add_argument("--polars-max-events", default="100M")
  parser.add_argument("--engines", default="duckdb,memory,polars",
                      help="engines to run (memory and polars within their max events)")
  parser.add_argument("--merge", action="store_true",
                      help="keep the rows of --out that this run does not redo")
  parser.add_argument("--work", default="/tmp/prepare_bench")
  parser.add_argument("--out", default="docs/results/prepare_bench.json")
  parser.add_argument("--plot-only", action="store_true",
                      help="redraw the plot from --out and exit")
  parser.add_argument("--share", metavar="SIZE",
                      help="instead: prepare SIZE events in --num-shards shards and print the "
                           "share of the event bytes each of P processes opens")
  parser.add_argument("--num-shards", type=int, default=8)
  parser.add_argument("--share-child", nargs=3, metavar=("FOLDER", "INDEX", "COUNT"),
                      help=argparse.SUPPRESS)  # one process of --share's RSS runs
  args = parser.parse_args(argv)
  if args.share_child:
    return share_child(pathlib.Path(args.share_child[0]), *map(int, args.share_child[1:]))
  if args.share:
    return read_share(pathlib.Path(args.work), parse_size(args.share), args.num_shards,
                      args.memory_limit)
  if args.plot_only:
    plot(json.loads((ROOT / args.out).read_text())["rows"],
         (ROOT / args.out).with_suffix(".png"))
    return 0
  work = pathlib.Path(args.work)
  work.mkdir(parents=True, exist_ok=True)
  out_path = ROOT / args.out
  rows = []
  if args.merge and out_path.exists():
    rows = json.loads(out_path.read_text())["rows"]
  wanted = args.engines.split(",")
  runs = [(parse_size(s), False) for s in args.sizes.split(",")]
  if args.string_size:
    runs.insert(1, (parse_size(args.string_size), True))
  for events, strings in runs:
    name = f"{events // 10**6}M{'-str' if strings else ''}"
    data = work / f"events-{name}.parquet"
    start = time.perf_counter()
    generate(data, events, strings=strings)
    print(f"{name}: input ready ({time.perf_counter() - start:.0f} s, "
          f"{data.stat().st_size / 2**30:.2f} GiB)", flush=True)
    base = [sys.executable, "-m", "trainer.data", "--dataset", "files", "--path", str(data),
            "--user-col", "uid", "--item-col", "item_id", "--time-col", "timestamp"]
    engines = [e for e in wanted if e == "duckdb"
               or (e == "memory" and events <= parse_size(args.memory_max_events))
               or (e == "polars" and events <= parse_size(args.polars_max_events)
                   and not strings)]
    ran = {}
    for engine in engines:
      out = work / f"out-{name}-{engine}"
      shutil.rmtree(out, ignore_errors=True)
      if engine == "polars":
        command = [sys.executable, "-c", POLARS_SCRIPT, str(data), str(out) + ".parquet"]
      else:
        command = base + ["--engine", engine, "--memory-limit", args.memory_limit,
                          "--out", str(out)]
      result = run_measured(command, work / "tmp")
      row = {"events": events, "strings": strings, "engine": engine,
             "memory_limit": args.memory_limit if engine == "duckdb" else None, **result,
             "load_avg_1m": round(os.getloadavg()[0], 1)}  # the machine is shared
      if "wall_s" in result and "error" not in result:
        row["events_per_s"] = round(events / result["wall_s"])
      rows = [r for r in rows if (r["events"], r["strings"], r["engine"])
              != (events, strings, engine)] + [row]
      ran[engine] = row
      print(json.dumps({k: v for k, v in row.items() if k != "stdout"}), flush=True)
    if "memory" in ran and "duckdb" in ran:
      same = _hashes(work / f"out-{name}-duckdb") == _hashes(work / f"out-{name}-memory")
      ran["duckdb"]["identical_to_memory"] = same
      print(f"{name}: duckdb folder byte-identical to memory: {same}", flush=True)
    for engine in engines:
      shutil.rmtree(work / f"out-{name}-{engine}", ignore_errors=True)
      pathlib.Path(str(work / f"out-{name}-{engine}") + ".parquet").unlink(missing_ok=True)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps({"machine": f"{os.cpu_count()} cores", "rows": rows},
                                   indent=2) + "\n")
  rows.sort(key=lambda r: (r["events"], r["strings"], r["engine"]))
  out_path.write_text(json.dumps({"machine": f"{os.cpu_count()} cores", "rows": rows},
                                 indent=2) + "\n")
  print("| events | ids | engine | wall s | CPU s | peak RSS GiB | spill GiB | events/s |")
  print("|---|---|---|---|---|---|---|---|")
  for row in rows:
    print(f"| {row['events']:,} | {'str' if row['strings'] else 'int'} | {row['engine']} | "
          f"{row.get('wall_s')} | {row.get('cpu_s')} | {row.get('peak_rss_gib')} | "
          f"{row.get('spill_gib')} | "
          f"{row.get('events_per_s', row.get('error'))} |")
  plot(rows, out_path.with_suffix(".png"))
  return 0


def read_share(work: pathlib.Path, events: int, num_shards: int, memory_limit: str) -> int:
  """Prints, for P in 1, 2, 4, ..., S, the share of the event bytes process p opens.

  Each process runs 8 training batches and the first and last evaluation
  batches of its pipelines (`trainer.data.pipeline`) over a folder prepared
  in S user shards; the bytes are the sizes of the shard files it opened.
  """
  sys.path.insert(0, str(ROOT))
  from trainer.data import pipeline, storage  # pylint: disable=import-outside-toplevel
  name = f"{events // 10**6}M"
  work.mkdir(parents=True, exist_ok=True)
  data_file = work / f"events-{name}.parquet"
  generate(data_file, events, strings=False)
  folder = work / f"shares-{name}-{num_shards}"
  shutil.rmtree(folder, ignore_errors=True)
  subprocess.run([sys.executable, "-m", "trainer.data", "--dataset", "files", "--path",
                  str(data_file), "--user-col", "uid", "--item-col", "item_id", "--time-col",
                  "timestamp", "--memory-limit", memory_limit, "--num-shards", str(num_shards),
                  "--out", str(folder)], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
  names = [storage.shard_file(array, s, num_shards)
           for array in storage.EVENT_ARRAYS for s in range(num_shards)]
  sizes = {n: (folder / n).stat().st_size for n in names}
  total = sum(sizes.values())
  small = sum(f.stat().st_size for f in folder.iterdir() if f.name not in sizes)
  print(f"{name} events, {num_shards} shards: {total / 2**30:.2f} GiB of event arrays; "
        f"{small / 2**20:.0f} MiB of small arrays every process reads")
  count = 1
  while count <= num_shards:
    shares = []
    for index in range(count):
      data = storage.load_prepared(folder)
      train = pipeline.train_dataset(data, seq_len=200, num_targets=1, batch_size=64, seed=0,
                                     process_index=index, process_count=count)
      for batch in range(8):
        train[batch]  # pylint: disable=pointless-statement
      evaluation = pipeline.eval_dataset(data, "test", seq_len=200, batch_size=64,
                                         max_exclude=1, process_index=index,
                                         process_count=count)
      evaluation[0], evaluation[len(evaluation) - 1]  # pylint: disable=pointless-statement
      opened = data.items.opened
      shares.append(sum(sizes[storage.shard_file(array, s, num_shards)]
                        for array in storage.EVENT_ARRAYS for s in opened) / total)
    child = subprocess.run([sys.executable, __file__, "--share-child", str(folder), "0",
                            str(count)], cwd=ROOT, check=True, capture_output=True, text=True)
    memory = json.loads(child.stdout.splitlines()[-1])
    print(f"P={count}: each process opens {min(shares):.3f} to {max(shares):.3f} of the event "
          f"bytes (1/P = {1 / count:.3f}); process 0, one epoch ({memory['batches']:,} "
          f"batches, {memory['seconds']:.0f} s): peak RSS {memory['peak_rss_mib']:,.0f} MiB, "
          f"event pages touched {memory['event_pages_mib']:,.0f} MiB", flush=True)
    count *= 2
  shutil.rmtree(folder, ignore_errors=True)
  return 0


def share_child(folder: pathlib.Path, index: int, count: int) -> int:
  """Reads one epoch of process `index` of `count`'s training batches; prints its memory (JSON).

  Peak RSS is the kernel's high-water mark (VmHWM). "Event pages" are the
  resident pages of the memory-mapped event shard files at the end of the
  epoch (summed from /proc/self/smaps): what of the event bytes this process
  actually touched.
  """
  sys.path.insert(0, str(ROOT))
  from trainer.data import pipeline, storage  # pylint: disable=import-outside-toplevel
  start = time.perf_counter()
  data = storage.load_prepared(folder)
  train = pipeline.train_dataset(data, seq_len=200, num_targets=1, batch_size=64, seed=0,
                                 num_epochs=1, process_index=index, process_count=count)
  for batch in range(len(train)):
    train[batch]  # pylint: disable=pointless-statement
  event_kib, mapping, peak_kib = 0, "", 0
  for line in pathlib.Path("/proc/self/smaps").read_text().splitlines():
    fields = line.split()
    if fields and not fields[0].endswith(":"):  # a mapping's header: address ... [path]
      mapping = fields[-1] if len(fields) >= 6 else ""
    elif fields[:1] == ["Rss:"] and mapping.startswith(str(folder)):
      if pathlib.Path(mapping).name.startswith(storage.EVENT_ARRAYS):
        event_kib += int(fields[1])
  for line in pathlib.Path("/proc/self/status").read_text().splitlines():
    if line.startswith("VmHWM:"):
      peak_kib = int(line.split()[1])
  print(json.dumps({"batches": len(train), "seconds": round(time.perf_counter() - start, 1),
                    "peak_rss_mib": round(peak_kib / 1024, 1),
                    "event_pages_mib": round(event_kib / 1024, 1)}))
  return 0


def _limit_bytes(text: str) -> int:
  """``"2GB"`` -> bytes, as ``--memory-limit`` reads it."""
  sys.path.insert(0, str(ROOT))
  from trainer.data import engine  # pylint: disable=import-outside-toplevel
  return engine.parse_memory_limit(text)


def plot(rows: list[dict], path: pathlib.Path) -> None:
  """Peak RSS against events, one line per engine (int ids)."""
  try:
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  except ImportError:
    print("matplotlib missing: no plot")
    return
  figure, axis = plt.subplots(figsize=(6, 4))
  for engine in ("memory", "duckdb", "polars"):
    points = sorted((r["events"], r["peak_rss_gib"]) for r in rows
                    if r["engine"] == engine and not r["strings"] and "peak_rss_gib" in r)
    if points:
      axis.plot(*zip(*points), marker="o", label=engine)
  limits = {r["memory_limit"] for r in rows if r["engine"] == "duckdb" and r["memory_limit"]}
  for limit in sorted(limits):
    axis.axhline(_limit_bytes(limit) / 2**30, color="gray", linestyle=":",
                 label=f"duckdb --memory-limit {limit}")
  axis.axhline(4, color="red", linestyle="--", alpha=0.5, label="goal at 1B: 4 GiB")
  axis.set_ylim(bottom=0)
  axis.set_xscale("log")
  axis.set_xlabel("events")
  axis.set_ylabel("peak RSS (GiB)")
  axis.set_title("trainer.data preparation, 2 cores")
  axis.grid(True, alpha=0.3)
  axis.legend()
  figure.tight_layout()
  figure.savefig(path, dpi=120)
  print(f"wrote {path}")


if __name__ == "__main__":
  sys.exit(main())
