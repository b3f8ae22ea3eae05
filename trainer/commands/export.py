"""Export a trained run for serving: `python -m trainer.export --workdir=W --out=DIR`.

    python -m trainer.export --workdir=W --out=DIR [--checkpoint=best|latest] [--step=N]

writes the chosen checkpoint (default the best one) as plain `.npy` files
and one JSON manifest, readable by any NumPy (no pickle, no jax, no orbax):

    DIR/manifest.json        format, version, step, checkpoint, num_items V,
                             dim D, seq_len N, the model config, every file
    DIR/item_embeddings.npy  float32 [V, D]: row v is the item of dense id v
                             (the output table; the rows a vocab-sharded
                             run pads its table with are cut off)
    DIR/item_bias.npy        float32 [V], only when the model has an item bias
    DIR/item_ids.npy         int64 [V] raw id of each row (integer ids); for
                             string ids, unpadded, DIR/item_ids.utf8.npy
                             (uint8, every id's UTF-8 concatenated) and
                             DIR/item_ids.offsets.npy (int64 [V + 1]: id v is
                             utf8[offsets[v]:offsets[v + 1]]), manifest
                             dtype "utf8"
    DIR/params/<name>.npy    every model parameter, `name` its path in the
                             parameter tree joined with "." (the output
                             table is not repeated: its entry points at
                             item_embeddings.npy, the table of a model built
                             with `vocab_shards=1`; with
                             `model.output_table="separate"` the input
                             embedding is a parameter file of its own)

`DIR` must be new, empty, or an earlier export (a manifest.json of format
"cutbce-export"); a folder holding anything else (a run's prepared data, a
user's files, another tool's manifest) or a folder of the run is refused in
one line and nothing in it is touched (`trainer/workdir/outputs.py`).

`manifest["params"]` lists each parameter as `{"name": "blocks/0/mlp/up/kernel",
"file": "params/blocks.0.mlp.up.kernel.npy", "shape": [...], "dtype": "float32"}`.

Serving: the score of item v for a user is `h . item_embeddings[v]
(+ item_bias[v])`, h the SASRec hidden state at the last position of the
user's last N items (left-padded with V); the best raw ids are
`item_ids[argsort(-scores)]`. `load_export(DIR)` reads it all back; this
module imports only NumPy at the top, so it can be copied into a serving
system as is.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import numpy as np

FORMAT = "cutbce-export"
VERSION = 2
READABLE_VERSIONS = (1, 2)  # 1: string ids as a fixed-width <U item_ids.npy
STRING_IDS = "utf8"  # manifest dtype of string ids (as trainer.data.storage writes them)
MANIFEST = "manifest.json"
ITEM_TABLE_PATH = "item_embedding/embedding"  # the SASRec item table in the parameter tree
OUTPUT_TABLE_PATH = "output_embedding/embedding"  # its output table, where separate
ITEM_BIAS_PATH = "item_bias/bias"  # an item bias, if a model has one


@dataclasses.dataclass(frozen=True)
class Export:
  """An exported model, as NumPy arrays.

  Attributes:
    item_embeddings: float32 `[V, D]`.
    item_bias: float32 `[V]`, or None.
    item_ids: `[V]` raw item ids (int64, or strings: numpy `StringDType`;
      `<U` from a version 1 export).
    params: `{name: array}` of every parameter ("blocks/0/mlp/up/kernel").
    manifest: the parsed manifest.json.
  """

  item_embeddings: np.ndarray
  item_bias: np.ndarray | None
  item_ids: np.ndarray
  params: dict[str, np.ndarray]
  manifest: dict

  def top_k(self, hidden: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Brute-force `(scores [B, k], raw ids [B, k])` of hidden states `[B, D]`."""
    scores = np.asarray(hidden, np.float32) @ self.item_embeddings.T
    if self.item_bias is not None:
      scores = scores + self.item_bias
    order = np.argsort(-scores, axis=-1, kind="stable")[:, :k]
    return np.take_along_axis(scores, order, axis=-1), self.item_ids[order]


