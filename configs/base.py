"""Base trainer config: every field, with defaults the variants override.

Not meant to be run by itself (it trains a small synthetic set); the runnable
configs import it and change a few fields. Every field is documented here.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  # Seed of parameter init, dropout and the data shuffle.
  config.seed = 0
  # Optimizer steps to train for.
  config.train_steps = 1_000
  # Global training batch (sequences per step, all processes together).
  config.batch_size = 64
  # Global evaluation batch (users per step).
  config.eval_batch_size = 256
  # N: inputs per training window and per evaluation history.
  config.seq_len = 50
  # L: next items per position used as positive labels.
  config.num_targets = 1

  # Device mesh: axis names and sizes (product = jax.device_count()), the axes
  # that split the batch (tokens), and the axis splitting the item table by
  # rows (None = replicated table).
  config.mesh = ml_collections.ConfigDict()
  config.mesh.axis_names = ("data",)
  config.mesh.shape = (1,)
  config.mesh.token_axes = ("data",)
  config.mesh.vocab_axis = ml_collections.config_dict.placeholder(str)
  # Several TPU slices (multi-slice over DCN): of each size of mesh.shape, how
  # many slices it spans, e.g. shape (4, 4) and dcn_shape (2, 1) for 2 slices
  # of 8 chips with the data axis across them (None = one slice).
  config.mesh.dcn_shape = ml_collections.config_dict.placeholder(tuple)

  # SASRec shape; dtype is the compute dtype ("float32" or "bfloat16").
  config.model = ml_collections.ConfigDict()
  config.model.dim = 64
  config.model.num_layers = 2
  config.model.num_heads = 1
  config.model.mlp_dim = 256
  config.model.dropout_rate = 0.2
  config.model.dtype = "float32"
  # A learned logit bias per item (initialised at -log V), used by the loss,
  # the ranking, recommend and export.
  config.model.item_bias = False
  # The block ("pre_ln", or "sasrec": the original SASRec block), how positions
  # are counted ("window" slots, or "from_first" item), the initializers
  # ("flax", "sasrec_plus" or "pytorch"; `embedding_std` sets the tables'
  # normal std apart from the linear layers', None: the scheme's), the input
  # embeddings times sqrt(D), and the output table ("tied" to the input
  # embedding, or "separate").
  config.model.block = "pre_ln"
  config.model.positions = "window"
  config.model.init = "flax"
  config.model.embedding_std = None
  config.model.scale_embeddings = True
  config.model.output_table = "tied"

  # AdamW with linear warm-up, then constant or cosine decay to 0; gradient
  # clipping by global norm (None: none); weight decay on matrices only (not the item or
  # position tables, not biases or LayerNorm).
  config.optimizer = ml_collections.ConfigDict()
  config.optimizer.learning_rate = 1e-3
  config.optimizer.warmup_steps = 100
  config.optimizer.schedule = "constant"
  config.optimizer.b1 = 0.9
  config.optimizer.b2 = 0.98
  config.optimizer.weight_decay = 0.0
  config.optimizer.clip_norm = 1.0

  # Data: a `trainer.data` source, prepared once into `prepared_dir`
  # (default WORKDIR/data; local or gs://; reused when its manifest records
  # the same source, options, min counts and split). "{process}" in it is
  # replaced by the process index.
  config.data = ml_collections.ConfigDict()
  config.data.dataset = "synthetic"
  config.data.prepared_dir = ml_collections.config_dict.placeholder(str)
  # False: process 0 prepares into a folder every host reads (gs://, a shared
  # disk, or one machine) while the others wait. True: every process prepares
  # its own identical copy into `prepared_dir`, a local folder on each host.
  config.data.prepare_per_host = False
  # Files and Yambda are prepared out of core (DuckDB) under this memory limit
  # ("4GB"; None: half of the host's RAM), the event arrays cut by user into
  # `prepare_shards` files (a multiple of the process count: each process
  # then reads only its own shards).
  config.data.prepare_memory_limit = ml_collections.config_dict.placeholder(str)
  config.data.prepare_shards = 1
  # Keyword options of the source loader (sizes and seed for synthetic, path
  # for yambda, cache_dir for MovieLens, path and column names for files); a
  # command-line override may add any option the source documents.
  config.data.source_options = ml_collections.ConfigDict(
      {"num_users": 2_000, "num_items": 1_000, "interactions_per_user": 30, "seed": 0})
  # None = the dataset's default filter (5 for MovieLens, none for synthetic).
  config.data.min_item_count = ml_collections.config_dict.placeholder(int)
  # "loo" (leave-one-out) or "gts" (global temporal split with split_options).
  config.data.split = "loo"
  config.data.split_options = ml_collections.ConfigDict()
  # Training windows of an epoch: "all" non-overlapping N-windows of every
  # history (long histories used in full), or "last": each user's most recent
  # window, one sequence per user (the published SASRec recipes).
  config.data.train_windows = "all"
  # grain read threads and batches read ahead.
  config.data.num_threads = 2
  config.data.prefetch_buffer_size = 4

  # Loss: cutbce backend ("auto", "xla", "pallas_tpu", "pallas_gpu", "pallas_triton",
  # "dense") and whether
  # l_t is divided by V ("mean") or not ("sum").
  config.loss = ml_collections.ConfigDict()
  # "bce": full-catalog multi-label BCE (`cut_bce`, everything below applies);
  # "softmax_ce": the full softmax cross-entropy (`cutbce.cut_softmax_ce`, the
  # same backends; of the variants only label_smoothing applies). The sampled
  # baselines (`trainer/sampled.py`; no variant, exclude or backend applies):
  # "sampled_softmax" over k sampled negatives, "gbce" (gSASRec's calibrated
  # BCE over k negatives), "in_batch" (the batch's targets as negatives).
  config.loss.kind = "bce"
  # k: negatives of the sampled kinds (None: in_batch with every target slot).
  config.loss.num_negatives = 128
  # sampled_softmax, gbce: negatives drawn "uniform"ly over the catalog, or by
  # "popularity" (in proportion to the items' training counts).
  config.loss.sampler = "uniform"
  # One set of negatives shared by the whole "batch", or k per "position".
  config.loss.negatives_per = "batch"
  # sampled_softmax, in_batch: subtract log(k q(item)) from each negative's
  # logit, q the probability of drawing the item (the logQ correction).
  config.loss.logq = False
  # gbce: calibration t in [0, 1] (gSASRec's 0.75; 0 = plain BCE over the
  # sampled items).
  config.loss.gbce_t = 0.75
  config.loss.backend = "auto"
  config.loss.vocab_reduction = "sum"
  # softmax_ce with several targets per position: "sum" adds one softmax CE term
  # per distinct target (SASRec's multi-target CE); "mean" averages them, so a
  # position weighs the same whatever its number of targets. BCE: "sum" only.
  config.loss.target_reduction = "sum"
  # "window": each position's negatives leave out the items of its own training
  # window (the user's recent items; passed to the op as `exclude`, targets
  # stay targets; costs a gather of N + L table rows per position); "none":
  # every item that is not a target is a negative. Both loss kinds.
  config.loss.exclude = "none"
  # Loss variants of `cutbce.cut_bce`, all off by default. Weight of positive
  # labels (None = 1):
  config.loss.pos_weight = ml_collections.config_dict.placeholder(float)
  # Label smoothing e in [0, 1): labels become y (1 - e) + e / 2.
  config.loss.label_smoothing = 0.0
  # Soft cap c > 0: logits become c tanh(x / c) (None = no cap).
  config.loss.logit_soft_cap = ml_collections.config_dict.placeholder(float)
  # Binary focal loss: exponent gamma >= 0 (None = no focal factor).
  config.loss.focal_gamma = ml_collections.config_dict.placeholder(float)
  # Focal class balance alpha in [0, 1] (None = none).
  config.loss.focal_alpha = ml_collections.config_dict.placeholder(float)
  # Loss and gradients in one tiled pass (None: whenever the reduction allows,
  # as `cut_bce`'s default; False: two passes, smaller residuals).
  config.loss.one_pass = ml_collections.config_dict.placeholder(bool)

  # Evaluation: full-catalog ranks of held-out items.
  config.eval = ml_collections.ConfigDict()
  # "validation" during training; the final evaluation also runs "test".
  config.eval.split = "validation"
  # Exclude each user's history from the ranking (filter-seen protocol).
  config.eval.filter_seen = True
  # Cut-offs of recall, ndcg and hit.
  config.eval.ks = (10, 50, 100)
  # Evaluate at most this many global batches (None = every user).
  config.eval.max_batches = ml_collections.config_dict.placeholder(int)
  # Backend of the ranking pass (as config.loss.backend).
  config.eval.backend = "auto"

  # Every k steps: evaluate, checkpoint, log a progress line.
  config.eval_every = 500
  config.checkpoint_every = 500
  config.log_every = 50
  # Checkpoints kept (the newest ones; the best one below is kept beside them).
  config.max_checkpoints = 2
  # Also keep the checkpoint with the best value of this metric of the
  # periodic evaluations ("mrr", or "recall@k", "ndcg@k", "hit@k" with k in
  # eval.ks; None = only the newest ones). The commands after training
  # (trainer.evaluate, recommend, export) read the best one by default.
  config.checkpoint = ml_collections.ConfigDict()
  config.checkpoint.best_metric = "ndcg@10"
  # Early stopping: stop once best_metric has not risen in this many
  # evaluations (None: train every train_steps).
  config.checkpoint.patience = ml_collections.config_dict.placeholder(int)
  # What `python -m trainer.compile` assumes of the data it does not read:
  # the catalog size V (None: pass --num_items), and the evaluation batch's
  # targets L and excluded history ids E per user (None: num_targets, seq_len).
  config.compile = ml_collections.ConfigDict()
  config.compile.num_items = ml_collections.config_dict.placeholder(int)
  config.compile.eval_targets = ml_collections.config_dict.placeholder(int)
  config.compile.eval_exclude = ml_collections.config_dict.placeholder(int)
  # jax.profiler trace of steps [start, start + num_steps) into WORKDIR/profile;
  # num_steps = 0 disables it.
  config.profile = ml_collections.ConfigDict({"start_step": 10, "num_steps": 0})
  return config
