"""config.loss.kind in ("sampled_softmax", "gbce", "in_batch"): `trainer/sampled.py`.

Each sampled loss equals a float64 NumPy reference computed from the full
`[T, V]` logits at the same sampled ids (masks built with Python loops, not
the module's code); gBCE reduces to BCE (t = 0 over the sampled items, and
`cutbce.dense_bce` when the negatives cover the catalog); the logQ
correction shifts the loss by the stated amount; the samplers draw what they
say; the step's negatives come from the step key (a resumed run draws the
same); the step runs on one device and on a 2 x 4 mesh that splits the table
(same loss and gradients), whose compiled program all-gathers no
table-shaped array; the config rules name the key.
"""

import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cutbce
from configs import smoke
from trainer import data as data_lib
from trainer import loop, model as model_lib, sampled
from trainer import train as train_lib
from trainer.config import keys as config_keys, mesh as config_mesh, schema

V, D, B, N, L, K = 37, 8, 3, 5, 3, 7  # T = 15 positions, nothing divides evenly.


def _inputs(seed=0):
  """hidden [B, N, D], table [V, D], bias [V], targets [B, N, L] (padding, duplicates),
  weights [B, N] (zeros)."""
  rng = np.random.default_rng(seed)
  hidden = rng.normal(size=(B, N, D)).astype(np.float32)
  table = rng.normal(size=(V, D)).astype(np.float32) * 0.7
  bias = rng.normal(size=V).astype(np.float32) * 0.3
  targets = rng.integers(0, V, size=(B, N, L)).astype(np.int32)
  targets[0, 0, 1:] = -1  # one target
  targets[0, 1, :] = -1  # none (weight 0 below)
  targets[1, 2] = [4, 4, 9]  # a duplicate counts once
  targets[2, 3, 2] = -1
  weights = np.ones((B, N), np.float32)
  weights[0, 1] = 0.0
  weights[2, 4] = 0.0
  return hidden, table, bias, targets, weights


def _hit_negatives(targets, shape, rng):
  """Uniform ids of `shape` with some forced equal to a position's target (masked)."""
  ids = rng.integers(0, V, size=shape).astype(np.int32)
  flat = targets.reshape(-1, L)
  if len(shape) == 1:
    ids[0] = flat[2, 0]  # position 2's target
  elif shape[0] == B:  # per sequence: a target of one of its positions
    for b in range(B):
      ids[b, 1] = targets[b, 2, 0]
  else:
    for t in range(0, flat.shape[0], 2):
      if flat[t, 0] >= 0:
        ids[t, 1] = flat[t, 0]
  return ids


