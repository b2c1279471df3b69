"""Micro-batch gradient accumulation (`StepConfig.micro_batches`) against the unsplit update.

The unsplit update (`micro_batches=1`) is itself checked against an update written out
independently in tests/test_logprobs.py. Split into 2 or 4 parts, each minibatch must give the same
params after two RL steps and the same metrics: the parts are scored against the whole minibatch's
normalisers (token counts per task, sequence counts), so token-mean and sequence-mean aggregation
both come out as for the whole minibatch, and Clip-Cov / KL-Cov choose their tokens over it. The
batch has ragged loss masks, an episode without loss tokens next to a failed one (reward NaN), so
that with 4 parts one micro-batch carries no loss token at all.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from eppo_jax import hosts, objective, pacing, programs, steps
from eppo_jax import mesh as meshlib
from eppo_jax.models import transformer
from eppo_jax.models.config import ModelConfig

MODEL = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=1,
                    num_heads=4, num_kv_heads=2, head_dim=8, tie_word_embeddings=False)
B, T, K, G, PROMPT = 16, 24, 3, 2, 6


def _batch(seed: int = 0) -> dict:
  """Groups of G rows sharing a PROMPT-token prompt, then two assistant turns of ragged lengths."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, MODEL.vocab_size, size=(B, T)).astype(np.int32)
  tokens[:, :PROMPT] = tokens[np.arange(B) // G * G, :PROMPT]
  lengths = rng.integers(PROMPT + 6, T + 1, size=B)
  pos = np.arange(T)[None]
  attention = pos < lengths[:, None]
  first_end = PROMPT + rng.integers(1, 5, size=B)[:, None]
  loss = attention & (((pos >= PROMPT) & (pos < first_end)) | (pos >= first_end + 2))
  loss[4] = False  # An episode that generated nothing ...
  rewards = rng.normal(size=B).astype(np.float32)
  rewards[5] = np.nan  # ... next to a failed one: with 4 parts, micro-batch 2 has no loss token.
  group_ids = (np.arange(B) // G).astype(np.int32)
  task_ids = np.array([0, 1, 2, 1, 0, 2, 1, 0], np.int32)[group_ids]
  return {k: jnp.asarray(v) for k, v in dict(
      tokens=tokens, attention_mask=attention, loss_mask=loss, task_ids=task_ids,
      group_ids=group_ids, rewards=rewards).items()}


@pytest.mark.parametrize("agg", objective.AGG_MODES)
@pytest.mark.parametrize("policy_loss", objective.POLICY_LOSSES)
def test_loss_of_parts_sums_to_the_loss_of_the_batch(agg, policy_loss):
  """`eppo_loss` of uneven parts of a batch, given its `loss_totals` and `covariance_tokens`:
  loss, gradient and every metric summed over the parts are the whole batch's."""
  rng = np.random.default_rng(1)
  b, t = 8, 12
  logp = jnp.asarray(-rng.gamma(2.0, 1.0, size=(b, t)), jnp.float32)
  old = logp + jnp.asarray(rng.normal(size=(b, t)) * 0.3, jnp.float32)
  adv = jnp.asarray(rng.normal(size=b), jnp.float32)
  mask = jnp.asarray((rng.random((b, t)) < 0.6) & (np.arange(b) != 2)[:, None])  # Row 2: empty.
  tid = jnp.asarray([0, 1, 2, 1, 0, 2, 1, 0], jnp.int32)
  lo, hi = jnp.asarray([0.1, 0.2, 0.3]), jnp.asarray([0.2, 0.25, 0.3])
  ent = jnp.asarray(rng.random((b, t)), jnp.float32)
  cfg = objective.LossConfig(policy_loss=policy_loss, agg=agg, entropy_coef=0.01,
                             clip_cov_ratio=0.2, clip_cov_lb=-10.0, kl_cov_ratio=0.2)
  key = jax.random.PRNGKey(0)

  def loss(lp, rows, **kw):
    return objective.eppo_loss(lp, old[rows], adv[rows], mask[rows], tid[rows], lo, hi, None,
                               ent[rows], cfg=cfg, num_tasks=K, rng=key, **kw)

  (want, want_metrics), want_grad = jax.value_and_grad(
      lambda lp: loss(lp, np.arange(b)), has_aux=True)(logp)
  totals = objective.loss_totals(mask, tid, K)
  chosen = objective.covariance_tokens(logp, old, adv, mask, tid, lo, hi, cfg=cfg, rng=key)
  got, got_metrics, got_grad = 0.0, None, []
  for rows in (np.arange(0, 3), np.arange(3, 4), np.arange(4, b)):
    (part, metrics), grad = jax.value_and_grad(
        lambda lp, rows=rows: loss(lp, rows, totals=totals, selected_BxT=chosen[rows]),
        has_aux=True)(logp[rows])
    got, got_grad = got + part, got_grad + [grad]
    got_metrics = metrics if got_metrics is None else jax.tree_util.tree_map(
        jnp.add, got_metrics, metrics)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
  np.testing.assert_allclose(jnp.concatenate(got_grad), want_grad, rtol=1e-6, atol=1e-8)
  _assert_same(got_metrics, want_metrics)
  assert float(jnp.abs(want_grad).max()) > 1e-3
  if policy_loss != "ppo_clip":
    assert float(want_metrics["cov_selected_frac"]) > 0


# name -> (method, overrides, advantage estimator, epochs, shared prompt, micro-batch counts).
CASES = {
    # Token-mean over the minibatch; the second epoch reshuffles groups; the prompt runs once.
    "eppo": ("eppo", {}, "grpo", 2, True, (2, 4)),
    # Dr. GRPO: sequence sums over a constant length, a mean over sequences; entropy bonus.
    "drgrpo": ("grpo", dict(agg="seq-mean-token-sum-norm", entropy_coef=0.01), "drgrpo", 1, False,
               (2, 4)),
    # Sequence-mean, and KL-Cov's tokens chosen over the whole minibatch.
    "kl_cov_seq_mean": ("kl_cov", dict(agg="seq-mean-token-mean", kl_cov_ratio=0.1), "grpo", 1,
                        False, (4,)),
    # Clip-Cov's random choice: the same draws over the whole minibatch.
    "clip_cov_random": ("clip_cov", dict(clip_cov_ratio=0.2, clip_cov_lb=0.0), "grpo", 1, False,
                        (2,)),
}


def _config(case: str, micro_batches: int) -> steps.StepConfig:
  method, overrides, estimator, epochs, shared, _ = CASES[case]
  pacing_cfg, loss_cfg = objective.method_configs(method, **overrides)
  batch = _batch()
  prefix = steps.shared_prefix_length(batch["tokens"], batch["attention_mask"], batch["loss_mask"],
                                      G, multiple=1) if shared else 0
  return steps.StepConfig(model=MODEL, pacing=pacing_cfg, loss=loss_cfg, num_tasks=K,
                          num_groups=B // G, temperature=0.9, ppo_epochs=epochs, num_minibatches=2,
                          micro_batches=micro_batches, advantage_estimator=estimator,
                          loss_tokens_per_row=T - PROMPT, shared_prefix=prefix, group_size=G)


def _initial_state(tx):
  params = transformer.init_params(MODEL, jax.random.PRNGKey(0))
  return steps.TrainState(step=jnp.zeros((), jnp.int32), trainable=params,
                          opt_state=tx.init(params), pacing=pacing.init_pacing(K))


# Plain SGD: params differ by lr x the gradients' difference (Adam would magnify the rounding of
# near-zero gradient entries to a full step).
TX = optax.sgd(0.2)


def _two_steps(update, state, batch):
  """(params after two RL steps, [metrics of each step]) as NumPy."""
  history = []
  for i in range(2):
    state, metrics = update(state, {}, batch, jax.random.PRNGKey(7 + i))
    history.append(jax.tree_util.tree_map(np.asarray, metrics))
  return jax.tree_util.tree_map(np.asarray, state.trainable), history


@functools.lru_cache(maxsize=None)
def _run(case: str, micro_batches: int):
  cfg = _config(case, micro_batches)
  update = jax.jit(functools.partial(steps.train_step, cfg=cfg, tx=TX))
  return _two_steps(update, _initial_state(TX), _batch())


def _max_differences(got, want) -> tuple[float, float]:
  """(largest |params difference|, largest |metric difference|) of two `_two_steps` results."""
  params = max(float(np.abs(x - y).max()) for x, y in zip(jax.tree_util.tree_leaves(got[0]),
                                                          jax.tree_util.tree_leaves(want[0])))
  metrics = max(float(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)).max())
                for x, y in zip(jax.tree_util.tree_leaves(got[1]),
                                jax.tree_util.tree_leaves(want[1])))
  return params, metrics


