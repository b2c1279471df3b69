"""Entropy pacing: entropies, the smoothed state, task-wise bounds and the diagnostics."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eppo_jax.pacing import (PacingConfig, PacingState, entropy_crossovers, entropy_ratio,
                             entropy_spikes, init_pacing, pacing_bounds, pacing_diagnostics,
                             task_entropy, update_pacing)

K = 4


def state_with(ema, seen=None, initial=None):
  """A pacing state with given smoothed entropies (all seen unless told)."""
  ema = jnp.asarray(ema, jnp.float32)
  seen = jnp.ones(ema.shape, bool) if seen is None else jnp.asarray(seen)
  initial = ema if initial is None else jnp.asarray(initial, jnp.float32)
  return init_pacing(ema.shape[0]).replace(ema_K=ema, seen_K=seen, initial_K=initial)


# ----------------------------------------------------------------------------- entropies


def np_task_entropy(ent, mask, task_ids, num_tasks):
  sums, counts = np.zeros(num_tasks), np.zeros(num_tasks, np.int64)
  for b in range(ent.shape[0]):
    for t in range(ent.shape[1]):
      if mask[b, t] > 0 and 0 <= task_ids[b] < num_tasks:
        sums[task_ids[b]] += ent[b, t]
        counts[task_ids[b]] += 1
  return np.where(counts > 0, sums / np.maximum(counts, 1), 0.0), counts


def test_task_entropy_matches_numpy_and_handles_missing_tasks():
  rng = np.random.default_rng(1)
  ent = rng.uniform(0, 3, size=(6, 5)).astype(np.float32)
  mask = (rng.uniform(size=(6, 5)) > 0.4).astype(np.float32)
  mask[2] = 0.0                                  # an empty row
  task_ids = np.array([0, 1, 1, 0, 3, -1])       # task 2 absent; -1 = padding row
  ent[:, -1] = np.nan                            # garbage at a position that is never trained
  mask[:, -1] = 0.0
  mean, cnt = task_entropy(jnp.asarray(ent), jnp.asarray(mask), jnp.asarray(task_ids), K)
  ref_mean, ref_cnt = np_task_entropy(np.nan_to_num(ent), mask, task_ids, K)
  np.testing.assert_allclose(mean, ref_mean, rtol=1e-6)
  np.testing.assert_array_equal(cnt, ref_cnt)
  assert mean.dtype == jnp.float32 and cnt.dtype == jnp.int32
  assert float(mean[2]) == 0.0 and int(cnt[2]) == 0


# ----------------------------------------------------------------------------- state


def test_first_sight_initialises_then_ema():
  cfg = PacingConfig(rho=0.9)
  state = init_pacing(K)
  ent1 = jnp.array([1.0, 2.0, 0.0, 0.0])
  cnt1 = jnp.array([5, 3, 0, 0])
  s1 = update_pacing(state, ent1, cnt1, cfg)
  np.testing.assert_array_equal(s1.seen_K, [True, True, False, False])
  np.testing.assert_allclose(s1.ema_K, [1.0, 2.0, 0.0, 0.0])
  np.testing.assert_allclose(s1.initial_K, [1.0, 2.0, 0.0, 0.0])
  ent2 = jnp.array([2.0, 2.0, 0.5, 0.0])
  s2 = update_pacing(s1, ent2, jnp.array([5, 3, 4, 0]), cfg)
  np.testing.assert_allclose(s2.ema_K, [0.9 * 1 + 0.1 * 2, 2.0, 0.5, 0.0], rtol=1e-6)
  np.testing.assert_allclose(s2.initial_K, [1.0, 2.0, 0.5, 0.0])
  np.testing.assert_allclose(s2.last_K, [2.0, 2.0, 0.5, 0.0])
  np.testing.assert_array_equal(s2.innov_n_K, [1, 1, 0, 0])
  assert int(s2.step) == 2


def test_absent_task_keeps_its_state():
  cfg = PacingConfig()
  rng = np.random.default_rng(2)
  state = init_pacing(K)
  for _ in range(4):
    state = update_pacing(state, jnp.asarray(rng.uniform(0, 2, K), jnp.float32),
                          jnp.full((K,), 7), cfg)
  # Task 1 is absent; its batch "entropy" value is garbage and must be ignored.
  new = update_pacing(state, jnp.array([0.3, 99.0, 0.4, 0.5]), jnp.array([3, 0, 2, 1]), cfg)
  for field in dataclasses.fields(PacingState):
    if field.name == "step":
      continue
    old_v, new_v = getattr(state, field.name), getattr(new, field.name)
    np.testing.assert_array_equal(old_v[1], new_v[1], err_msg=field.name)
  eps_low_old, _ = pacing_bounds(state, cfg)
  assert not np.array_equal(np.asarray(state.ema_K)[[0, 2, 3]], np.asarray(new.ema_K)[[0, 2, 3]])
  assert np.isfinite(np.asarray(eps_low_old)).all()


def test_min_tokens_treats_small_tasks_as_absent():
  cfg = PacingConfig(min_tokens=10)
  s = update_pacing(init_pacing(2), jnp.array([1.0, 2.0]), jnp.array([9, 10]), cfg)
  np.testing.assert_array_equal(s.seen_K, [False, True])


def test_update_and_bounds_are_jittable_with_static_config():
  cfg = PacingConfig()
  step = jax.jit(lambda s, e, c: pacing_bounds(update_pacing(s, e, c, cfg), cfg))
  lo, hi = step(init_pacing(K), jnp.array([1.0, 2.0, 0.5, 1.5]), jnp.array([1, 1, 1, 1]))
  assert lo.shape == hi.shape == (K,)
  assert hash(cfg) == hash(PacingConfig())


# ----------------------------------------------------------------------------- bounds


def np_bounds(ema, seen, cfg, initial=None):
  """Independent transcription of the documented bound."""
  ema = np.asarray(ema, np.float64)
  if cfg.scheme == "cross_task_mean":
    ref = np.full_like(ema, ema[seen].mean() if seen.any() else 0.0)
  elif cfg.scheme == "initial":
    ref = np.asarray(initial, np.float64)
  else:
    ref = np.full_like(ema, cfg.target_entropy)
  u = np.where(seen, ema / (ref + cfg.delta), 1.0)
  lo = np.clip(cfg.eps0_low * u**cfg.alpha, cfg.eps_min, cfg.eps_max)
  hi = np.clip(cfg.eps0_high * u**cfg.alpha, cfg.eps_min, cfg.eps_max)
  return lo, hi


@pytest.mark.parametrize("scheme", ["cross_task_mean", "initial", "target"])
@pytest.mark.parametrize("alpha", [1.0, 0.5, 2.0])
def test_bounds_match_formula(scheme, alpha):
  cfg = PacingConfig(scheme=scheme, alpha=alpha, eps0_low=0.2, eps0_high=0.28)
  ema = np.array([0.2, 1.0, 1.7, 0.6], np.float32)
  seen = np.array([True, True, True, False])
  initial = np.array([0.8, 1.1, 0.9, 0.0], np.float32)
  lo, hi = pacing_bounds(state_with(ema, seen, initial), cfg)
  ref_lo, ref_hi = np_bounds(ema, seen, cfg, initial)
  np.testing.assert_allclose(lo, ref_lo, rtol=1e-6)
  np.testing.assert_allclose(hi, ref_hi, rtol=1e-6)
  # The unseen task gets the base bound.
  assert float(lo[3]) == pytest.approx(0.2) and float(hi[3]) == pytest.approx(0.28)


def test_equal_entropies_give_equal_bounds():
  cfg = PacingConfig(eps0_low=0.2, eps0_high=0.28)
  for h in [0.0, 0.01, 1.0, 3.7]:
    lo, hi = pacing_bounds(state_with([h] * K), cfg)
    assert np.all(np.asarray(lo) == np.asarray(lo)[0]) and np.all(np.asarray(hi) == np.asarray(hi)[0])
    if h > 0:  # u = h / (h + delta), one up to delta: the base bound
      u = h / (h + cfg.delta)
      np.testing.assert_allclose(lo, 0.2 * u, rtol=1e-6)
      np.testing.assert_allclose(hi, 0.28 * u, rtol=1e-6)


def test_alpha_zero_is_exactly_the_fixed_bounds():
  rng = np.random.default_rng(3)
  for eps_low, eps_high in [(0.2, 0.2), (0.2, 0.28), (1.0, 1.0), (0.01, 0.9)]:
    cfg = PacingConfig(alpha=0.0, eps0_low=eps_low, eps0_high=eps_high)
    seen = rng.uniform(size=K) > 0.3
    lo, hi = pacing_bounds(state_with(rng.uniform(0, 3, K), seen), cfg)
    assert np.array_equal(np.asarray(lo), np.asarray(jnp.full((K,), eps_low, jnp.float32)))
    assert np.array_equal(np.asarray(hi), np.asarray(jnp.full((K,), eps_high, jnp.float32)))


@pytest.mark.parametrize("scheme", ["cross_task_mean", "initial", "target"])
def test_bound_is_monotone_in_task_entropy_and_in_range(scheme):
  cfg = PacingConfig(scheme=scheme)
  others = np.array([0.9, 1.3, 0.4], np.float32)
  sweep = np.linspace(0.0, 5.0, 60, dtype=np.float32)
  lows, highs = [], []
  for h in sweep:
    ema = np.concatenate([[h], others])
    lo, hi = pacing_bounds(state_with(ema, initial=np.ones(K)), cfg)
    lows.append(float(lo[0]))
    highs.append(float(hi[0]))
    for eps in (lo, hi):
      assert np.all(np.asarray(eps) >= cfg.eps_min) and np.all(np.asarray(eps) <= cfg.eps_max)
  assert np.all(np.diff(lows) >= 0) and np.all(np.diff(highs) >= 0)
  # Pacing does something: the lowest entropy is tightest, the highest widest.
  assert lows[0] == pytest.approx(cfg.eps_min) and lows[-1] == pytest.approx(cfg.eps_max)


def test_low_entropy_task_is_tightened_high_entropy_task_relaxed():
  lo, hi = pacing_bounds(state_with([0.5, 1.0, 1.5, 1.0]), PacingConfig())
  assert float(lo[0]) < 0.2 < float(lo[2])
  assert float(hi[0]) < 0.2 < float(hi[2])
  np.testing.assert_allclose(lo[1], 0.2, rtol=1e-5)


def test_entropy_ratio_of_cross_task_mean_is_unweighted():
  u = entropy_ratio(state_with([1.0, 3.0, 0.0, 0.0], seen=[True, True, False, False]),
                    PacingConfig())
  np.testing.assert_allclose(u, [0.5, 1.5, 1.0, 1.0], rtol=1e-5)


def test_config_validation():
  with pytest.raises(ValueError, match="scheme"):
    PacingConfig(scheme="nope")
  with pytest.raises(ValueError):
    PacingConfig(eps_min=0.5, eps_max=0.4)
  with pytest.raises(ValueError):
    PacingConfig(rho=1.0)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), steps=st.integers(1, 6),
       scheme=st.sampled_from(["cross_task_mean", "initial", "target"]))
def test_any_entropy_stream_gives_finite_bounds_in_range(seed, steps, scheme):
  cfg = PacingConfig(scheme=scheme)
  rng = np.random.default_rng(seed)
  state = init_pacing(K)
  for _ in range(steps):
    # Entropies include exact zeros (collapsed tasks); counts include absent tasks.
    ent = rng.choice([0.0, 1e-8, 0.5, 2.0, 7.0], size=K) * rng.uniform(size=K)
    cnt = rng.integers(0, 3, size=K)
    state = _update(state, jnp.asarray(ent, jnp.float32), jnp.asarray(cnt), cfg)
    lo, hi = _bounds(state, cfg)
    for eps in (np.asarray(lo), np.asarray(hi)):
      assert np.all(np.isfinite(eps))
      assert np.all(eps >= cfg.eps_min) and np.all(eps <= cfg.eps_max)
    assert np.all(np.isfinite(np.asarray(state.ema_K)))


_update = jax.jit(update_pacing, static_argnums=3)
_bounds = jax.jit(pacing_bounds, static_argnums=1)


# ----------------------------------------------------------------------------- diagnostics


def test_crossovers_count_order_flips():
  prev = jnp.array([1.0, 2.0, 3.0, 4.0])
  cur = jnp.array([2.5, 2.0, 3.0, 1.0])  # 0 passes 1; 3 drops below 0, 1 and 2
  valid = jnp.ones(4, bool)
  assert int(entropy_crossovers(prev, cur, valid)) == 4
  # Which pairs: with only tasks i and j valid, the count is 1 exactly when that pair flips.
  expected = {(0, 1), (0, 3), (1, 3), (2, 3)}
  got = {(i, j) for i in range(4) for j in range(i + 1, 4)
         if int(entropy_crossovers(prev, cur, jnp.isin(jnp.arange(4), jnp.array([i, j])))) == 1}
  assert got == expected
  # Ties are not flips, an invalid task takes no part.
  assert int(entropy_crossovers(jnp.array([1.0, 2.0]), jnp.array([2.0, 2.0]), jnp.ones(2, bool))) == 0
  assert int(entropy_crossovers(prev, cur, jnp.array([True, True, True, False]))) == 1


def test_spikes_need_warmup_then_flag_jumps_only():
  cfg = PacingConfig(spike_kappa=3.0, spike_min_obs=5, rho=0.9)
  rng = np.random.default_rng(4)
  state = init_pacing(2)
  cnt = jnp.array([10, 10])
  flagged = []
  for t in range(40):
    ent = jnp.asarray(1.0 + 0.01 * rng.normal(size=2), jnp.float32)
    spikes = entropy_spikes(state, ent, cnt, cfg)
    if t < 6:  # fewer than spike_min_obs innovations before this step
      assert not bool(spikes.any())
    flagged.append(np.asarray(spikes))
    state = update_pacing(state, ent, cnt, cfg)
  assert np.mean(flagged) < 0.05  # stationary noise: (almost) no alarms
  jump = jnp.array([1.5, 1.0], jnp.float32)
  np.testing.assert_array_equal(entropy_spikes(state, jump, cnt, cfg), [True, False])
  # An absent task is never a spike.
  assert not bool(entropy_spikes(state, jump, jnp.array([0, 10]), cfg)[0])


def test_pacing_diagnostics_uses_state_before_update():
  cfg = PacingConfig(spike_min_obs=1)
  state = init_pacing(3)
  state = update_pacing(state, jnp.array([1.0, 2.0, 3.0]), jnp.array([1, 1, 1]), cfg)
  state = update_pacing(state, jnp.array([1.1, 2.1, 3.0]), jnp.array([1, 1, 1]), cfg)
  diag = pacing_diagnostics(state, jnp.array([2.5, 2.0, 30.0]), jnp.array([1, 1, 0]), cfg)
  assert int(diag["entropy_crossovers"]) == 1          # tasks 0 and 1 swap; 2 absent
  np.testing.assert_array_equal(diag["entropy_spikes_K"], [True, False, False])
  assert int(diag["num_entropy_spikes"]) == 1


def test_initial_state_can_be_donated():
  """Every field of a fresh state is its own buffer, so a jitted step may donate the state."""
  state = init_pacing(3)
  step = jax.jit(lambda s: s.replace(step=s.step + 1), donate_argnums=0)
  assert int(step(state).step) == 1