def reference(hidden, table, bias, targets, weights, ids, valid, log_expected, *, kind,
              logq=False, beta=1.0, mean=False):
  """The sampled loss from the full float64 logits at the sampled ids (loops for masks)."""
  h = np.asarray(hidden, np.float64).reshape(-1, D)
  logits = h @ np.asarray(table, np.float64).T + np.asarray(bias, np.float64)  # [T, V]
  flat_targets = np.asarray(targets).reshape(h.shape[0], -1)
  w = np.asarray(weights, np.float64).reshape(-1)
  if np.ndim(ids) == 2 and np.shape(ids)[0] != h.shape[0]:  # per sequence: each position's
    ids, valid, log_expected = (np.repeat(np.asarray(a), h.shape[0] // np.shape(a)[0], axis=0)
                                for a in (ids, valid, log_expected))
  ids, valid, log_expected = (np.broadcast_to(np.asarray(a), (h.shape[0], np.shape(ids)[-1]))
                              for a in (ids, valid, log_expected))
  total, weight = 0.0, 0.0
  for t in range(h.shape[0]):
    positives = sorted({int(p) for p in flat_targets[t] if 0 <= p < V})
    negatives = [(logits[t, v], float(c)) for v, ok, c in zip(ids[t], valid[t], log_expected[t])
                 if ok and int(v) not in positives]
    if kind == "gbce":
      value = (beta * sum(np.logaddexp(0.0, -logits[t, p]) for p in positives)
               + sum(np.logaddexp(0.0, x) for x, _ in negatives))
    else:
      shifted = [x - c if logq else x for x, c in negatives]
      terms = [-logits[t, p] + np.log(np.exp(logits[t, p]) + sum(np.exp(shifted)))
               for p in positives]
      value = sum(terms) / max(len(positives), 1) if mean else sum(terms)
    total += w[t] * value
    weight += w[t]
  return total / weight


def _sampled(kind, **kwargs):
  return sampled.SampledLoss(kind=kind, num_negatives=kwargs.pop("k", K), **kwargs)


def _run(loss, hidden, table, bias, targets, weights, negatives):
  return sampled.sampled_loss(jnp.asarray(hidden), jnp.asarray(table), jnp.asarray(targets),
                              jnp.asarray(weights), negatives, bias=jnp.asarray(bias),
                              num_items=V, loss=loss)


CASES = [("sampled_softmax", "batch", False, "sum"), ("sampled_softmax", "position", True, "sum"),
         ("sampled_softmax", "batch", True, "mean"), ("gbce", "batch", False, "sum"),
         ("gbce", "position", False, "sum"), ("in_batch", "batch", True, "sum"),
         ("in_batch", "position", False, "mean"), ("sampled_softmax", "sequence", True, "sum"),
         ("gbce", "sequence", False, "sum")]


@pytest.fixture(params=["full", "gathered"])
def position_route(request, monkeypatch):
  """Per-position negatives' logits from all [T, V] logits (these shapes' own choice) or
  from their gathered rows (`sampled.full_logits_pay` forced off)."""
  if request.param == "gathered":
    monkeypatch.setattr(sampled, "FULL_LOGITS_RATIO", 0)
  assert sampled.full_logits_pay(V, K, D) == (request.param == "full")
  return request.param


@pytest.mark.parametrize("kind,per,logq,target_reduction", CASES)
def test_each_sampled_loss_equals_the_dense_reference(kind, per, logq, target_reduction,
                                                      position_route):
  hidden, table, bias, targets, weights = _inputs()
  rng = np.random.default_rng(1)
  shape = {"batch": (K,), "sequence": (B, K), "position": (B * N, K)}[per]
  loss = _sampled(kind, negatives_per=per, logq=logq, gbce_t=0.6,
                  target_reduction=target_reduction)
  if kind == "in_batch":
    negatives = sampled.draw_negatives(jax.random.key(3), loss, jnp.asarray(targets),
                                       num_items=V)
    assert not np.asarray(negatives.valid).all()  # padding slots were drawn, and masked
  else:
    ids = _hit_negatives(targets, shape, rng)
    log_q = rng.normal(size=shape).astype(np.float32)  # any correction: the sum uses it
    negatives = sampled.Negatives(jnp.asarray(ids), jnp.ones(shape, bool), jnp.asarray(log_q))
  value, stats = _run(loss, hidden, table, bias, targets, weights, negatives)
  beta = sampled.gbce_beta(K, V, 0.6)
  want = reference(hidden, table, bias, targets, weights, *map(np.asarray, negatives),
                   kind="gbce" if kind == "gbce" else "softmax", logq=logq, beta=beta,
                   mean=target_reduction == "mean")
  np.testing.assert_allclose(float(value), want, rtol=2e-6)
  # The counts cover the weighted distinct targets and unmasked negatives.
  positives = sum(w * len({p for p in row if p >= 0}) for w, row in
                  zip(weights.reshape(-1), targets.reshape(-1, L)))
  np.testing.assert_allclose(float(stats.tp + stats.fn), positives, rtol=1e-6)


def test_a_negative_equal_to_a_target_is_masked():
  hidden, table, bias, targets, weights = _inputs()
  loss = _sampled("sampled_softmax", k=2)
  target = int(targets[0, 0, 0])
  other = next(v for v in range(V) if v not in targets.reshape(-1))
  hit = sampled.Negatives(jnp.asarray([target, other], jnp.int32), jnp.ones(2, bool),
                          jnp.zeros(2))
  alone = sampled.Negatives(jnp.asarray([other, other], jnp.int32), jnp.asarray([True, False]),
                            jnp.zeros(2))
  one = (hidden[:1, :1], table, bias, targets[:1, :1], weights[:1, :1])  # its position
  masked = float(_run(loss, *one, hit)[0])
  np.testing.assert_allclose(masked, float(_run(loss, *one, alone)[0]), rtol=1e-6)
  # Position 0's target is a negative of the others (not masked there).
  assert float(_run(loss, hidden, table, bias, targets, weights, hit)[0]) != pytest.approx(
      float(_run(loss, hidden, table, bias, targets, weights, alone)[0]))


def test_gradients_equal_the_dense_logits_reference(position_route):
  """d loss / d (hidden, table, bias) against a jnp version of the reference on full logits."""
  hidden, table, bias, targets, weights = _inputs()
  ids = _hit_negatives(targets, (B * N, K), np.random.default_rng(2))
  negatives = sampled.Negatives(jnp.asarray(ids), jnp.ones(ids.shape, bool),
                                jnp.full(ids.shape, 0.3))
  loss = _sampled("sampled_softmax", negatives_per="position", logq=True)
  flat = targets.reshape(-1, L)
  pos = np.array([[p >= 0 and p not in row[:l] for l, p in enumerate(row)] for row in flat])
  neg = np.array([[v not in {p for p in row if p >= 0} for v in id_row]
                  for row, id_row in zip(flat, ids)])

  def dense(h, e, b):
    logits = h.reshape(-1, D) @ e.T + b  # [T, V]
    x_pos = jnp.take_along_axis(logits, jnp.maximum(flat, 0), 1)
    x_neg = jnp.take_along_axis(logits, ids, 1) - 0.3
    background = jax.nn.logsumexp(jnp.where(neg, x_neg, -jnp.inf), axis=1)
    per = jnp.sum(jnp.where(pos, jax.nn.softplus(background[:, None] - x_pos), 0.0), 1)
    return jnp.sum(weights.reshape(-1) * per) / weights.sum()

  def cut(h, e, b):
    return sampled.sampled_loss(h, e, jnp.asarray(targets), jnp.asarray(weights), negatives,
                                bias=b, num_items=V, loss=loss)[0]

  args = tuple(map(jnp.asarray, (hidden, table, bias)))
  got, want = jax.grad(cut, (0, 1, 2))(*args), jax.grad(dense, (0, 1, 2))(*args)
  for g, r in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(r), rtol=1e-5, atol=1e-6)


