"""A float64 NumPy oracle: loss, gradients, stats and ranks, written from the math."""

from __future__ import annotations

import numpy as np


def _masks(targets, exclude, vocab):
  t = targets.shape[0]
  labels = np.zeros((t, vocab), bool)
  for row, ids in enumerate(targets):
    ids = ids[(ids >= 0) & (ids < vocab)]
    labels[row, ids] = True
  counted = np.ones((t, vocab), bool)
  if exclude is not None:
    for row, ids in enumerate(exclude):
      ids = ids[(ids >= 0) & (ids < vocab)]
      counted[row, ids] = False
    counted |= labels  # ids that are also targets stay targets
  return labels, counted



def logits_of(hidden, table, bias=None):
  h = np.asarray(hidden, np.float64).reshape(-1, hidden.shape[-1])
  x = h @ np.asarray(table, np.float64).T
  if bias is not None:
    x = x + np.asarray(bias, np.float64)[None]
  return h, x


def bce(hidden, table, targets, weights=None, *, bias=None, exclude=None,
        reduction="mean", vocab_reduction="mean", upstream=None):
  """Returns (loss, grads dict(hidden, table, bias), stats tuple) in float64.

  `upstream` is the cotangent of the output (scalar, or leading-shaped for
  reduction="none"; default 1 / ones).
  """
  leading = hidden.shape[:-1]
  table64 = np.asarray(table, np.float64)
  vocab = table64.shape[0]
  h, x = logits_of(hidden, table, bias)
  t = h.shape[0]
  labels, counted = _masks(np.asarray(targets).reshape(t, -1),
                           None if exclude is None else np.asarray(exclude).reshape(t, -1), vocab)
  w = np.ones(t) if weights is None else np.asarray(weights, np.float64).reshape(t)
  softplus = np.logaddexp(0.0, x)
  per_token = np.sum(np.where(counted, softplus - labels * x, 0.0), axis=1)
  scale = 1.0 / vocab if vocab_reduction == "mean" else 1.0
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
  sigmoid = 1.0 / (1.0 + np.exp(-x))
  dx = np.where(counted, sigmoid - labels, 0.0) * g[:, None]
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


def ranks(hidden, table, targets, *, bias=None, exclude=None):
  """int [..., L]: 1 + #{counted v : x_tv > x_tp} by sorting each row; 0 for padding/repeats."""
  _, x = logits_of(hidden, table, bias)
  t, vocab = x.shape
  targets2 = np.asarray(targets).reshape(t, -1)
  _, counted = _masks(targets2, None if exclude is None else np.asarray(exclude).reshape(t, -1), vocab)
  out = np.zeros(targets2.shape, np.int64)
  for row in range(t):
    ordered = np.sort(x[row, counted[row]])[::-1]  # descending
    seen = set()
    for k, item in enumerate(targets2[row]):
      if not 0 <= item < vocab or item in seen:
        continue
      seen.add(item)
      # Items strictly larger: position of the first value <= x in descending order.
      out[row, k] = 1 + np.searchsorted(-ordered, -x[row, item], side="left")
  return out.reshape(targets.shape)