def load_export(directory: str | os.PathLike, *, mmap: bool = True) -> Export:
  """Reads a folder written by `python -m trainer.export` (NumPy only).

  Args:
    directory: the export folder.
    mmap: memory-map the arrays instead of reading them.

  Returns:
    `Export`.

  Raises:
    FileNotFoundError: no manifest.json in `directory`.
    ValueError: another format or version, a file whose shape or dtype
      differs from the manifest, or an incomplete export (arrays written,
      the manifest not: it is written last, atomically).

  Example:
    >>> exported = load_export("/tmp/export")  # doctest: +SKIP
    >>> scores, raw_ids = exported.top_k(hidden, 10)  # doctest: +SKIP
  """
  manifest_path = os.path.join(directory, MANIFEST)
  if not os.path.exists(manifest_path) and os.path.exists(
      os.path.join(directory, "item_embeddings.npy")):
    raise ValueError(f"{directory} is an incomplete export (arrays but no {MANIFEST}: an "
                     "export stopped before it finished); export again")
  with open(manifest_path, encoding="utf-8") as file:
    manifest = json.load(file)
  if manifest.get("format") != FORMAT or manifest.get("version") not in READABLE_VERSIONS:
    raise ValueError(f"{manifest_path} has format {manifest.get('format')!r} version "
                     f"{manifest.get('version')!r}; expected {FORMAT!r} version "
                     f"{' or '.join(map(str, READABLE_VERSIONS))}")

  def load(entry) -> np.ndarray:
    if entry["dtype"] == STRING_IDS:
      return _strings(np.load(os.path.join(directory, entry["file"])),
                      np.load(os.path.join(directory, entry["offsets_file"])), entry, directory)
    array = np.load(os.path.join(directory, entry["file"]), mmap_mode="r" if mmap else None)
    if list(array.shape) != entry["shape"] or str(array.dtype) != entry["dtype"]:
      raise ValueError(f"{entry['file']} in {directory} is {array.dtype} {list(array.shape)}; "
                       f"the manifest says {entry['dtype']} {entry['shape']}")
    return array

  arrays = manifest["arrays"]
  return Export(
      item_embeddings=load(arrays["item_embeddings"]),
      item_bias=load(arrays["item_bias"]) if "item_bias" in arrays else None,
      item_ids=load(arrays["item_ids"]),
      params={entry["name"]: load(entry) for entry in manifest["params"]},
      manifest=manifest)


def _flatten(tree, prefix: str = "") -> dict[str, object]:
  """`{"a/b/c": leaf}` of a nested dict (keys as strings)."""
  flat = {}
  for name, value in tree.items():
    path = f"{prefix}{name}"
    if isinstance(value, dict):
      flat.update(_flatten(value, path + "/"))
    else:
      flat[path] = value
  return flat


def _strings(utf8: np.ndarray, offsets: np.ndarray, entry: dict, directory) -> np.ndarray:
  """String ids (numpy `StringDType`) from their UTF-8 blob and offsets."""
  if (utf8.dtype != np.uint8 or utf8.ndim != 1 or offsets.ndim != 1
      or list(offsets.shape) != [entry["shape"][0] + 1] or offsets[0] != 0
      or offsets[-1] != utf8.shape[0] or np.any(np.diff(offsets) < 0)):
    raise ValueError(f"{entry['file']} and {entry['offsets_file']} in {directory} are not "
                     f"{entry['shape'][0]} ids as a uint8 blob and offsets into it")
  blob = bytes(utf8)
  return np.array([blob[a:b].decode("utf-8")
                   for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist())],
                  dtype=np.dtypes.StringDType())


def _entry(file: str, array: np.ndarray, **extra) -> dict:
  return {"file": file, "shape": list(array.shape), "dtype": str(array.dtype), **extra}