def test_full_logits_only_where_the_catalog_is_small_beside_k():
  assert sampled.full_logits_pay(3_417, 256, 128)  # gSASRec on MovieLens-1M
  assert not sampled.full_logits_pay(100_000, 1_024, 64)  # the 10^5 catalog benchmark
  assert not sampled.full_logits_pay(876_939, 256, 128)
  assert not sampled.full_logits_pay(37, 7, 2)  # [T, V] would outweigh [T, k, D]


@pytest.mark.parametrize("route", ["full", "gathered"])
def test_per_position_logits_take_the_route_chosen(route, monkeypatch):
  """The traced loss holds the [T, V] product, or the [T, k, D] gather, not the other."""
  if route == "gathered":
    monkeypatch.setattr(sampled, "FULL_LOGITS_RATIO", 0)
  hidden, table, bias, targets, weights = _inputs()
  ids = _hit_negatives(targets, (B * N, K), np.random.default_rng(4))
  negatives = sampled.Negatives(jnp.asarray(ids), jnp.ones(ids.shape, bool),
                                jnp.zeros(ids.shape))
  loss = _sampled("gbce", negatives_per="position")
  text = jax.jit(lambda e: _run(loss, hidden, e, bias, targets, weights, negatives)[0]).lower(
      jnp.asarray(table)).as_text()
  made = lambda op, shape: any(  # noqa: E731
      op in line and line.rstrip().endswith(f"tensor<{shape}xf32>") for line in text.splitlines())
  assert made("dot_general", f"{B * N}x{V}") == (route == "full")
  assert made("gather", f"{B * N}x{K}x{D}") == (route == "gathered")


def test_gbce_with_t_zero_is_bce_over_the_sampled_items():
  hidden, table, bias, targets, weights = _inputs()
  loss = _sampled("gbce", gbce_t=0.0)
  assert sampled.gbce_beta(K, V, 0.0) == 1.0
  ids = np.random.default_rng(4).integers(0, V, size=(B * N, K)).astype(np.int32)
  negatives = sampled.Negatives(jnp.asarray(ids), jnp.ones(ids.shape, bool), jnp.zeros(ids.shape))
  value = float(_run(loss._replace(negatives_per="position"), hidden, table, bias, targets,
                     weights, negatives)[0])
  # optax's BCE with labels 1 for the distinct targets and 0 for the non-target negatives.
  logits = np.asarray(hidden, np.float64).reshape(-1, D) @ table.T.astype(np.float64) + bias
  total = 0.0
  for t, (row, w) in enumerate(zip(targets.reshape(-1, L), weights.reshape(-1))):
    positives = sorted({p for p in row if p >= 0})
    kept = [v for v in ids[t] if v not in positives]
    chosen = np.array(positives + kept, np.int64)
    labels = np.array([1.0] * len(positives) + [0.0] * len(kept))
    total += w * float(np.sum(optax.sigmoid_binary_cross_entropy(logits[t, chosen], labels)))
  np.testing.assert_allclose(value, total / weights.sum(), rtol=2e-6)
  # With t > 0 the positives weigh beta < 1: a different loss.
  calibrated = float(_run(loss._replace(negatives_per="position", gbce_t=0.75), hidden, table,
                          bias, targets, weights, negatives)[0])
  assert calibrated < value - 1e-3


def test_gbce_with_the_catalog_as_negatives_is_dense_bce_for_every_t():
  """k = V - 1 (alpha = 1, beta = 1): every non-target item once is cutbce's full BCE."""
  hidden, table, bias, targets, weights = _inputs()
  flat = targets.reshape(-1, L)
  ids = np.array([[v for v in range(V) if v != max(row[0], 0)] for row in flat], np.int32)
  negatives = sampled.Negatives(jnp.asarray(ids), jnp.ones(ids.shape, bool), jnp.zeros(ids.shape))
  want = float(cutbce.dense_bce(jnp.asarray(hidden), jnp.asarray(table), jnp.asarray(targets),
                                jnp.asarray(weights), bias=jnp.asarray(bias),
                                vocab_reduction="sum"))
  for t in (0.0, 0.75, 1.0):
    loss = _sampled("gbce", k=V - 1, gbce_t=t, negatives_per="position")
    got = float(_run(loss, hidden, table, bias, targets, weights, negatives)[0])
    np.testing.assert_allclose(got, want, rtol=2e-6)


