"""The EPPO loss and GRPO advantages against independent NumPy references."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eppo_jax.objective import (ADVANTAGE_ESTIMATORS, LossConfig, eppo_loss, grpo_advantages,
                                kl_penalty, method_configs)
from eppo_jax.pacing import PacingState, init_pacing, pacing_bounds

B, T, K = 8, 12, 3

# ----------------------------------------------------------------------------- references


def np_clipped_objective(logp, old, adv, mask, task_ids, eps_low, eps_high, dual_c=None,
                         agg="token-mean", norm_len=None):
  """The standard clipped surrogate, token by token, in float64 (no JAX)."""
  logp, old, adv = (np.asarray(x, np.float64) for x in (logp, old, adv))
  rows, lengths = [], []
  for b in range(logp.shape[0]):
    lo, hi = float(eps_low[task_ids[b]]), float(eps_high[task_ids[b]])
    losses = []
    for t in range(logp.shape[1]):
      if mask[b, t] <= 0:
        continue
      r = np.exp(np.clip(logp[b, t] - old[b, t], -20, 20))
      a = adv[b]
      loss = max(-a * r, -a * min(max(r, 1 - lo), 1 + hi))
      if dual_c is not None and a < 0:
        loss = min(loss, -a * dual_c)
      losses.append(loss)
    rows.append(losses)
    lengths.append(len(losses))
  if agg == "token-mean":
    flat = [x for row in rows for x in row]
    return sum(flat) / max(len(flat), 1)
  nonempty = [row for row in rows if row]
  if agg == "seq-mean-token-mean":
    per_seq = [sum(row) / len(row) for row in nonempty]
  else:
    per_seq = [sum(row) / (norm_len or logp.shape[1]) for row in nonempty]
  return sum(per_seq) / max(len(per_seq), 1)


def np_grpo_advantages(rewards, groups, estimator="grpo", eps=1e-6, task_ids=None, valid=None):
  """Loop-by-loop reference; only `valid` entries with a finite reward count anywhere."""
  ok = np.isfinite(rewards) & (np.ones(len(rewards), bool) if valid is None else valid)
  out = np.zeros(len(rewards))
  for i, (r, g) in enumerate(zip(rewards, groups)):
    members = rewards[(groups == g) & ok].astype(np.float64)
    if not ok[i] or len(members) < 2 or np.all(members == members[0]):
      continue
    if estimator == "rloo":
      out[i] = r - (members.sum() - r) / (len(members) - 1)
    elif estimator == "drgrpo":
      out[i] = r - members.mean()
    else:
      pool = members if task_ids is None else rewards[(task_ids == task_ids[i]) & ok]
      out[i] = (r - members.mean()) / (np.std(pool, ddof=1) + eps)
  return out


def random_batch(seed, b=B, t=T, k=K, noise=0.3, empty_rows=(1, 5)):
  """Logprobs with enough old/new mismatch that both clip sides and dual-clip fire."""
  rng = np.random.default_rng(seed)
  logp = -rng.uniform(0.01, 3.0, size=(b, t)).astype(np.float32)
  old = (logp + noise * rng.normal(size=(b, t))).astype(np.float32)
  adv = rng.normal(size=b).astype(np.float32)
  mask = (rng.uniform(size=(b, t)) > 0.3).astype(np.float32)
  for row in empty_rows:
    if row < b:
      mask[row] = 0.0
  task_ids = rng.integers(0, k, size=b).astype(np.int32)
  eps_low = rng.uniform(0.05, 0.4, size=k).astype(np.float32)
  eps_high = rng.uniform(0.05, 0.4, size=k).astype(np.float32)
  return logp, old, adv, mask, task_ids, eps_low, eps_high


_loss = jax.jit(eppo_loss, static_argnames=("cfg", "axis_name", "num_tasks"))

# ----------------------------------------------------------------------------- surrogate


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("dual_c", [None, 1.5])
@pytest.mark.parametrize("bounds", ["grpo", "dapo", "per_task"])
def test_loss_matches_numpy_reference(agg, dual_c, bounds):
  cfg = LossConfig(agg=agg, dual_clip_c=dual_c)
  for seed in range(3):
    logp, old, adv, mask, tid, lo, hi = random_batch(seed)
    if bounds == "grpo":
      lo, hi = np.full(K, 0.2, np.float32), np.full(K, 0.2, np.float32)
    elif bounds == "dapo":
      lo, hi = np.full(K, 0.2, np.float32), np.full(K, 0.28, np.float32)
    loss, metrics = _loss(logp, old, adv, mask, tid, lo, hi, cfg=cfg)
    ref = np_clipped_objective(logp, old, adv, mask, tid, lo, hi, dual_c, agg)
    np.testing.assert_allclose(float(loss), ref, atol=1e-6, rtol=1e-6)
    np.testing.assert_allclose(float(metrics["loss"]), ref, atol=1e-6, rtol=1e-6)


def test_seq_norm_len_and_scalar_bounds():
  logp, old, adv, mask, tid, _, _ = random_batch(7)
  cfg = LossConfig(agg="seq-mean-token-sum-norm", seq_norm_len=64)
  loss, _ = _loss(logp, old, adv, mask, tid, 0.2, 0.28, cfg=cfg, num_tasks=K)
  ref = np_clipped_objective(logp, old, adv, mask, tid, [0.2] * K, [0.28] * K, None,
                             "seq-mean-token-sum-norm", norm_len=64)
  np.testing.assert_allclose(float(loss), ref, atol=1e-6, rtol=1e-6)


def test_per_token_advantages_equal_broadcast_sequence_advantages():
  logp, old, adv, mask, tid, lo, hi = random_batch(8)
  a, _ = _loss(logp, old, adv, mask, tid, lo, hi)
  b, _ = _loss(logp, old, np.repeat(adv[:, None], T, axis=1), mask, tid, lo, hi)
  assert float(a) == float(b)


def test_metrics_match_numpy():
  logp, old, adv, mask, tid, lo, hi = random_batch(9, noise=0.6)
  _, m = _loss(logp, old, adv, mask, tid, lo, hi, cfg=LossConfig(dual_clip_c=1.5))
  r = np.exp(logp.astype(np.float64) - old)
  a = adv[:, None] * np.ones_like(r)
  valid = mask > 0
  low = (a < 0) & (r < 1 - lo[tid][:, None])
  high = (a > 0) & (r > 1 + hi[tid][:, None])
  for k in range(K):
    sel = valid & (tid[:, None] == k)
    assert int(m["token_count_K"][k]) == sel.sum()
    if sel.sum():
      np.testing.assert_allclose(m["clip_frac_low_K"][k], low[sel].mean(), atol=1e-6)
      np.testing.assert_allclose(m["clip_frac_high_K"][k], high[sel].mean(), atol=1e-6)
      np.testing.assert_allclose(m["approx_kl_K"][k], 0.5 * ((logp - old)[sel]**2).mean(),
                                 rtol=1e-5)
  np.testing.assert_allclose(m["clip_frac_high"], high[valid].mean(), atol=1e-6)
  np.testing.assert_allclose(m["dual_clip_frac"], ((a < 0) & (r > 1.5))[valid].mean(), atol=1e-6)
  assert 0 < float(m["clip_frac_low"]) < 1 and 0 < float(m["clip_frac_high"]) < 1
  assert float(m["dual_clip_frac"]) > 0


def test_masked_garbage_does_not_leak():
  logp, old, adv, mask, tid, lo, hi = random_batch(10)
  bad_logp, bad_old = logp.copy(), old.copy()
  bad_logp[mask == 0] = -np.inf
  bad_old[mask == 0] = np.nan
  cfg = LossConfig(kl_coef=0.1, entropy_coef=0.01)
  ent = np.where(mask > 0, 1.0, np.nan).astype(np.float32)

  @jax.jit
  def f(lp, o):
    return jax.value_and_grad(
        lambda x: eppo_loss(x, o, adv, mask, tid, lo, hi, o, ent, cfg=cfg)[0])(lp)

  clean, _ = f(logp, old)
  dirty, grad = f(bad_logp, bad_old)
  assert float(clean) == float(dirty)
  assert np.all(np.isfinite(grad)) and np.all(np.asarray(grad)[mask == 0] == 0)


def test_kl_estimators():
  lp = jnp.array([-1.0, -2.0, -0.5, -30.0])
  ref = jnp.array([-1.5, -1.0, -0.5, -1.0])
  d = np.asarray(lp - ref, np.float64)
  np.testing.assert_allclose(kl_penalty(lp, ref, "k1"), d, rtol=1e-6)
  np.testing.assert_allclose(kl_penalty(lp, ref, "k2"), 0.5 * d**2, rtol=1e-6)
  k3 = np.exp(-d) - (-d) - 1
  np.testing.assert_allclose(kl_penalty(lp, ref, "k3")[:3], k3[:3], rtol=1e-5)
  assert float(kl_penalty(lp, ref, "k3")[3]) == 10.0     # clamped, not inf
  assert np.all(np.asarray(kl_penalty(lp, ref, "k3")) >= 0)
  assert LossConfig(kl_estimator="low_var_kl").kl_estimator == "k3"


def test_kl_and_entropy_terms_enter_the_loss():
  logp, old, adv, mask, tid, lo, hi = random_batch(11)
  ref = (logp + 0.2).astype(np.float32)
  ent = np.full_like(logp, 2.0)
  base, _ = _loss(logp, old, adv, mask, tid, lo, hi, cfg=LossConfig())
  for est in ["k1", "k2", "k3"]:
    got, m = _loss(logp, old, adv, mask, tid, lo, hi, ref, ent,
                   cfg=LossConfig(kl_coef=0.5, kl_estimator=est, entropy_coef=0.1))
    kl = np.asarray(kl_penalty(jnp.asarray(logp), jnp.asarray(ref), est))[mask > 0].mean()
    np.testing.assert_allclose(float(got), float(base) + 0.5 * kl - 0.1 * 2.0, atol=1e-6)
    np.testing.assert_allclose(float(m["kl_ref"]), kl, rtol=1e-5)
    np.testing.assert_allclose(float(m["entropy"]), 2.0, rtol=1e-6)
  with pytest.raises(ValueError, match="ref_logprobs"):
    eppo_loss(logp, old, adv, mask, tid, lo, hi, cfg=LossConfig(kl_coef=0.1))


@pytest.mark.parametrize("cfg", [
    LossConfig(),
    LossConfig(agg="seq-mean-token-mean", dual_clip_c=1.5),
    LossConfig(agg="seq-mean-token-sum-norm", kl_coef=0.3, kl_estimator="k3", entropy_coef=0.05),
])
def test_gradient_matches_finite_differences(cfg):
  logp, old, adv, mask, tid, lo, hi = random_batch(12, b=4, t=5, empty_rows=(2,))
  rng = np.random.default_rng(0)
  with jax.enable_x64(True):
    args = [np.asarray(x, np.float64) for x in (old, adv, mask)]
    ref = np.asarray(logp, np.float64) + 0.1
    ent_scale = rng.uniform(0.5, 1.5, size=logp.shape)

    @jax.jit
    def f(lp):
      # The entropy depends on the logprobs too, so the bonus has a gradient to check.
      ent = -lp * ent_scale
      return eppo_loss(lp, args[0], args[1], args[2], tid, lo.astype(np.float64),
                       hi.astype(np.float64), ref, ent, cfg=cfg)[0]

    x = np.asarray(logp, np.float64)
    grad = np.asarray(jax.grad(f)(x))
    assert grad.dtype == np.float64
    h = 1e-6
    fd = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
      e = np.zeros_like(x)
      e[idx] = h
      fd[idx] = (float(f(x + e)) - float(f(x - e))) / (2 * h)
    np.testing.assert_allclose(grad, fd, atol=1e-7, rtol=1e-5)
    assert np.abs(grad).sum() > 0


def test_alpha_zero_is_bitwise_grpo():
  logp, old, adv, mask, tid, _, _ = random_batch(13)
  rng = np.random.default_rng(1)
  state = init_pacing(K).replace(ema_K=jnp.asarray(rng.uniform(0.1, 3, K), jnp.float32),
                                 seen_K=jnp.ones(K, bool))
  for method, base_high in [("grpo", 0.2), ("dapo", 0.28)]:
    pacing_cfg, loss_cfg = method_configs(method)
    eppo_cfg, _ = method_configs("eppo", alpha=0.0, eps0_high=base_high)
    fixed = (jnp.full((K,), 0.2, jnp.float32), jnp.full((K,), base_high, jnp.float32))
    for pcfg in (pacing_cfg, eppo_cfg):
      paced = pacing_bounds(state, pcfg)

      def f(lp, bounds):
        return eppo_loss(lp, old, adv, mask, tid, *bounds, cfg=loss_cfg)[0]

      (l1, g1), (l2, g2) = (jax.value_and_grad(f)(jnp.asarray(logp), b) for b in (paced, fixed))
      assert np.array_equal(np.asarray(l1), np.asarray(l2))
      assert np.array_equal(np.asarray(g1), np.asarray(g2))


def test_pacing_changes_the_loss_when_on():
  logp, old, adv, mask, tid, _, _ = random_batch(14, noise=0.5)
  state = init_pacing(K).replace(ema_K=jnp.array([0.2, 1.0, 3.0]), seen_K=jnp.ones(K, bool))
  lo, hi = pacing_bounds(state, method_configs("eppo")[0])
  paced, _ = _loss(logp, old, adv, mask, tid, lo, hi)
  fixed, _ = _loss(logp, old, adv, mask, tid, jnp.full(K, 0.2), jnp.full(K, 0.2))
  assert float(paced) != float(fixed)


# ----------------------------------------------------------------------------- Clip-Cov / KL-Cov


def np_covariance(logp, adv, mask):
  valid = mask > 0
  a = np.broadcast_to(adv[:, None], logp.shape).astype(np.float64)
  return (logp - logp[valid].mean()) * (a - a[valid].mean()), valid


def test_kl_cov_matches_reference():
  logp, old, adv, mask, tid, lo, hi = random_batch(15)
  cfg = LossConfig(policy_loss="kl_cov", kl_cov_ratio=0.1, kl_cov_coef=0.7)
  loss, m = _loss(logp, old, adv, mask, tid, lo, hi, cfg=cfg)
  cov, valid = np_covariance(logp.astype(np.float64), adv, mask)
  n = max(1, int(np.floor(0.1 * valid.sum())))
  top = np.argsort(-np.where(valid, cov, -np.inf), axis=None)[:n]
  chosen = np.zeros(valid.size, bool)
  chosen[top] = True
  chosen = chosen.reshape(valid.shape)
  r = np.exp(logp.astype(np.float64) - old)
  tok = -adv[:, None] * r + np.where(chosen, 0.7 * np.abs(logp - old), 0.0)
  np.testing.assert_allclose(float(loss), tok[valid].mean(), atol=1e-6)
  np.testing.assert_allclose(float(m["cov_selected_frac"]), n / valid.sum(), atol=1e-6)


@pytest.mark.parametrize("select", ["top", "random"])
def test_clip_cov_detaches_selected_tokens(select):
  logp, old, adv, mask, tid, lo, hi = random_batch(16)
  cfg = LossConfig(policy_loss="clip_cov", clip_cov_ratio=0.1, clip_cov_lb=-10.0,
                   clip_cov_ub=10.0, clip_cov_select=select)
  rng = jax.random.PRNGKey(0)

  def f(lp, c):
    return eppo_loss(lp, old, adv, mask, tid, lo, hi, cfg=c, rng=rng)

  (loss, m), g = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logp), cfg)
  (base, _), g0 = jax.value_and_grad(f, has_aux=True)(jnp.asarray(logp), LossConfig())
  assert float(loss) == pytest.approx(float(base), abs=1e-6)   # detached, not removed
  zeroed = (np.asarray(g) == 0) & (np.asarray(g0) != 0)
  valid = mask > 0
  n = max(1, int(np.floor(0.1 * valid.sum())))
  assert zeroed.sum() == n
  np.testing.assert_array_equal(np.asarray(g)[~zeroed], np.asarray(g0)[~zeroed])
  np.testing.assert_allclose(float(m["cov_selected_frac"]), n / valid.sum(), atol=1e-6)
  if select == "top":  # the largest covariances among eligible (unclipped) tokens
    cov, _ = np_covariance(logp.astype(np.float64), adv, mask)
    r = np.exp(logp.astype(np.float64) - old)
    a = adv[:, None]
    clipped = -a * np.clip(r, 1 - lo[tid][:, None], 1 + hi[tid][:, None]) > -a * r
    eligible = valid & ~clipped
    assert cov[zeroed].min() >= np.sort(cov[eligible])[-n]
  with pytest.raises(ValueError, match="rng"):
    eppo_loss(logp, old, adv, mask, tid, lo, hi, cfg=LossConfig(policy_loss="clip_cov"))


@pytest.mark.parametrize("window", [(0.2, 0.6), (0.5, 0.56)])
def test_clip_cov_selects_inside_the_covariance_window(window):
  logp, old, adv, mask, tid, lo, hi = random_batch(17)
  cov, valid = np_covariance(logp.astype(np.float64), adv, mask)
  # The wide window excludes the largest covariances ("top" must pick the largest inside);
  # the narrow one holds fewer tokens than the quota (all of them, and only them, are picked).
  lb, ub = (float(q) for q in np.quantile(cov[valid], window))
  cfg = LossConfig(policy_loss="clip_cov", clip_cov_ratio=0.1, clip_cov_lb=lb, clip_cov_ub=ub,
                   clip_cov_select="top")
  grad = jax.jit(jax.grad(lambda lp, c: eppo_loss(lp, old, adv, mask, tid, lo, hi, cfg=c)[0]),
                 static_argnums=1)
  g, g0 = grad(logp, cfg), grad(logp, LossConfig())
  zeroed = (np.asarray(g) == 0) & (np.asarray(g0) != 0)
  r = np.exp(logp.astype(np.float64) - old)
  a = adv[:, None]
  clipped = -a * np.clip(r, 1 - lo[tid][:, None], 1 + hi[tid][:, None]) > -a * r
  eligible = valid & ~clipped & (cov > lb) & (cov < ub)
  n = max(1, int(np.floor(0.1 * valid.sum())))
  in_window = np.sort(cov[eligible])
  expected = eligible & (cov >= in_window[-min(n, in_window.size)])
  np.testing.assert_array_equal(zeroed, expected)


# ----------------------------------------------------------------------------- advantages

_adv = jax.jit(grpo_advantages, static_argnames=("num_groups", "estimator", "num_tasks",
                                                 "per_task_std", "eps", "axis_name"))


@pytest.mark.parametrize("estimator", sorted(ADVANTAGE_ESTIMATORS))
def test_advantages_match_numpy(estimator):
  rng = np.random.default_rng(17)
  groups = np.array([0, 0, 0, 0, 1, 1, 1, 2, 3, 3, 4, 4, 4, 5, 5, 5])  # 2 singleton, 4 all-equal
  rewards = rng.normal(size=groups.size).astype(np.float32)
  rewards[groups == 3] = 0.7
  rewards[groups == 4] = 0.9  # in float32, (0.9 + 0.9 + 0.9) / 3 != 0.9: rounding must not leak
  got = _adv(rewards, groups, num_groups=6, estimator=estimator)
  ref = np_grpo_advantages(rewards, groups, estimator)
  np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)
  assert np.all(np.asarray(got)[np.isin(groups, [2, 3, 4])] == 0.0)


def test_per_task_std():
  rng = np.random.default_rng(18)
  groups = np.repeat(np.arange(6), 4)
  tasks = np.repeat([0, 0, 1, 1, 2, 2], 4)
  rewards = (rng.normal(size=24) * np.repeat([1.0, 10.0, 0.1], 8)).astype(np.float32)
  got = grpo_advantages(rewards, groups, 6, task_ids=tasks, num_tasks=3, per_task_std=True)
  ref = np_grpo_advantages(rewards, groups, task_ids=tasks)
  np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)
  with pytest.raises(ValueError):
    grpo_advantages(rewards, groups, 6, per_task_std=True)
  with pytest.raises(ValueError, match="estimator"):
    grpo_advantages(rewards, groups, 6, estimator="ppo")


@pytest.mark.parametrize("estimator", sorted(ADVANTAGE_ESTIMATORS))
@pytest.mark.parametrize("per_task_std", [False, True])
def test_failed_and_nonfinite_episodes_are_left_out(estimator, per_task_std):
  """Failed (valid=False) and NaN / +-inf episodes get 0 and count in no group's statistics."""
  rng = np.random.default_rng(19)
  groups = np.repeat(np.arange(6), 4)
  tasks = np.repeat([0, 1, 2, 0, 1, 2], 4)
  rewards = rng.normal(size=24).astype(np.float32)
  rewards[[1, 9, 22]] = [np.nan, np.inf, -np.inf]  # Groups 0, 2, 5.
  valid = np.ones(24, bool)
  valid[[2, 13]] = False  # Failed episodes: group 0 keeps 2 healthy members, group 3 keeps 3.
  valid[[16, 17, 18]] = False  # Group 4 keeps one healthy member: contributes nothing.
  rewards[4:8] = [0.3, 0.3, 0.3, 5.0]
  valid[7] = False  # Group 1's healthy members all equal: 0 despite the failed outlier.
  kw = dict(task_ids=tasks, num_tasks=3, per_task_std=per_task_std)
  got = np.asarray(grpo_advantages(rewards, groups, 6, estimator=estimator, valid_B=valid, **kw))
  ref = np_grpo_advantages(rewards, groups, estimator, task_ids=tasks if per_task_std else None,
                           valid=valid)
  np.testing.assert_allclose(got, ref, atol=1e-5, rtol=1e-5)
  healthy = valid & np.isfinite(rewards)
  assert np.all(got[~healthy] == 0.0) and np.all(got[4:8] == 0.0) and np.all(got[16:20] == 0.0)
  assert np.count_nonzero(got) == 11  # Groups 0, 2, 3, 5 (2 + 3 + 3 + 3 healthy) still learn.
  # The same as computing on the healthy episodes alone.
  alone = np.asarray(grpo_advantages(rewards[healthy], groups[healthy], 6, estimator=estimator,
                                     **dict(kw, task_ids=tasks[healthy])))
  np.testing.assert_allclose(got[healthy], alone, atol=1e-6)
  # NaN / inf alone (no valid_B) mark the episode too.
  no_mask = np.asarray(grpo_advantages(rewards, groups, 6, estimator=estimator, **kw))
  np.testing.assert_allclose(no_mask, np_grpo_advantages(
      rewards, groups, estimator, task_ids=tasks if per_task_std else None), atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), levels=st.integers(1, 4))
