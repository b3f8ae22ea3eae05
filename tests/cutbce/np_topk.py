"""A float64 NumPy oracle for top-k retrieval, and the check every top-k test uses."""

from __future__ import annotations

from typing import NamedTuple

import jax.numpy as jnp
import numpy as np


class Oracle(NamedTuple):
  """scores [T, V] float64 (every row of the table), eligible [T, V] bool."""

  scores: np.ndarray
  eligible: np.ndarray


def as_float64(x):
  """The values a JAX op sees (float32- or bfloat16-rounded), in float64."""
  return None if x is None else np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def oracle(hidden, table, *, bias=None, exclude=None, num_items=None, soft_cap=None) -> Oracle:
  """Scores and eligibility from the same rounded inputs, written from the math."""
  table = as_float64(table)
  hidden = as_float64(hidden).reshape(-1, table.shape[1])
  vocab = table.shape[0]
  num_items = vocab if num_items is None else num_items
  scores = hidden @ table.T
  if bias is not None:
    scores = scores + as_float64(bias)[None]
  if soft_cap is not None:
    scores = soft_cap * np.tanh(scores / soft_cap)
  scores = np.where(np.isnan(scores), -np.inf, scores)  # top_k's rule: a NaN score is -inf
  eligible = np.zeros(scores.shape, bool)
  eligible[:, :num_items] = True
  if exclude is not None:
    for row, ids in enumerate(np.asarray(exclude).reshape(scores.shape[0], -1)):
      eligible[row, ids[(ids >= 0) & (ids < num_items)]] = False
  return Oracle(scores, eligible)


def expected(ref: Oracle, k: int):
  """(scores [T, k], ids [T, k]): eligible items by (score desc, id asc)."""
  ids = np.stack([
      np.lexsort((np.arange(s.size), -s, ~e))[:k] for s, e in zip(ref.scores, ref.eligible)
  ])
  return np.take_along_axis(ref.scores, ids, axis=1), ids


def assert_top_k(got, ref: Oracle, k: int, *, atol: float = 0.0):
  """Checks (scores, ids) of any leading shape against the oracle.

  atol = 0: scores and ids exactly (inputs whose logits are exact, e.g. small
  integers, so ties are real ties). atol > 0: every returned id is eligible and
  distinct, its score is its item's score and the k-th best scores match, all
  within atol; ids are compared exactly only at slots whose score is more than
  2 atol away from every other eligible score of the row (no near-tie).
  """
  got_scores, got_ids = (np.asarray(a) for a in got)
  assert got_scores.dtype == np.float32 and got_ids.dtype == np.int32
  assert got_scores.shape == got_ids.shape and got_scores.shape[-1] == k
  got_scores = got_scores.reshape(-1, k).astype(np.float64)
  got_ids = got_ids.reshape(-1, k)
  want_scores, want_ids = expected(ref, k)
  if atol == 0:
    np.testing.assert_array_equal(got_ids, want_ids)
    np.testing.assert_array_equal(got_scores, want_scores)
    return
  rows = np.arange(got_ids.shape[0])[:, None]
  assert np.all(ref.eligible[rows, got_ids]), "an ineligible id was returned"
  assert all(len(set(r)) == k for r in got_ids.tolist()), "repeated ids"
  np.testing.assert_allclose(got_scores, ref.scores[rows, got_ids], atol=atol, rtol=0)
  np.testing.assert_allclose(got_scores, want_scores, atol=atol, rtol=0)
  for row in range(got_ids.shape[0]):
    others = ref.scores[row][ref.eligible[row]]
    for slot in range(k):
      gaps = np.abs(others - want_scores[row, slot])
      if np.sum(gaps <= 2 * atol) == 1:  # only the item itself is that close
        assert got_ids[row, slot] == want_ids[row, slot], (row, slot)