def _assert_same(got, want):
  leaves = zip(jax.tree_util.tree_leaves_with_path(got), jax.tree_util.tree_leaves(want))
  for (path, x), y in leaves:
    np.testing.assert_allclose(x, y, atol=1e-5, rtol=1e-5, err_msg=jax.tree_util.keystr(path))


@pytest.mark.parametrize("case, micro_batches",
                         [(case, n) for case, spec in CASES.items() for n in spec[-1]])
def test_micro_batches_give_the_unsplit_update(case, micro_batches):
  """Params after two steps and every metric of each step, within 1e-5 of one micro-batch."""
  want = _run(case, 1)
  got = _run(case, micro_batches)
  _assert_same(got, want)
  print(f"{case} micro_batches={micro_batches}: max |params diff| %.2e, max |metric diff| %.2e"
        % _max_differences(got, want))
  metrics = want[1]
  # The comparison is of updates that did something: params moved, some token was clipped (or,
  # for the covariance methods, chosen), and both ends of the step counted their tokens.
  assert max(float(np.abs(x - y).max()) for x, y in zip(
      jax.tree_util.tree_leaves(want[0]),
      jax.tree_util.tree_leaves(_initial_state(TX).trainable))) > 1e-3
  if CASES[case][0] in ("kl_cov", "clip_cov"):
    assert all(m["cov_selected_frac"] > 0 for m in metrics)
  else:
    assert sum(m["clip_frac_low"] + m["clip_frac_high"] for m in metrics) > 0
  counts = np.asarray(_batch()["loss_mask"][:, 1:]).sum(1)
  counts[5] = 0  # The failed episode trains nothing.
  assert int(metrics[0]["token_count"]) == counts.sum() // 2  # Mean over the 2 minibatches.
  assert all(int(m["skipped"]) == 0 for m in metrics)


