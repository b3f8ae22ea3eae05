"""rank_metrics against values computed by hand."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import cutbce

LOG2 = np.log2


def test_single_target_rows():
  ranks = jnp.array([[1], [3], [12], [0]])  # the last row has no target
  m = cutbce.rank_metrics(ranks, ks=(1, 10))
  assert float(m["num_rows"]) == 3
  np.testing.assert_allclose(float(m["hit@1"]), 1 / 3, rtol=1e-6)
  np.testing.assert_allclose(float(m["hit@10"]), 2 / 3, rtol=1e-6)
  np.testing.assert_allclose(float(m["recall@10"]), 2 / 3, rtol=1e-6)
  np.testing.assert_allclose(float(m["ndcg@10"]), (1 + 1 / LOG2(4)) / 3, rtol=1e-6)
  np.testing.assert_allclose(float(m["mrr"]), (1 + 1 / 3 + 1 / 12) / 3, rtol=1e-6)


def test_multi_target_rows_and_k_larger_than_targets():
  # Row 0: targets at ranks 2 and 5 (one padding). Row 1: ranks 1, 2, 30.
  ranks = jnp.array([[2, 0, 5], [1, 2, 30]])
  m = cutbce.rank_metrics(ranks, ks=(1, 3, 10))
  # k=1: row 0 has 0 hits of min(2,1)=1; row 1 has 1 of 1.
  np.testing.assert_allclose(float(m["recall@1"]), (0 + 1) / 2, rtol=1e-6)
  np.testing.assert_allclose(float(m["ndcg@1"]), (0 + 1) / 2, rtol=1e-6)
  # k=3: row 0: 1 hit / min(2,3)=2; row 1: 2 hits / 3.
  np.testing.assert_allclose(float(m["recall@3"]), (1 / 2 + 2 / 3) / 2, rtol=1e-6)
  dcg0, idcg0 = 1 / LOG2(3), 1 + 1 / LOG2(3)
  dcg1, idcg1 = 1 + 1 / LOG2(3), 1 + 1 / LOG2(3) + 1 / LOG2(4)
  np.testing.assert_allclose(float(m["ndcg@3"]), (dcg0 / idcg0 + dcg1 / idcg1) / 2, rtol=1e-6)
  # k=10 is larger than every row's number of targets.
  np.testing.assert_allclose(float(m["recall@10"]), (2 / 2 + 2 / 3) / 2, rtol=1e-6)
  dcg0 = 1 / LOG2(3) + 1 / LOG2(6)
  np.testing.assert_allclose(float(m["ndcg@10"]), (dcg0 / idcg0 + dcg1 / idcg1) / 2, rtol=1e-6)
  np.testing.assert_allclose(float(m["hit@1"]), 0.5, rtol=1e-6)
  np.testing.assert_allclose(float(m["mrr"]), (1 / 2 + 1) / 2, rtol=1e-6)


def test_leading_dims_are_rows_and_empty_input_gives_zeros():
  ranks = jnp.array([[[1, 0]], [[0, 0]]])
  m = cutbce.rank_metrics(ranks, ks=(10,))
  assert float(m["num_rows"]) == 1 and float(m["ndcg@10"]) == 1.0
  m = cutbce.rank_metrics(jnp.zeros((3, 2), jnp.int32), ks=(10,))
  assert float(m["num_rows"]) == 0 and float(m["hit@10"]) == 0.0


@pytest.mark.parametrize("ranks,ks,error", [
    (jnp.array([[1.0]]), (10,), TypeError),
    (jnp.array([[1]]), (0,), ValueError),
    (jnp.array(1), (10,), ValueError),
])
def test_bad_input(ranks, ks, error):
  with pytest.raises(error):
    cutbce.rank_metrics(ranks, ks=ks)