def test_advantages_are_finite_for_any_grouping(seed, levels):
  rng = np.random.default_rng(seed)
  groups = rng.integers(0, 8, size=16)
  rewards = rng.integers(0, levels, size=16).astype(np.float32)  # many ties
  got = np.asarray(_adv(rewards, groups, num_groups=8))
  assert np.all(np.isfinite(got))
  np.testing.assert_allclose(got, np_grpo_advantages(rewards, groups), atol=1e-4)


# ----------------------------------------------------------------------------- properties


def _loss_and_grad_fn(logp, old, adv, mask, tid, lo, hi, cfg):
  def f(lp):
    return eppo_loss(lp, old, adv, mask, tid, lo, hi, lp + 0.1, -lp, cfg=cfg)

  (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(logp)
  return loss, grad, metrics


# One compilation per config, not per example: shapes are fixed.
_loss_and_grad = jax.jit(_loss_and_grad_fn, static_argnames=("cfg",))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), density=st.sampled_from([0.0, 0.05, 0.5, 1.0]),
       agg=st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]),
       method=st.sampled_from(["eppo", "dapo", "kl_cov"]))
def test_any_mask_gives_finite_loss_and_gradient(seed, density, agg, method):
  rng = np.random.default_rng(seed)
  logp, old, adv, _, tid, lo, hi = random_batch(seed, noise=float(rng.uniform(0, 30)))
  mask = (rng.uniform(size=logp.shape) < density).astype(np.float32)
  mask[rng.integers(0, B)] = 0.0  # at least one zero-length response
  _, cfg = method_configs(method, agg=agg, kl_coef=0.1, entropy_coef=0.01)
  loss, grad, metrics = _loss_and_grad(logp, old, adv, mask, tid, lo, hi, cfg)
  assert np.isfinite(float(loss)) and np.all(np.isfinite(grad))
  assert all(np.all(np.isfinite(np.asarray(v))) for v in metrics.values())
  if density == 0.0:
    assert float(loss) == 0.0 and np.all(np.asarray(grad) == 0)




