"""Chunked LM head and loss-position scoring against the full [B,T,V] computation.

References are independent of the code under test: full float32 logits from `transformer.logits`
through `jax.nn.log_softmax`, and a train step written out here with a separate old-policy pass
over every position, as the update was defined before it was restricted to loss positions.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from eppo_jax import logprobs, objective, pacing, steps
from eppo_jax.models import transformer
from eppo_jax.models.config import ModelConfig

MODEL = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=1,
                    num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=False)
B, T, K, G = 8, 20, 3, 2


def _full_scores(params, model, tokens_BxT, mask_BxT, temperature):
  """Reference: log_softmax of the full logits at every position: ([B,T-1], [B,T-1])."""
  logits_BxTxV = transformer.logits(params, model, tokens_BxT[:, :-1], mask_BxT[:, :-1])
  logp_BxTxV = jax.nn.log_softmax(logits_BxTxV / temperature, axis=-1)
  logp_BxT = jnp.take_along_axis(logp_BxTxV, tokens_BxT[:, 1:, None], axis=-1)[..., 0]
  return logp_BxT, -jnp.sum(jnp.exp(logp_BxTxV) * logp_BxTxV, axis=-1)


def _batch(seed: int, model=MODEL) -> dict:
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, model.vocab_size, size=(B, T)).astype(np.int32)
  lengths = rng.integers(T // 2, T + 1, size=B)
  pos = np.arange(T)[None]
  attention = pos < lengths[:, None]
  # Two assistant turns with an observation between them: loss positions are not contiguous.
  loss = attention & (((pos >= 3) & (pos < 7)) | (pos >= 10))
  loss[3, :] = False  # An episode that generated nothing.
  group_ids = np.repeat(np.arange(B // G), G).astype(np.int32)
  task_ids = np.array([0, 1, 2, 1], np.int32)[group_ids]
  rewards = rng.normal(size=B).astype(np.float32)
  return dict(tokens=tokens, attention_mask=attention, loss_mask=loss, task_ids=task_ids,
              group_ids=group_ids, rewards=rewards)


@pytest.mark.parametrize("tied,vocab_chunk,position_chunk,temperature",
                         [(False, 4096, 1024, 1.0), (True, 40, 7, 0.7), (False, 32, 64, 1.3)])
def test_chunked_head_matches_full_logits(tied, vocab_chunk, position_chunk, temperature):
  """Log-probs, entropies and their gradients equal the full computation, chunked or not."""
  model = dataclasses.replace(MODEL, tie_word_embeddings=tied)
  params = transformer.init_params(model, jax.random.PRNGKey(0))
  batch = _batch(0, model)
  tokens, mask = jnp.asarray(batch["tokens"]), jnp.asarray(batch["attention_mask"])
  w_BxT = jnp.asarray(np.random.default_rng(1).normal(size=(B, T - 1)), jnp.float32)

  def chunked(p):
    hidden = transformer.hidden_states(p, model, tokens[:, :-1], mask[:, :-1])
    return logprobs.head_logprobs_and_entropy(
        hidden, transformer.head_kernel(p, model), tokens[:, 1:], temperature, model,
        position_chunk=position_chunk, vocab_chunk=vocab_chunk)

  full = lambda p: _full_scores(p, model, tokens, mask, temperature)
  for got, want in zip(chunked(params), full(params)):
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)
  objective_of = lambda f: lambda p: sum(jnp.sum(x * w_BxT * (i + 1)) for i, x in enumerate(f(p)))
  g_got = jax.grad(objective_of(chunked))(params)
  g_want = jax.grad(objective_of(full))(params)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(g_got),
                          jax.tree_util.tree_leaves(g_want)):
    np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-4, err_msg=jax.tree_util.keystr(path))


def test_chunked_head_memory_does_not_grow_with_positions_times_vocab():
  """Compiled temp bytes of value-and-grad: the chunked head stays far below R x V x 4 bytes."""
  model = dataclasses.replace(MODEL, vocab_size=4096)
  n, r, d, v = 4, 512, model.hidden_size, model.vocab_size
  hidden = jax.ShapeDtypeStruct((n, r, d), jnp.float32)
  kernel = jax.ShapeDtypeStruct((d, v), jnp.float32)
  tokens = jax.ShapeDtypeStruct((n, r), jnp.int32)

  def temp_bytes(score):
    f = lambda h, k, t: jnp.sum(sum(score(h, k, t)))
    compiled = jax.jit(jax.value_and_grad(f, argnums=(0, 1))).lower(hidden, kernel, tokens).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  full = temp_bytes(lambda h, k, t: logprobs.token_logprobs_and_entropy(
      transformer.lm_head(h, k, model), t))
  chunked = temp_bytes(lambda h, k, t: logprobs.head_logprobs_and_entropy(
      h, k, t, 1.0, model, position_chunk=256, vocab_chunk=1024))
  logits_bytes = n * r * v * 4  # 32 MiB
  assert full >= logits_bytes
  # A few chunk-sized (256 x 1024 x 4 bytes = 1 MiB) buffers, not the logits and their gradient.
  assert chunked < logits_bytes / 4 and 10 * chunked < full, (chunked, full)


def test_sampler_formula_is_the_shared_one():
  """sample_token and the teacher-forced scores report the numbers of one shared function."""
  from eppo_jax import sampling  # pylint: disable=g-import-not-at-top
  rng = np.random.default_rng(0)
  logits = jnp.asarray(rng.normal(size=(5, 33)) * 3, jnp.float32)
  cfg = sampling.SamplingConfig(temperature=0.8)
  token, lp, ent = sampling.sample_token(logits, jax.random.split(jax.random.PRNGKey(0), 5), cfg)
  logp_all = jax.nn.log_softmax(logits / 0.8)
  np.testing.assert_allclose(lp, jnp.take_along_axis(logp_all, token[:, None], 1)[:, 0], atol=1e-6)
  np.testing.assert_allclose(ent, -jnp.sum(jnp.exp(logp_all) * logp_all, -1), atol=1e-5)
  np.testing.assert_allclose(_entropy(logits[:, None] * 1.25)[:, 0], ent, atol=1e-5)


def test_loss_positions_and_budget():
  mask = np.zeros((3, 10), bool)
  mask[0, [2, 3, 7]] = True
  mask[2, 1:] = True
  idx, valid = jax.device_get(steps.loss_positions(jnp.asarray(mask), 4))
  np.testing.assert_array_equal(idx[0, :3], [2, 3, 7])
  np.testing.assert_array_equal(valid, [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]])
  np.testing.assert_array_equal(idx[2], [1, 2, 3, 4])
  steps.check_loss_budget(np.pad(mask, ((0, 0), (1, 0)))[:, :10], 9)
  with pytest.raises(ValueError, match="loss_tokens_per_row"):
    steps.check_loss_budget(np.pad(mask, ((0, 0), (1, 0))), 8)


# ----------------------------------------------------------------------------------------------
# A whole train_step against the update written out with a full old-policy pass.


def _reference_step(state, frozen, batch, rng, *, cfg: steps.StepConfig, tx, old=None):
  """The update over every position with full logits, old log-probs from a separate pass."""
  del frozen  # Full fine-tuning only here.
  b = batch["tokens"].shape[0]
  m, per = cfg.num_minibatches, b // cfg.num_minibatches
  params = state.trainable
  mask_BxT = batch["loss_mask"][:, 1:]
  score = lambda p, rows: _full_scores(p, cfg.model, batch["tokens"][rows],
                                       batch["attention_mask"][rows], cfg.temperature)
  if old is None:
    old_BxT, ent_BxT = score(params, np.arange(b))
  else:
    old_BxT, ent_BxT = old
  ent_K, cnt_K = pacing.task_entropy(ent_BxT, mask_BxT, batch["task_ids"], cfg.num_tasks)
  new_pacing = pacing.update_pacing(state.pacing, ent_K, cnt_K, cfg.pacing)
  eps_low_K, eps_high_K = pacing.pacing_bounds(new_pacing, cfg.pacing)
  adv_B = objective.grpo_advantages(batch["rewards"], batch["group_ids"], cfg.num_groups)
  trainable, opt_state, losses = params, state.opt_state, []
  for epoch, epoch_key in enumerate(jax.random.split(rng, cfg.ppo_epochs)):
    perm_key, loss_key = jax.random.split(epoch_key)
    order = jnp.arange(b)
    if epoch and cfg.shared_prefix:  # Groups stay together: shuffled as blocks.
      groups = jax.random.permutation(perm_key, b // cfg.group_size)
      order = (groups[:, None] * cfg.group_size + jnp.arange(cfg.group_size)).reshape(b)
    elif epoch:
      order = jax.random.permutation(perm_key, b)
    for i, key in enumerate(jax.random.split(loss_key, m)):
      rows = order[i * per:(i + 1) * per]

      def loss_fn(p):
        logp, ent = score(p, rows)
        return objective.eppo_loss(logp, old_BxT[rows], adv_B[rows], mask_BxT[rows],
                                   batch["task_ids"][rows], eps_low_K, eps_high_K, None, ent,
                                   cfg=cfg.loss, num_tasks=cfg.num_tasks, rng=key)

      (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
      updates, opt_state = tx.update(grads, opt_state, trainable)
      trainable = optax.apply_updates(trainable, updates)
      losses.append(metrics)
  return trainable, new_pacing, ent_K, eps_low_K, losses


# Each case compiles two updates (about 30 s on 2 cores): the cases cover reuse of the first
# minibatch's pass over epochs, the entropy bonus and dual clip on gathered positions, and a
# token-selection method (kl_cov; clip_cov selects tokens the same way) with its aggregation.
CASES = {
    "eppo_2mb_2epochs": ("eppo", dict(), 2, 2),
    "grpo_dual_clip_entropy_bonus": ("grpo", dict(dual_clip_c=3.0, entropy_coef=0.01), 2, 1),
    "kl_cov_seq_norm": ("kl_cov", dict(agg="seq-mean-token-sum-norm", kl_cov_ratio=0.05), 2, 1),
}


@pytest.mark.parametrize("case", list(CASES))
def test_train_step_matches_the_full_position_update(case):
  """New step (loss positions only, old pass reused for minibatch 0) == reference, <= 1e-5."""
  method, overrides, minibatches, epochs = CASES[case]
  pacing_cfg, loss_cfg = objective.method_configs(method, **overrides)
  batch = {k: jnp.asarray(v) for k, v in _batch(2).items()}
  # Budget: the most loss tokens of a row, below T - 1, so the gather really narrows.
  budget = int(batch["loss_mask"][:, 1:].sum(1).max())
  assert budget < T - 1
  cfg = steps.StepConfig(model=MODEL, pacing=pacing_cfg, loss=loss_cfg, num_tasks=K,
                         num_groups=B // G, temperature=0.9, num_minibatches=minibatches,
                         ppo_epochs=epochs, loss_tokens_per_row=budget)
  _check_against_reference(cfg, batch)


def _check_against_reference(cfg, batch):
  """train_step == _reference_step on `batch`: pacing, loss metrics and params within 1e-5."""
  # Plain SGD: params differ by lr x the gradients' difference (Adam would magnify the rounding
  # of near-zero gradient entries to a full step).
  tx = optax.sgd(0.2)
  params = transformer.init_params(MODEL, jax.random.PRNGKey(0))
  state = steps.TrainState(step=jnp.zeros((), jnp.int32), trainable=params,
                           opt_state=tx.init(params), pacing=pacing.init_pacing(K))
  rng = jax.random.PRNGKey(3)
  new, metrics = jax.jit(functools.partial(steps.train_step, cfg=cfg, tx=tx))(state, {}, batch, rng)
  ref_params, ref_pacing, ent_K, eps_low_K, ref_metrics = jax.jit(
      functools.partial(_reference_step, cfg=cfg, tx=tx))(state, {}, batch, rng)
  assert int(metrics["loss_tokens_over_budget"]) == 0 and int(metrics["skipped"]) == 0
  np.testing.assert_allclose(metrics["entropy_K"], ent_K, atol=1e-5)
  np.testing.assert_allclose(metrics["eps_low_K"], eps_low_K, atol=1e-5)
  np.testing.assert_allclose(new.pacing.ema_K, ref_pacing.ema_K, atol=1e-5)
  mean = lambda key: np.mean([float(x[key]) for x in ref_metrics])
  for key in ("loss", "pg_loss", "clip_frac_low", "clip_frac_high", "approx_kl", "entropy"):
    np.testing.assert_allclose(metrics[key], mean(key), atol=1e-5, rtol=1e-5, err_msg=key)
  moved = 0.0
  for (path, x), y, x0 in zip(jax.tree_util.tree_leaves_with_path(new.trainable),
                              jax.tree_util.tree_leaves(ref_params), jax.tree_util.tree_leaves(params)):
    np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5, err_msg=jax.tree_util.keystr(path))
    moved = max(moved, float(jnp.abs(x - x0).max()))
  assert moved > 1e-3  # The params moved: not the equality of two no-ops.


def _grouped_batch(seed: int, prompt: int) -> dict:
  """`_batch` whose groups share their first `prompt` tokens (all valid), replies after them."""
  batch = _batch(seed)
  lead = np.arange(B) // G * G
  batch["tokens"][:, :prompt] = batch["tokens"][lead, :prompt]
  batch["attention_mask"][:, :prompt] = True
  pos = np.arange(T)[None]
  batch["loss_mask"] = batch["attention_mask"] & (((pos >= prompt) & (pos < prompt + 3))
                                                  | (pos >= prompt + 5))
  return batch


def test_shared_prefix_length():
  batch = _grouped_batch(2, prompt=8)
  length = lambda b, **kw: steps.shared_prefix_length(b["tokens"], b["attention_mask"],
                                                      b["loss_mask"], **kw)
  # Position 7 scores the first reply token (8): the prefix ends before it.
  assert length(batch, group_size=G, multiple=1) == 7
  assert length(batch, group_size=G, multiple=4) == 4
  assert length(batch, group_size=1, multiple=1) == 0  # No groups, nothing shared.
  assert length(batch, group_size=3, multiple=1) == 0  # B = 8 rows are not groups of 3.
  batch["tokens"][5, 5] += 1  # One row of group 2 leaves its group's prompt at position 5.
  assert length(batch, group_size=G, multiple=1) == 5
  batch["attention_mask"][0, 2] = False  # A pad inside a row's prompt that its group lacks.
  assert length(batch, group_size=G, multiple=1) == 2


def test_shared_prompt_update_equals_the_whole_row_update():
  """The group's prompt run once per group (`StepConfig.shared_prefix`), 2 minibatches x 2
  epochs, == the reference that runs every row whole (groups shuffled as blocks in epoch 2)."""
  batch = _grouped_batch(2, prompt=8)
  shared = steps.shared_prefix_length(batch["tokens"], batch["attention_mask"],
                                      batch["loss_mask"], G, multiple=1)
  pacing_cfg, loss_cfg = objective.method_configs("eppo")
  cfg = steps.StepConfig(model=MODEL, pacing=pacing_cfg, loss=loss_cfg, num_tasks=K,
                         num_groups=B // G, temperature=0.9, num_minibatches=2, ppo_epochs=2,
                         loss_tokens_per_row=T - 9, shared_prefix=shared,
                         group_size=G)
  _check_against_reference(cfg, {k: jnp.asarray(v) for k, v in batch.items()})
  with pytest.raises(ValueError, match="whole groups"):
    steps.train_step(None, {}, batch, None, cfg=dataclasses.replace(cfg, num_minibatches=8),
                     tx=None)


def test_sampler_old_logprobs_enter_the_update():
  """old_logprobs="sampler": the batch's per-token numbers are the ratio's denominator and the
  pacing signal (reference given the same numbers); over budget rows are counted, not dropped."""
  pacing_cfg, loss_cfg = objective.method_configs("eppo")
  cfg = steps.StepConfig(model=MODEL, pacing=pacing_cfg, loss=loss_cfg, num_tasks=K,
                         num_groups=B // G, num_minibatches=2,
                         old_logprobs="sampler")
  tx = optax.sgd(0.2)
  params = transformer.init_params(MODEL, jax.random.PRNGKey(0))
  state = steps.TrainState(step=jnp.zeros((), jnp.int32), trainable=params,
                           opt_state=tx.init(params), pacing=pacing.init_pacing(K))
  batch = {k: jnp.asarray(v) for k, v in _batch(4).items()}
  # The sampler's numbers: the true ones perturbed, as a bf16 decode would round them.
  lp, ent = _full_scores(params, MODEL, batch["tokens"], batch["attention_mask"], 1.0)
  noise = jnp.asarray(np.random.default_rng(0).normal(size=lp.shape) * 0.05, jnp.float32)
  mask = batch["loss_mask"][:, 1:]
  old = (jnp.where(mask, lp + noise, 0.0), jnp.where(mask, ent + noise, 0.0))
  pad = lambda x: jnp.pad(x, ((0, 0), (1, 0)))  # Aligned with tokens: token t+1 at column t+1.
  batch.update(logprobs=pad(old[0]), entropies=pad(old[1]))
  rng = jax.random.PRNGKey(3)
  new, metrics = jax.jit(functools.partial(steps.train_step, cfg=cfg, tx=tx))(state, {}, batch, rng)
  ref_params, _, ent_K, _, ref_metrics = jax.jit(
      functools.partial(_reference_step, cfg=cfg, tx=tx))(state, {}, batch, rng, old=old)
  np.testing.assert_allclose(metrics["entropy_K"], ent_K, atol=1e-5)
  np.testing.assert_allclose(metrics["approx_kl"],
                             np.mean([float(x["approx_kl"]) for x in ref_metrics]), atol=1e-6)
  assert float(metrics["approx_kl"]) > 1e-4  # The ratio did not start at 1.
  for x, y in zip(jax.tree_util.tree_leaves(new.trainable), jax.tree_util.tree_leaves(ref_params)):
    np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5)
  # A budget below a row's loss tokens: the excess is reported.
  small = dataclasses.replace(cfg, loss_tokens_per_row=5)
  _, metrics = jax.jit(functools.partial(steps.train_step, cfg=small, tx=tx))(state, {}, batch, rng)
  counts = np.asarray(mask).sum(1)
  assert int(metrics["loss_tokens_over_budget"]) == int(np.maximum(counts - 5, 0).sum()) > 0


def test_layers_scanned_or_unrolled_give_the_same_scores_and_gradients():
  """`unroll_layers` changes how the layers run (scan vs Python loop), not what they compute: the
  log-probs and the gradient with respect to the stacked weights agree, and the unrolled program
  has fewer loops (the layer scan and its transpose are gone)."""
  batch = _batch(4)
  tokens, mask = jnp.asarray(batch["tokens"]), jnp.asarray(batch["attention_mask"])
  model = dataclasses.replace(MODEL, num_layers=3)
  params = transformer.init_params(model, jax.random.PRNGKey(1))

  def loss(p, unroll):
    logp_BxT, ent_BxT = steps.sequence_logprobs(p, model.replace(unroll_layers=unroll), tokens,
                                                mask, 0.9)
    return jnp.sum(logp_BxT * mask[:, 1:]) + jnp.sum(ent_BxT * mask[:, 1:]), logp_BxT

  grads, logps, loops = {}, {}, {}
  for unroll in (False, True):
    fn = jax.value_and_grad(functools.partial(loss, unroll=unroll), has_aux=True)
    loops[unroll] = str(jax.make_jaxpr(fn)(params)).count(" scan[")
    (_, logps[unroll]), grads[unroll] = jax.jit(fn)(params)
  assert loops[True] < loops[False]
  np.testing.assert_allclose(logps[True], logps[False], atol=1e-5, rtol=0)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(grads[True]),
                          jax.tree_util.tree_leaves(grads[False])):
    assert x.shape == y.shape
    np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5, err_msg=jax.tree_util.keystr(path))


def np_token_entropy(logits):
  """Entropy by definition, -sum p log p, in float64 with the max subtracted."""
  z = np.asarray(logits, np.float64)
  z = z - z.max(-1, keepdims=True)
  p = np.exp(z) / np.exp(z).sum(-1, keepdims=True)
  logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
  return -(np.where(p > 0, p * logp, 0.0)).sum(-1)


def _entropy(logits_BxTxV):
  """The entropy half of the one formula (the token only picks the unused log-prob)."""
  return logprobs.token_logprobs_and_entropy(logits_BxTxV, jnp.zeros(logits_BxTxV.shape[:-1],
                                                                      jnp.int32))[1]


def test_token_entropy_matches_definition_and_is_stable():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(2, 3, 11)) * 4
  logits[0, 0] = 0.0                       # uniform: log V
  logits[0, 1] = -1e9
  logits[0, 1, 3] = 50.0                   # one-hot: 0, with probabilities underflowing
  logits[1, 2] *= 1e4                      # huge logits
  got = np.asarray(_entropy(jnp.asarray(logits, jnp.float32)))
  assert got.dtype == np.float32 and np.all(np.isfinite(got))
  np.testing.assert_allclose(got, np_token_entropy(logits), atol=2e-5)
  np.testing.assert_allclose(got[0, 0], np.log(11), rtol=1e-6)
  assert abs(got[0, 1]) < 1e-6
  bf16 = _entropy(jnp.asarray(logits, jnp.bfloat16))
  assert bf16.dtype == jnp.float32