def export_run(run, out: str | os.PathLike, *, protected=()) -> dict:
  """Writes `run` (a `trainer.commands.workdir.TrainedRun`) to `out`; returns the manifest.

  `out` must be new, empty or an earlier export (its manifest tagged
  `FORMAT`), and none of `protected` (`trainer.workdir.outputs.run_paths`).

  Raises:
    ConfigError: `out` holds files an export did not write, or is a run's folder.
  """
  import jax  # pylint: disable=import-outside-toplevel
  from etils import epath  # pylint: disable=import-outside-toplevel
  from trainer.workdir import outputs  # pylint: disable=import-outside-toplevel
  outputs.check_folder(out, format_tag=FORMAT, protected=protected)
  folder = epath.Path(out)
  (folder / "params").mkdir(parents=True, exist_ok=True)
  # The manifest goes first and comes back last: an export that dies between
  # (over an older one, say) has none, and `load_export` refuses it, where it
  # would otherwise name one step and hold another step's arrays. It is set
  # aside, not deleted, so the folder stays known as an export's.
  outputs.retire_manifest(folder)
  num_items = run.data.num_items
  params = _flatten(jax.tree.map(np.asarray, jax.device_get(run.params)))

  def save(file: str, array: np.ndarray) -> None:
    with (folder / file).open("wb") as handle:
      np.save(handle, array, allow_pickle=False)

  arrays = {}
  table_path = OUTPUT_TABLE_PATH if OUTPUT_TABLE_PATH in params else ITEM_TABLE_PATH
  table = np.asarray(params[table_path][:num_items], np.float32)
  save("item_embeddings.npy", table)
  arrays["item_embeddings"] = _entry("item_embeddings.npy", table)
  if ITEM_BIAS_PATH in params:
    bias = np.asarray(params[ITEM_BIAS_PATH][:num_items], np.float32)
    save("item_bias.npy", bias)
    arrays["item_bias"] = _entry("item_bias.npy", bias)
  item_ids = np.asarray(run.data.item_ids)
  if item_ids.dtype.kind in "UT":  # unpadded: one UTF-8 blob and offsets into it
    encoded = [value.encode("utf-8") for value in item_ids.tolist()]
    offsets = np.zeros(len(encoded) + 1, np.int64)
    np.cumsum([len(raw) for raw in encoded], out=offsets[1:])
    save("item_ids.utf8.npy", np.frombuffer(b"".join(encoded), np.uint8))
    save("item_ids.offsets.npy", offsets)
    arrays["item_ids"] = {"file": "item_ids.utf8.npy", "offsets_file": "item_ids.offsets.npy",
                          "shape": [int(item_ids.shape[0])], "dtype": STRING_IDS}
  else:
    save("item_ids.npy", item_ids)
    arrays["item_ids"] = _entry("item_ids.npy", item_ids)
  entries = []
  for name, value in params.items():
    if name in (table_path, ITEM_BIAS_PATH):
      entry = dict(arrays["item_embeddings" if name == table_path else "item_bias"])
    else:
      file = "params/" + name.replace("/", ".") + ".npy"
      save(file, value)
      entry = _entry(file, value)
    entries.append({"name": name, **entry})
  config = run.config
  manifest = {
      "format": FORMAT, "version": VERSION, "workdir": str(run.workdir), "step": run.step,
      "checkpoint": run.which, "num_items": num_items, "dim": int(table.shape[1]),
      "seq_len": int(config.seq_len), "input_pad_id": num_items,
      "model": config.model.to_dict(), "arrays": arrays, "params": entries,
  }
  temporary = folder / f".{MANIFEST}.tmp-{os.getpid()}"
  temporary.write_text(json.dumps(manifest, indent=2) + "\n")
  temporary.replace(folder / MANIFEST)
  outputs.drop_retired(folder)
  return manifest


def _command(values) -> int:
  from trainer.commands import cli  # pylint: disable=import-outside-toplevel
  from trainer.commands import workdir as workdir_lib  # pylint: disable=import-outside-toplevel
  from trainer.workdir import outputs  # pylint: disable=import-outside-toplevel
  # A file, a folder of foreign files, a folder of the run or an unwritable place:
  # one line, no work, nothing deleted.
  cli.check_out_folder(values["out"], format_tag=FORMAT,
                       protected=outputs.run_paths(values["workdir"]))
  run = workdir_lib.open_run(values["workdir"], which=values["checkpoint"],
                             step=values.get("step"), say=cli.notice)
  manifest = export_run(run, values["out"],
                        protected=outputs.run_paths(run.workdir, run.data_dir))
  cli.notice(f"exported step {run.step} ({run.which}): {manifest['num_items']:,} items x "
             f"{manifest['dim']}, {len(manifest['params'])} parameters to {values['out']}")
  print(json.dumps({"out": str(values["out"]), "step": run.step, "checkpoint": run.which,
                    "num_items": manifest["num_items"], "dim": manifest["dim"]}), flush=True)
  return 0


def main(argv: list[str] | None = None) -> int:
  """`python -m trainer.export` in-process; returns the exit status."""
  from trainer.commands import cli  # pylint: disable=import-outside-toplevel
  return cli.run_command("export", _command, sys.argv if argv is None else argv)


def run() -> None:
  """The console script `cutbce-export`."""
  from trainer.commands import cli  # pylint: disable=import-outside-toplevel
  cli.app_main(main)


if __name__ == "__main__":
  run()