def test_logq_shifts_the_background_by_log_v_over_k():
  """Uniform q = 1/V: each negative's logit rises by log(V / k), so for one position with
  one target l' = softplus(softplus^-1(l) + log(V / k))."""
  hidden, table, bias, targets, weights = _inputs()
  one = (hidden[:1, :1], table, bias, targets[:1, :1], weights[:1, :1])
  for per in ("batch", "position"):
    loss = _sampled("sampled_softmax", negatives_per=per)
    negatives = sampled.draw_negatives(jax.random.key(5), loss, jnp.asarray(one[3]),
                                       num_items=V)
    np.testing.assert_allclose(np.asarray(negatives.log_expected), math.log(K / V), rtol=1e-6)
    plain = float(_run(loss, *one, negatives)[0])
    corrected = float(_run(loss._replace(logq=True), *one, negatives)[0])
    np.testing.assert_allclose(corrected, np.logaddexp(0, np.log(np.expm1(plain))
                                                       + math.log(V / K)), rtol=1e-5)


def test_in_batch_draws_the_batchs_targets_with_their_batch_frequency():
  _, _, _, targets, _ = _inputs()
  slots = targets.reshape(-1)
  every = sampled.draw_negatives(jax.random.key(0), _sampled("in_batch", k=None),
                                 jnp.asarray(targets), num_items=V)
  ids, valid, log_expected = map(np.asarray, every)
  np.testing.assert_array_equal(valid, slots >= 0)
  np.testing.assert_array_equal(ids[valid], slots[slots >= 0])
  counts = np.array([np.sum(slots == v) for v in ids[valid]])
  np.testing.assert_allclose(log_expected[valid], np.log(counts), rtol=1e-6, atol=1e-6)
  drawn = sampled.draw_negatives(jax.random.key(0), _sampled("in_batch", k=5,
                                                              negatives_per="position"),
                                 jnp.asarray(targets), num_items=V)
  ids, valid, log_expected = map(np.asarray, drawn)
  assert ids.shape == (B * N, 5) and set(ids[valid]) <= set(slots[slots >= 0])
  counts = np.array([np.sum(slots == v) for v in ids[valid]])
  np.testing.assert_allclose(log_expected[valid], np.log(5 * counts / slots.size), rtol=1e-5)


def test_popularity_sampler_draws_in_proportion_to_the_counts():
  counts = np.array([0, 5, 1, 0, 30, 4, 0, 60], np.int64)
  cumulative = jnp.asarray(sampled.cumulative_counts(counts, rows=12))  # 4 padding rows
  drawn = sampled.draw_catalog_negatives(jax.random.key(0), (20_000,), num_items=8,
                                         cumulative=cumulative)
  ids = np.asarray(drawn.ids)
  share = np.bincount(ids, minlength=8) / ids.size
  q = counts / counts.sum()
  np.testing.assert_allclose(share, q, atol=0.01)
  assert share[counts == 0].sum() == 0 and ids.max() < 8
  np.testing.assert_allclose(np.asarray(drawn.log_expected), np.log(20_000 * q[ids]), rtol=1e-5)


def test_cumulative_counts_scale_past_int32_and_keep_rare_items():
  counts = np.array([2**40, 1, 0, 3 * 2**38], np.int64)
  table = sampled.cumulative_counts(counts, rows=6)
  assert table.dtype == np.int32 and table[-1] == table[3] <= 2**31 - 1
  scaled = np.diff(np.concatenate([[0], table[:4].astype(np.int64)]))
  assert scaled[1] >= 1 and scaled[2] == 0
  np.testing.assert_allclose(scaled[3] / scaled[0], 0.75, rtol=1e-6)
  with pytest.raises(ValueError, match="every item count is 0"):
    sampled.cumulative_counts(np.zeros(3, np.int64), rows=3)


def test_train_item_counts_count_each_users_training_prefix(synthetic_prepared):
  data = synthetic_prepared
  want = np.zeros(data.num_items, np.int64)
  for user in range(data.num_users):
    start = int(data.offsets[user])
    for item in np.asarray(data.items[start:start + int(data.train_lengths[user])]):
      want[item] += 1
  np.testing.assert_array_equal(sampled.train_item_counts(data), want)
  assert want.sum() < len(data.items)  # validation and test items are left out


