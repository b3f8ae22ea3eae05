"""A float64 NumPy oracle: loss, gradients, stats and ranks, written from the math."""

from __future__ import annotations

import numpy as np


def _masks(targets, exclude, vocab, num_items=None):
  num_items = vocab if num_items is None else num_items
  t = targets.shape[0]
  labels = np.zeros((t, vocab), bool)
  for row, ids in enumerate(targets):
    ids = ids[(ids >= 0) & (ids < num_items)]
    labels[row, ids] = True
  counted = np.ones((t, vocab), bool)
  if exclude is not None:
    for row, ids in enumerate(exclude):
      ids = ids[(ids >= 0) & (ids < num_items)]
      counted[row, ids] = False
    counted |= labels  # ids that are also targets stay targets
  counted[:, num_items:] = False  # padding rows are never counted
  return labels, counted


def elementwise(x, y, *, pos_weight=None, label_smoothing=0.0, logit_soft_cap=None,
                focal_gamma=None, focal_alpha=None):
  """The per-logit loss with every option, float64, written from the formula via p.

      x~ = c tanh(x/c);  y' = y(1-e) + e/2;  p = sigmoid(x~)
      bce = -(w y' log p + (1 - y') log(1 - p))
      f = a_t (1 - p_t)^g bce,  p_t = y' p + (1-y')(1-p),  a_t = y' a + (1-y')(1-a)
  """
  x = np.asarray(x, np.float64)
  if logit_soft_cap is not None:
    x = logit_soft_cap * np.tanh(x / logit_soft_cap)
  y = np.asarray(y, np.float64) * (1 - label_smoothing) + label_smoothing / 2
  w = 1.0 if pos_weight is None else pos_weight
  log_p, log_not_p = -np.logaddexp(0.0, -x), -np.logaddexp(0.0, x)
  loss = -(w * y * log_p + (1 - y) * log_not_p)
  if focal_gamma:
    p = np.exp(log_p)
    p_t = y * p + (1 - y) * (1 - p)
    loss = (1 - p_t) ** focal_gamma * loss
  if focal_alpha is not None:
    loss = (y * focal_alpha + (1 - y) * (1 - focal_alpha)) * loss
  return loss


def elementwise_grad(x, y, **options):
  """d elementwise / dx by central differences in float64 (error ~1e-9)."""
  step = 1e-5
  return (elementwise(x + step, y, **options) - elementwise(x - step, y, **options)) / (2 * step)



def logits_of(hidden, table, bias=None):
  h = np.asarray(hidden, np.float64).reshape(-1, hidden.shape[-1])
  x = h @ np.asarray(table, np.float64).T
  if bias is not None:
    x = x + np.asarray(bias, np.float64)[None]
  return h, x


def bce(hidden, table, targets, weights=None, *, bias=None, exclude=None,
        reduction="mean", vocab_reduction="mean", upstream=None, num_items=None, **options):
  """Returns (loss, grads dict(hidden, table, bias), stats tuple) in float64.

  `upstream` is the cotangent of the output (scalar, or leading-shaped for
  reduction="none"; default 1 / ones). `options` are the loss variants
  (`elementwise`); rows at or past `num_items` are padding.
  """
  leading = hidden.shape[:-1]
  table64 = np.asarray(table, np.float64)
  vocab = table64.shape[0]
  num_items = vocab if num_items is None else num_items
  h, x = logits_of(hidden, table, bias)
  t = h.shape[0]
  labels, counted = _masks(np.asarray(targets).reshape(t, -1),
                           None if exclude is None else np.asarray(exclude).reshape(t, -1),
                           vocab, num_items)
  w = np.ones(t) if weights is None else np.asarray(weights, np.float64).reshape(t)
  # A position of weight 0 is dropped whatever its hidden row holds.
  x = np.where((w != 0)[:, None], x, 0.0)
  h = np.where((w != 0)[:, None], h, 0.0)
  per_token = np.sum(np.where(counted, elementwise(x, labels, **options), 0.0), axis=1)
  scale = 1.0 / num_items if vocab_reduction == "mean" else 1.0
  per_token = per_token * scale
  if reduction == "none":
    loss = (w * per_token).reshape(leading)
    up = np.ones(t) if upstream is None else np.asarray(upstream, np.float64).reshape(t)
    g = up * w * scale
  elif reduction == "sum":
    loss = np.sum(w * per_token)
    g = (1.0 if upstream is None else upstream) * w * scale
  else:
    total = w.sum()
    loss = np.sum(w * per_token) / total if total != 0 else 0.0
    g = (1.0 if upstream is None else upstream) * (w / total if total != 0 else 0 * w) * scale
  dx = np.where(counted, elementwise_grad(x, labels, **options), 0.0) * g[:, None]
  grads = dict(
      hidden=(dx @ table64).reshape(hidden.shape),
      table=dx.T @ h,
      bias=dx.sum(0),
  )
  predicted = x > 0
  stats = tuple(
      float(np.sum(w * np.sum(counted & p & l, axis=1)))
      for p, l in ((predicted, labels), (predicted, ~labels), (~predicted, labels), (~predicted, ~labels))
  )
  return loss, grads, stats