# ----------------------------------------------------------------------------- presets


def test_method_configs():
  eppo_p, eppo_l = method_configs("eppo")
  assert eppo_p.alpha == 1.0 and eppo_l.policy_loss == "ppo_clip"
  grpo_p, _ = method_configs("grpo")
  assert (grpo_p.alpha, grpo_p.eps0_low, grpo_p.eps0_high) == (0.0, 0.2, 0.2)
  dapo_p, dapo_l = method_configs("dapo")
  assert (dapo_p.alpha, dapo_p.eps0_low, dapo_p.eps0_high) == (0.0, 0.2, 0.28)
  assert dapo_l.agg == "token-mean"
  assert method_configs("clip_cov")[1].policy_loss == "clip_cov"
  assert method_configs("kl_cov")[1].policy_loss == "kl_cov"
  p, l = method_configs("eppo", rho=0.5, kl_coef=0.01)
  assert p.rho == 0.5 and l.kl_coef == 0.01
  with pytest.raises(ValueError, match="clip_cov.*dapo.*eppo.*grpo.*kl_cov"):
    method_configs("ppo")
  with pytest.raises(ValueError, match="not_a_field"):
    method_configs("eppo", not_a_field=1)


def test_loss_config_validation():
  with pytest.raises(ValueError, match="agg"):
    LossConfig(agg="sum")
  with pytest.raises(ValueError, match="kl_estimator"):
    LossConfig(kl_estimator="k4")
  with pytest.raises(ValueError, match="dual_clip_c"):
    LossConfig(dual_clip_c=0.5)
  assert hash(LossConfig()) == hash(LossConfig())


def test_pacing_state_is_a_pytree():
  leaves = jax.tree_util.tree_leaves(init_pacing(K))
  assert len(leaves) == len(PacingState.__dataclass_fields__)