def test_micro_batches_on_a_mesh_give_the_one_device_update():
  """2 micro-batches on a (data 2, fsdp 2) mesh of 4 devices == 1 micro-batch on 1 device."""
  mesh = meshlib.make_mesh(ml_collections.ConfigDict(dict(data=2, fsdp=2, tensor=1)),
                           jax.devices()[:4])
  cfg = _config("eppo", 2)
  cfg = dataclasses.replace(cfg, minibatch_sharding=meshlib.minibatch_sharding(mesh))
  state = _initial_state(TX)
  state_sh = meshlib.shardings(state, mesh)
  update = programs.jit_update(cfg, TX, state_sh, {}, mesh, cfg.shared_prefix)
  with jax.set_mesh(mesh):
    got = _two_steps(update, hosts.put(state, state_sh),
                     hosts.put_rows({k: np.asarray(v) for k, v in _batch().items()}, mesh))
  _assert_same(got, _run("eppo", 1))
  print("4-device mesh, micro_batches=2: max |params diff| %.2e, max |metric diff| %.2e"
        % _max_differences(got, _run("eppo", 1)))


def test_step_refuses_micro_batches_that_do_not_divide():
  cfg = _config("eppo", 3)
  with pytest.raises(ValueError, match="3 micro-batches"):
    steps.train_step(None, {}, _batch(), None, cfg=cfg, tx=None)
  with pytest.raises(ValueError, match="micro_batches must be >= 1"):
    _config("drgrpo", 0)


def test_sft_micro_batches_give_the_unsplit_update():
  """`sft_step` in 4 parts: the token-mean NLL of the whole batch and its update."""
  batch = {k: _batch()[k] for k in ("tokens", "attention_mask", "loss_mask")}
  params = transformer.init_params(MODEL, jax.random.PRNGKey(0))
  results = []
  for n in (1, 4):
    sft = jax.jit(functools.partial(steps.sft_step, model=MODEL, tx=TX, micro_batches=n))
    trainable, _, metrics = sft(params, TX.init(params), {}, batch)
    results.append((trainable, metrics))
  _assert_same(results[1], results[0])
  # Independent reference for the loss: the token mean of -log p over every loss token.
  logits = transformer.logits(params, MODEL, batch["tokens"][:, :-1],
                              batch["attention_mask"][:, :-1])
  logp = jnp.take_along_axis(jax.nn.log_softmax(logits), batch["tokens"][:, 1:, None], -1)[..., 0]
  mask = np.asarray(batch["loss_mask"][:, 1:])
  np.testing.assert_allclose(results[1][1]["sft_loss"], -np.asarray(logp)[mask].mean(), rtol=1e-5)