def ranks(hidden, table, targets, *, bias=None, exclude=None, num_items=None, logit_soft_cap=None):
  """int [..., L]: 1 + #{counted v != p : x_tv >= x_tp} by sorting each row; 0 for padding/repeats.

  Ties count against the target; a NaN target ranks after every counted item,
  a NaN item after every number.
  """
  # Row by row, a product summed over D: identical table rows give identical
  # logits (a BLAS matmul may round them apart by their position).
  h = np.asarray(hidden, np.float64).reshape(-1, hidden.shape[-1])
  e = np.asarray(table, np.float64)
  x = np.stack([np.sum(row[None, :] * e, axis=1) for row in h])
  if bias is not None:
    x = x + np.asarray(bias, np.float64)[None]
  if logit_soft_cap is not None:
    x = logit_soft_cap * np.tanh(x / logit_soft_cap)
  t, vocab = x.shape
  num_items = vocab if num_items is None else num_items
  targets2 = np.asarray(targets).reshape(t, -1)
  _, counted = _masks(targets2, None if exclude is None else np.asarray(exclude).reshape(t, -1),
                      vocab, num_items)
  out = np.zeros(targets2.shape, np.int64)
  for row in range(t):
    values = x[row, counted[row]]
    ordered = np.sort(values[~np.isnan(values)])  # ascending, NaN items dropped
    seen = set()
    for k, item in enumerate(targets2[row]):
      if not 0 <= item < num_items or item in seen:
        continue
      seen.add(item)
      if np.isnan(x[row, item]):
        out[row, k] = int(np.sum(counted[row]))  # after every item (itself counted once)
        continue
      # Items at or above x (itself among them, once): count from the first value >= x.
      at_or_above = len(ordered) - np.searchsorted(ordered, x[row, item], side="left")
      out[row, k] = at_or_above
  return out.reshape(targets.shape)


def softmax_ce(hidden, table, targets, weights=None, bias=None, exclude=None, num_items=None,
               reduction="mean", label_smoothing=0.0, target_reduction="sum"):
  """`cut_softmax_ce` in float64, token by token: (loss, (dh, dE, db), (tp, fp, fn, tn)).

  l_t = -sum_{v in S_t} q_tv log softmax_S(x_t)_v with the target
  distribution q_tv = (1 - e) r [v in P_t] + e k [v in S_t] / |S_t|
  ((k, r) = (n_t, 1) summing over targets, (1, 1/n_t) averaging); its
  gradient in x_tv is k p_tv - q_tv.
  """
  total, d_logits, counts = softmax_logit_grads(
      hidden, table, targets, weights, bias, exclude, num_items, reduction, label_smoothing,
      target_reduction)
  h = np.asarray(hidden, np.float64).reshape(-1, np.shape(hidden)[-1])
  e = np.asarray(table, np.float64)
  grads = (d_logits @ e).reshape(np.shape(hidden)), d_logits.T @ h, d_logits.sum(0)
  return total, grads, counts


def softmax_logit_grads(hidden, table, targets, weights=None, bias=None, exclude=None,
                        num_items=None, reduction="mean", label_smoothing=0.0,
                        target_reduction="sum"):
  """(loss, `[T, V]` float64 gradient in the logits, counts) of `softmax_ce`."""
  h = np.asarray(hidden, np.float64).reshape(-1, np.shape(hidden)[-1])
  e = np.asarray(table, np.float64)
  vocab = e.shape[0]
  y = np.asarray(targets).reshape(h.shape[0], -1)
  ex = None if exclude is None else np.asarray(exclude).reshape(h.shape[0], -1)
  w = np.ones(h.shape[0]) if weights is None else np.asarray(weights, np.float64).reshape(-1)
  logits = h @ e.T + (0.0 if bias is None else np.asarray(bias, np.float64))
  labels, in_softmax = _masks(y, ex, vocab, num_items)
  losses, d_logits, counts = np.zeros(h.shape[0]), np.zeros_like(logits), np.zeros(4)
  for t in range(h.shape[0]):
    if w[t] == 0:
      continue
    items = np.flatnonzero(in_softmax[t])
    x = logits[t, items]
    top = x.max()
    log_z = top + np.log(np.exp(x - top).sum())
    p = np.exp(x - log_z)
    n = labels[t].sum()
    k, r = (n, 1.0) if target_reduction == "sum" else (float(n > 0), 1.0 / max(n, 1))
    q = (1 - label_smoothing) * r * labels[t, items] + label_smoothing * k / len(items)
    losses[t] = -(q * (x - log_z)).sum()
    grad = k * p - q
    # At a target, k p - q = -k (1 - p) + (k - q) with 1 - p summed over the
    # other items: exact in float64 even where p rounds to 1 (p = 1 - 1e-15).
    for j in np.flatnonzero(labels[t, items]):
      grad[j] = -k * np.sum(np.delete(p, j)) + (k - q[j])
    d_logits[t, items] = w[t] * grad
    predicted, positive = logits[t] > 0, labels[t]
    counted = in_softmax[t]
    counts += w[t] * np.array([np.sum(counted & predicted & positive),
                               np.sum(counted & predicted & ~positive),
                               np.sum(counted & ~predicted & positive),
                               np.sum(counted & ~predicted & ~positive)])
  total = float(np.sum(w * losses))
  if reduction == "mean":
    scale = 1.0 / w.sum() if w.sum() else 0.0
    total, d_logits = total * scale, d_logits * scale
  return total, d_logits, counts