def test_negatives_come_from_the_step_key():
  _, _, _, targets, _ = _inputs()
  loss = _sampled("sampled_softmax", negatives_per="position")

  def draw(step):
    key = jax.random.fold_in(jax.random.fold_in(jax.random.key(0), step),
                             sampled.NEGATIVES_STREAM)
    return np.asarray(sampled.draw_negatives(key, loss, jnp.asarray(targets),
                                             num_items=V).ids)

  np.testing.assert_array_equal(draw(3), draw(3))
  assert (draw(3) != draw(4)).any()


# --------------------------------------------------------------------------- #
# The trainer step.                                                            #
# --------------------------------------------------------------------------- #


def _mesh_config(data_dir, mesh):
  config = smoke.get_config()
  config.data.prepared_dir = data_dir
  config.model.item_bias = True
  config.model.dropout_rate = 0.0
  if mesh == "2x4":
    config.mesh.axis_names, config.mesh.shape = ("data", "model"), (2, 4)
    config.mesh.token_axes, config.mesh.vocab_axis = ("data", "model"), "model"
  else:
    config.mesh.shape = (1,)
  return config


STEP_KINDS = [dict(kind="sampled_softmax", sampler="popularity", logq=True,
                   negatives_per="position"),
              dict(kind="gbce", negatives_per="batch"),
              dict(kind="in_batch", logq=True, negatives_per="batch", num_negatives=None),
              dict(kind="sampled_softmax", negatives_per="sequence", exclude="window")]


@pytest.fixture(scope="module")
def smoke_batch(tmp_path_factory, smoke_data_dir):
  config = _mesh_config(smoke_data_dir, "1")
  data = loop.prepare_data(config, str(tmp_path_factory.mktemp("work")))
  batch = next(data_lib.train_iterator(
      data, seq_len=config.seq_len, num_targets=config.num_targets,
      batch_size=config.batch_size, seed=config.seed, num_threads=1, prefetch_buffer_size=1))
  return data, batch


def _step_loss_and_grads(config, data, batch, step):
  """The step's loss, stats and gradients on `config`'s mesh, params from seed 0."""
  mesh = config_mesh.make_mesh(config, jax.devices()[:math.prod(config.mesh.shape)])
  shards = config_mesh.vocab_shard_count(config)
  graphdef, _, _, state, _ = train_lib.create_sharded_state(
      config, num_items=data.num_items, mesh=mesh, vocab_shards=1)
  settings = train_lib.step_settings(config, mesh=mesh, num_items=data.num_items)
  rows = model_lib.padded_vocab_size(data.num_items, shards)
  tables = train_lib.sampler_tables(settings, sampled.train_item_counts(data), rows)
  sharding = train_lib.batch_sharding(mesh, config.mesh.token_axes)
  key = jax.random.fold_in(jax.random.key(config.seed), step)
  params = state["params"]
  if shards > 1:  # The same values on the padded, split table (padding rows unused).
    params = jax.tree.map(np.asarray, params)
    embedding = params["item_embedding"]["embedding"]
    params["item_embedding"]["embedding"] = np.pad(embedding, ((0, rows - len(embedding)),
                                                               (0, 0)))
    params["item_bias"]["bias"] = np.pad(params["item_bias"]["bias"], (0, rows - data.num_items))
    graphdef = train_lib.plan_sharded_state(config, num_items=data.num_items, mesh=mesh,
                                            vocab_shards=shards).graphdef

  def loss(params, batch, tables):
    return train_lib._loss_and_stats(  # pylint: disable=protected-access
        params, graphdef, batch, key, settings, tables)

  fn = jax.jit(jax.value_and_grad(loss, has_aux=True))
  (value, stats), grads = fn(params, data_lib.to_global_arrays(batch, sharding), tables)
  return jax.device_get((value, stats, grads))


@pytest.mark.parametrize("options", STEP_KINDS,
                         ids=lambda o: o["kind"] + "-" + o.get("negatives_per", ""))
def test_the_step_on_one_device_equals_the_2x4_mesh(smoke_data_dir, smoke_batch, options):
  data, batch = smoke_batch
  results = {}
  for mesh in ("1", "2x4"):
    config = _mesh_config(smoke_data_dir, mesh)
    config.loss.update(**{"num_negatives": 16, **options})
    config_mesh.check_config(config, device_count=math.prod(config.mesh.shape))
    results[mesh] = _step_loss_and_grads(config, data, batch, step=7)
  one, split = results["1"], results["2x4"]
  assert np.isfinite(one[0]) and one[0] > 0
  np.testing.assert_allclose(split[0], one[0], rtol=1e-5)
  np.testing.assert_allclose(np.asarray(split[1]), np.asarray(one[1]), rtol=1e-5)
  largest = max(float(np.abs(g).max()) for g in jax.tree.leaves(one[2]))
  for (path, want), got in zip(jax.tree.leaves_with_path(one[2]), jax.tree.leaves(split[2])):
    got = np.asarray(got)[:np.shape(want)[0]] if np.ndim(want) else got
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5 * largest,
                               err_msg=jax.tree_util.keystr(path))
  # Another step draws other negatives.
  config = _mesh_config(smoke_data_dir, "1")
  config.loss.update(**{"num_negatives": 16, **options})
  if options.get("num_negatives", 16) is not None:
    assert _step_loss_and_grads(config, data, batch, step=8)[0] != one[0]


