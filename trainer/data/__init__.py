"""Data for the SASRec trainer: sources, preprocessing, splits, storage, grain.

Flow: ``load_interactions`` (raw, file order) -> ``prepare_sequences`` (count
filters, dense ids, stable time sort) -> ``make_split`` (leave-one-out or
global temporal split) -> ``write_prepared`` (``.npy`` arrays + manifest) ->
``load_prepared`` (memory-mapped) -> ``train_iterator`` / ``eval_dataset``
(grain, per process) -> ``to_global_arrays``. ``prepare_dataset`` runs the
first four steps; ``python -m trainer.data`` is its command line.

Ids: items are in ``[0, V)``; ``inputs`` are padded with V
(``input_pad_id(V)``); ``targets`` and ``exclude`` are padded with -1 (``PAD``).

Imports: NumPy, pyarrow, DuckDB, grain, ``trainer.workdir.paths`` and
``trainer.workdir.outputs`` (what an output folder may hold), and the generic
description of settings (``trainer.config.schema``, for the command's flags,
and ``trainer.config.budget``, the host's memory);
never the model, the training step or the commands.
"""

from trainer.data.checks import check_trainable
from trainer.data.pipeline import eval_dataset
from trainer.data.pipeline import to_global_arrays
from trainer.data.pipeline import train_dataset
from trainer.data.pipeline import train_iterator
from trainer.data.prepare import prepare_dataset
from trainer.data.preprocess import Sequences
from trainer.data.preprocess import prepare_sequences
from trainer.data.sources import SOURCE_NAMES
from trainer.data.sources import DataError
from trainer.data.sources import Interactions
from trainer.data.sources import load_interactions
from trainer.data.splits import Split
from trainer.data.splits import global_temporal_split
from trainer.data.splits import leave_one_out
from trainer.data.splits import make_split
from trainer.data.storage import PreparedDataset
from trainer.data.storage import load_prepared
from trainer.data.storage import write_prepared
from trainer.data.windows import PAD
from trainer.data.windows import input_pad_id
from trainer.data.windows import num_train_windows

__all__ = [
    "DataError", "Interactions", "PAD", "PreparedDataset", "SOURCE_NAMES", "Sequences",
    "Split", "check_trainable", "eval_dataset", "global_temporal_split", "input_pad_id",
    "leave_one_out", "load_interactions", "load_prepared", "make_split",
    "num_train_windows", "prepare_dataset", "prepare_sequences",
    "to_global_arrays", "train_dataset", "train_iterator", "write_prepared",
]
