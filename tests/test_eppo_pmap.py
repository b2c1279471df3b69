"""4 devices under pmap compute what 1 device computes on the same global batch.

The convention under test (eppo_jax/objective.py): normalisers are psum-ed inside the loss,
and the trainer pmeans the gradients of replicated params over the data axis.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from eppo_jax.objective import LossConfig, eppo_loss, grpo_advantages
from eppo_jax.logprobs import token_logprobs_and_entropy
from eppo_jax.pacing import task_entropy

D, B_LOCAL, T, F, V, K = 4, 3, 6, 5, 7, 3
AXIS = "data"

pytestmark = pytest.mark.skipif(jax.device_count() < D, reason=f"needs {D} devices")


def make_batch(seed):
  """A global batch of a tiny linear policy, with empty rows and an absent task."""
  rng = np.random.default_rng(seed)
  b = D * B_LOCAL
  x = rng.normal(size=(b, T, F)).astype(np.float32)
  w = (0.5 * rng.normal(size=(F, V))).astype(np.float32)
  targets = rng.integers(0, V, size=(b, T)).astype(np.int32)
  mask = (rng.uniform(size=(b, T)) > 0.3).astype(np.float32)
  mask[[1, 7]] = 0.0                         # zero-length responses on two devices
  task_ids = rng.choice([0, 2], size=b).astype(np.int32)  # task 1 absent
  lp0 = np.asarray(policy(jnp.asarray(w), x, targets)[0])
  old = (lp0 + 0.4 * rng.normal(size=(b, T))).astype(np.float32)
  ref = (lp0 + 0.2 * rng.normal(size=(b, T))).astype(np.float32)
  adv = rng.normal(size=b).astype(np.float32)
  eps_low = np.array([0.1, 0.2, 0.3], np.float32)
  eps_high = np.array([0.15, 0.2, 0.35], np.float32)
  data = dict(x=x, targets=targets, old=old, ref=ref, adv=adv, mask=mask, task_ids=task_ids)
  return w, data, eps_low, eps_high


def policy(w, x, targets):
  return token_logprobs_and_entropy(x @ w, targets)


def loss_fn(w, d, eps_low, eps_high, cfg, axis_name):
  logp, ent = policy(w, d["x"], d["targets"])
  return eppo_loss(logp, d["old"], d["adv"], d["mask"], d["task_ids"], eps_low, eps_high,
                   d["ref"], ent, cfg=cfg, axis_name=axis_name, num_tasks=K)


def shard(tree):
  return jax.tree_util.tree_map(lambda a: a.reshape((D, -1) + a.shape[1:]), tree)


CONFIGS = [
    LossConfig(),
    LossConfig(agg="seq-mean-token-mean", dual_clip_c=2.0),
    LossConfig(agg="seq-mean-token-sum-norm", kl_coef=0.2, entropy_coef=0.05),
    LossConfig(kl_coef=0.1, kl_estimator="k1", entropy_coef=0.01, dual_clip_c=3.0),
    LossConfig(policy_loss="kl_cov", kl_cov_ratio=0.1),
    LossConfig(policy_loss="clip_cov", clip_cov_ratio=0.1, clip_cov_lb=-5.0,
               clip_cov_select="top"),
]


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c.policy_loss}-{c.agg}")
def test_loss_gradient_and_metrics_match_single_device(cfg):
  w, data, eps_low, eps_high = make_batch(0)
  (loss1, m1), g1 = jax.jit(jax.value_and_grad(
      functools.partial(loss_fn, cfg=cfg, axis_name=None), has_aux=True))(
          w, data, eps_low, eps_high)

  def device_step(w, d, eps_low, eps_high):
    (loss, m), g = jax.value_and_grad(
        functools.partial(loss_fn, cfg=cfg, axis_name=AXIS), has_aux=True)(w, d, eps_low, eps_high)
    # What the trainer does: pmean gradients (and the loss, for logging).
    return lax.pmean(loss, AXIS), m, lax.pmean(g, AXIS)

  loss4, m4, g4 = jax.pmap(device_step, axis_name=AXIS, in_axes=(None, 0, None, None))(
      w, shard(data), eps_low, eps_high)
  for i in range(D):  # every device holds the global values
    np.testing.assert_allclose(loss4[i], loss1, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(g4[i], g1, atol=1e-6, rtol=1e-6)
    for name in m1:
      np.testing.assert_allclose(m4[name][i], m1[name], atol=1e-6, rtol=1e-6, err_msg=name)
  assert np.abs(np.asarray(g1)).sum() > 0
  if cfg.policy_loss != "ppo_clip":
    assert float(m1["cov_selected_frac"]) > 0


def test_task_entropy_matches_single_device():
  rng = np.random.default_rng(1)
  b = D * B_LOCAL
  ent = rng.uniform(0, 3, size=(b, T)).astype(np.float32)
  mask = (rng.uniform(size=(b, T)) > 0.5).astype(np.float32)
  mask[:B_LOCAL] = 0.0                       # device 0 has no trained token at all
  task_ids = rng.choice([0, 2], size=b).astype(np.int32)
  mean1, cnt1 = task_entropy(ent, mask, task_ids, K)
  mean4, cnt4 = jax.pmap(functools.partial(task_entropy, num_tasks=K, axis_name=AXIS),
                         axis_name=AXIS)(*shard((ent, mask, task_ids)))
  for i in range(D):
    np.testing.assert_allclose(mean4[i], mean1, atol=1e-6, rtol=1e-6)
    np.testing.assert_array_equal(cnt4[i], cnt1)
  assert float(mean1[1]) == 0.0 and int(cnt1[1]) == 0


@pytest.mark.parametrize("per_task_std", [False, True])
def test_advantages_with_global_group_ids_match_single_device(per_task_std):
  rng = np.random.default_rng(2)
  b = D * 4
  groups = rng.integers(0, 5, size=b).astype(np.int32)  # groups span devices
  tasks = (groups % 2).astype(np.int32)
  rewards = rng.integers(0, 3, size=b).astype(np.float32)
  kw = dict(num_groups=5, task_ids=None, num_tasks=2, per_task_std=per_task_std)
  one = grpo_advantages(rewards, groups, **{**kw, "task_ids": tasks})

  def device(r, g, t):
    return grpo_advantages(r, g, **{**kw, "task_ids": t}, axis_name=AXIS)

  four = jax.pmap(device, axis_name=AXIS)(*shard((rewards, groups, tasks)))
  np.testing.assert_allclose(np.asarray(four).reshape(-1), one, atol=1e-6, rtol=1e-6)