def _collectives(text):
  """(op, result shape text) of every collective of a compiled program."""
  pattern = re.compile(r"^\s*%\S+ = (.*?) (all-gather|all-reduce|reduce-scatter|all-to-all|"
                       r"collective-permute)(?:-start)?\(")
  return [(m.group(2), m.group(1)) for line in text.splitlines() if (m := pattern.match(line))]


@pytest.mark.parametrize("per", ["batch", "position"])
def test_the_split_table_is_never_all_gathered(per):
  """The compiled 2 x 4 step gathers rows from each vocab shard: no all-gather of a
  [V, D] (or [V]) array, and the rows' gradient is summed per shard ([V / 4, D])."""
  config = _mesh_config(None, "2x4")
  config.loss.update(kind="sampled_softmax", sampler="popularity", negatives_per=per,
                     num_negatives=32, logq=True)
  num_items = 301
  mesh = config_mesh.make_mesh(config)
  plan = train_lib.plan_sharded_state(config, num_items=num_items, mesh=mesh, vocab_shards=4)
  settings = train_lib.step_settings(config, mesh=mesh, num_items=num_items)
  rows = model_lib.padded_vocab_size(num_items, 4)  # 304
  tables = train_lib.sampler_tables(settings, np.arange(1, num_items + 1), rows)
  step = train_lib.jit_train_step(plan.graphdef, plan.tx, plan.schedule, settings,
                                  plan.shardings, tables)
  shape = (config.batch_size, config.seq_len)
  batch = {"inputs": jax.ShapeDtypeStruct(shape, jnp.int32),
           "targets": jax.ShapeDtypeStruct(shape + (config.num_targets,), jnp.int32),
           "weights": jax.ShapeDtypeStruct(shape, jnp.float32)}
  ops = _collectives(step.lower(plan.abstract, batch).compile().as_text())
  gathered = [result for op, result in ops if op == "all-gather"]
  assert gathered and not any(re.search(rf"\[{rows}\b", result) for result in gathered), gathered
  # The shard's rows' gradient [V / 4, D] summed over "data" (the shard_map's transpose).
  assert any(f"f32[{rows // 4},{config.model.dim}]" in result for op, result in ops
             if op == "all-reduce"), ops


def test_the_trainer_trains_and_resumes_a_sampled_loss(smoke_data_dir, tmp_path):
  """Popularity-sampled softmax per position with logQ on the 2 x 4 mesh: 6 steps in one
  go equal 3 + resume + 3 (the negatives come from the step key), and the loss falls."""
  config = _mesh_config(smoke_data_dir, "2x4")
  config.model.dropout_rate = 0.1
  config.loss.update(kind="sampled_softmax", sampler="popularity", logq=True,
                     negatives_per="position", num_negatives=16)
  config.train_steps, config.checkpoint_every, config.eval_every = 6, 3, 1_000
  config.eval.max_batches, config.log_every = 1, 1
  once = loop.train_and_evaluate(config, str(tmp_path / "once"))
  config.train_steps = 3
  loop.train_and_evaluate(config, str(tmp_path / "split"))
  config.train_steps = 6
  split = loop.train_and_evaluate(config, str(tmp_path / "split"))
  assert split["final_loss"] == once["final_loss"] and np.isfinite(once["final_loss"])
  jax.tree.map(np.testing.assert_array_equal, loop.final_params(str(tmp_path / "once")),
               loop.final_params(str(tmp_path / "split")))
  records = [json.loads(line) for line in (tmp_path / "once" / "metrics.jsonl").open()]
  losses = [r["loss"] for r in records if r["kind"] == "train"]
  assert len(losses) == 6 and all(np.isfinite(losses))


class _Built(Exception):
  """Stops the trainer once the mesh is made (the advice is said before the data)."""


@pytest.mark.parametrize("kind,item_bias,said", [
    ("gbce", False, True), ("gbce", True, False), ("bce", False, False),
    ("sampled_softmax", False, False)])
def test_the_trainer_names_gbces_missing_item_bias(smoke_data_dir, tmp_path, monkeypatch,
                                                     capsys, kind, item_bias, said):
  """gBCE without an item bias gets one line at start naming the fix; nothing else does."""
  config = _mesh_config(smoke_data_dir, "2x4")
  config.model.item_bias = item_bias
  config.loss.update(kind=kind, num_negatives=16)

  def stop(*args, **kwargs):
    raise _Built

  monkeypatch.setattr(loop, "prepare_data", stop)
  with pytest.raises(_Built):
    loop.train_and_evaluate(config, str(tmp_path / "run"))
  lines = [line for line in capsys.readouterr().out.splitlines() if "item_bias" in line]
  assert lines == (["note: loss.kind='gbce' without model.item_bias=True learns little (its "
                    "negatives collapse the item table onto one direction; on MovieLens-1M it "
                    "stayed near the popularity ranking); set model.item_bias=True "
                    "(docs/trainer.md, 'Sampled losses')"] if said else [])


# --------------------------------------------------------------------------- #
# Config.                                                                      #
# --------------------------------------------------------------------------- #

EIGHT = config_keys.Context(8)


@pytest.mark.parametrize("change,message", [
    (dict(kind="sampled"), "config.loss.kind='sampled': one of 'bce', 'softmax_ce', "
     "'sampled_softmax', 'gbce', 'in_batch'"),
    (dict(kind="gbce", gbce_t=1.5), "config.loss.gbce_t=1.5: a finite number in [0, 1]"),
    (dict(kind="gbce", num_negatives=0), "config.loss.num_negatives=0: None or an integer >= 1"),
    (dict(kind="sampled_softmax", negatives_per="user"), "config.loss.negatives_per='user': "
     "one of 'batch', 'sequence', 'position'"),
    (dict(kind="in_batch", negatives_per="sequence"), "config.loss.kind='in_batch': "
     "'sampled_softmax' or 'gbce' to use config.loss.negatives_per='sequence'"),
    (dict(kind="sampled_softmax", negatives_per="position", exclude="window"),
     "config.loss.kind='sampled_softmax': 'bce', 'softmax_ce', or 'sampled_softmax' or 'gbce' "
     "with config.loss.negatives_per='sequence' to use config.loss.exclude='window'"),
    (dict(kind="gbce", num_negatives=None), "config.loss.num_negatives=None: an integer >= 1 "
     "with config.loss.kind='gbce'"),
    (dict(kind="in_batch", num_negatives=None, negatives_per="position"),
     "config.loss.num_negatives=None: an integer >= 1 with config.loss.negatives_per="),
    (dict(kind="in_batch", sampler="popularity"), "config.loss.sampler='popularity': "
     "'uniform' with config.loss.kind='in_batch'"),
    (dict(kind="gbce", logq=True), "config.loss.logq=True: False with config.loss.kind='gbce'"),
    (dict(kind="bce", logq=True), "config.loss.logq=True: False with config.loss.kind='bce'"),
    (dict(kind="gbce", focal_gamma=2.0), "config.loss.kind='gbce': 'bce' or 'softmax_ce' to "
     "use config.loss.focal_gamma"),
    (dict(kind="sampled_softmax", exclude="window"), "config.loss.kind='sampled_softmax': "
     "'bce', 'softmax_ce', or 'sampled_softmax' or 'gbce' with"),
    (dict(kind="in_batch", vocab_reduction="mean"), "config.loss.kind='in_batch': 'bce' or "
     "'softmax_ce' to use config.loss.vocab_reduction='mean'"),
    (dict(kind="gbce", target_reduction="mean"), "config.loss.target_reduction='mean': 'sum' "
     "with config.loss.kind='gbce'"),
])
def test_config_errors_name_the_key(change, message):
  config = smoke.get_config()
  config.loss.update(**change)
  with pytest.raises(schema.ConfigError) as excinfo:
    config_keys.check(config, EIGHT)
  assert str(excinfo.value).startswith(message), excinfo.value


@pytest.mark.parametrize("change", [
    dict(kind="sampled_softmax", sampler="popularity", logq=True, target_reduction="mean"),
    dict(kind="gbce", sampler="popularity", negatives_per="position", gbce_t=0.0),
    dict(kind="in_batch", num_negatives=None, logq=True),
    dict(kind="sampled_softmax", negatives_per="sequence", exclude="window", num_negatives=64)])
def test_good_sampled_configs_pass(change):
  config = smoke.get_config()
  config.loss.update(**change)
  config_keys.check(config, EIGHT)


def test_gbce_needs_fewer_negatives_than_items():
  config = smoke.get_config()
  config.loss.update(kind="gbce", num_negatives=300)
  with pytest.raises(schema.ConfigError, match=r"^config\.loss\.num_negatives=300: at most "
                     r"V - 1 = 299 with gbce, the other items of the 300"):
    train_lib.step_settings(config, mesh=None, num_items=300)
  assert train_lib.step_settings(config, mesh=None, num_items=301).sampled.num_negatives == 300


@pytest.mark.parametrize("num_negatives", [5_000, 10**6])
def test_gbce_past_the_catalog_is_one_line_after_preparation(smoke_config, tmp_path,
                                                             num_negatives):
  """Issue 41: a traceback of 28 lines once the data was prepared; a ConfigError now
  (`trainer.main` prints it as one `bad config:` line), before any state is built."""
  from trainer import loop  # pylint: disable=import-outside-toplevel
  smoke_config.loss.update(kind="gbce", num_negatives=num_negatives, vocab_reduction="sum")
  with pytest.raises(schema.ConfigError, match=rf"^config\.loss\.num_negatives={num_negatives}"
                     r": at most V - 1 = \d+ with gbce"):
    loop.train_and_evaluate(smoke_config, str(tmp_path))
  assert not (tmp_path / "config.json").exists()


def test_popularity_step_needs_its_table():
  config = smoke.get_config()
  config.loss.update(kind="sampled_softmax", sampler="popularity")
  settings = train_lib.step_settings(config, mesh=None, num_items=300)
  assert train_lib.needs_item_counts(settings)
  with pytest.raises(ValueError, match="needs the item counts"):
    train_lib.jit_train_step(None, None, None, settings, None)


def test_sequence_negatives_are_distinct_and_outside_the_window():
  # SASRec+'s draw: k distinct items per sequence, none of its window's;
  # where fewer than k are allowed, the rest are masked.
  window = np.full((3, 40), -1, np.int32)
  window[0, :5] = [3, 3, 7, 36, 0]  # a repeat, the last item, padding after
  window[1, :34] = np.arange(34)  # 3 items left: 34, 35, 36
  loss = _sampled("sampled_softmax", k=5, negatives_per="sequence", exclude_window=True)
  targets = np.zeros((3, 4, 1), np.int32)
  draws = sampled.draw_negatives(jax.random.key(0), loss, jnp.asarray(targets), num_items=V,
                                 window=jnp.asarray(window))
  ids, valid = np.asarray(draws.ids), np.asarray(draws.valid)
  assert ids.shape == (3, 5)
  for row, ok, items in zip(ids, valid, window):
    assert len(set(row.tolist())) == 5
    outside = ~np.isin(row, items[items >= 0])
    np.testing.assert_array_equal(ok, outside)
  assert valid[0].all() and valid[2].all() and sorted(ids[1][valid[1]]) == [34, 35, 36]
  np.testing.assert_allclose(np.asarray(draws.log_expected), math.log(5 / V), rtol=1e-6)
  # Without exclude_window the window is not read.
  plain = sampled.draw_negatives(jax.random.key(0), loss._replace(exclude_window=False),
                                 jnp.asarray(targets), num_items=V, window=jnp.asarray(window))
  assert np.asarray(plain.valid).all()


def test_sequence_negatives_are_uniform_or_by_popularity():
  # Uniform: every allowed item in a k-subset with probability k / allowed.
  draws = 4000
  loss = _sampled("sampled_softmax", k=6, negatives_per="sequence", exclude_window=True)
  window = np.tile(np.array([[0, 1, 2]], np.int32), (draws, 1))
  got = sampled.draw_negatives(jax.random.key(1), loss, jnp.zeros((draws, 1, 1), jnp.int32),
                               num_items=V, window=jnp.asarray(window))
  freq = np.bincount(np.asarray(got.ids).ravel(), minlength=V) / draws
  assert freq[:3].sum() == 0
  np.testing.assert_allclose(freq[3:], 6 / (V - 3), atol=0.03)
  # Popularity, one draw a sequence: in proportion to the counts.
  counts = np.arange(1, V + 1)
  cumulative = sampled.cumulative_counts(counts, V)
  one = loss._replace(num_negatives=1, sampler="popularity", exclude_window=False)
  got = sampled.draw_negatives(jax.random.key(2), one, jnp.zeros((draws, 1, 1), jnp.int32),
                               num_items=V, cumulative=jnp.asarray(cumulative))
  freq = np.bincount(np.asarray(got.ids).ravel(), minlength=V) / draws
  np.testing.assert_allclose(freq, counts / counts.sum(), atol=0.012)
  np.testing.assert_allclose(np.asarray(got.log_expected),
                             np.log(counts / counts.sum())[np.asarray(got.ids)], rtol=1e-5)


def test_the_routes_benchmark_times_both_and_they_agree(tmp_path):
  from benchmarks import sampled_logits  # pylint: disable=import-outside-toplevel
  out = tmp_path / "routes.json"
  report = sampled_logits.main(["--batch", "2", "--seq", "3", "--k", "5", "--dim", "8",
                                "--vocab", "23", "--repeats", "1", "--out", str(out)])
  assert report["auto_route"] == "full" and set(report["routes"]) == {"full", "gathered"}
  assert report["max_relative_gap"] < 1e-5
  assert json.loads(out.read_text())["shape"]["tokens"] == 6
  assert sampled.FULL_LOGITS_RATIO == 32  # restored after each forced trace
