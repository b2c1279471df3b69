"""Entropy pacing: per-task entropy, its smoothed state, and the task-wise clipping bounds.

EPPO replaces GRPO's single PPO clipping threshold with one bound per task, driven by how
confident the policy is on that task relative to the others (see docs/eppo.md):

    H_k   = mean token entropy of task k in the batch (all devices)          task_entropy
    Ĥ_k  <- rho * Ĥ_k + (1 - rho) * H_k   (tasks present; first sight sets)   update_pacing
    H̄     = unweighted mean of Ĥ_k over tasks seen so far
    u_k   = Ĥ_k / (H̄ + delta)
    eps_k = clip(eps0 * u_k ** alpha, eps_min, eps_max)   low and high side    pacing_bounds

Everything here is a pure function of arrays, so it runs inside jit and pmap; the state is a
small pytree that the trainer checkpoints with the rest of its state.
"""

import dataclasses
from typing import Optional

import flax.struct
import jax
import jax.numpy as jnp
from jax import lax


PACING_SCHEMES = ("cross_task_mean", "initial", "target")
# Which trained tokens H_k averages over: "all" of them, or the "action" tokens alone (those that
# spell the action inside its tags, `agent.ChatFormat.action_mask`), where the decision is.
ENTROPY_TOKENS = ("all", "action")


def task_entropy(token_entropy_BxT: jax.Array,
                 loss_mask_BxT: jax.Array,
                 task_ids_B: jax.Array,
                 num_tasks: int,
                 axis_name: Optional[str] = None) -> tuple[jax.Array, jax.Array]:
  """Per-task mean entropy over trained tokens of all devices: ([K] float32, [K] int32 counts)."""
  mask_BxT = (loss_mask_BxT > 0)
  ent_BxT = jnp.where(mask_BxT, token_entropy_BxT.astype(jnp.float32), 0.0)
  # Sum per sequence first, then per task: segment_sum drops ids outside [0, K), so padding
  # rows tagged with an invalid task id simply do not count.
  sum_K = jax.ops.segment_sum(ent_BxT.sum(axis=1), task_ids_B, num_segments=num_tasks)
  cnt_K = jax.ops.segment_sum(mask_BxT.sum(axis=1, dtype=jnp.int32), task_ids_B,
                              num_segments=num_tasks)
  if axis_name is not None:
    # Sums (not means) are reduced so that every token weighs the same whichever device holds it.
    sum_K = lax.psum(sum_K, axis_name)
    cnt_K = lax.psum(cnt_K, axis_name)
  mean_K = jnp.where(cnt_K > 0, sum_K / jnp.maximum(cnt_K, 1).astype(jnp.float32), 0.0)
  return mean_K.astype(jnp.float32), cnt_K


@dataclasses.dataclass(frozen=True)
class PacingConfig:
  """Constants of entropy pacing; frozen and hashable so it can be a static jit argument."""
  # What u_k is measured against: "cross_task_mean" (the mean Ĥ over seen tasks: tasks are
  # paced against each other), "initial" (each task's own first-seen entropy: pacing against
  # its own starting point) or "target" (a fixed target entropy).
  scheme: str = "cross_task_mean"
  # EMA decay of the per-task entropy: batch entropies are noisy (few episodes per task per
  # step), and the bound should follow the trend, not the noise.
  rho: float = 0.9
  # Base clipping bounds on the low (1 - eps) and high (1 + eps) sides; equal to GRPO's.
  eps0_low: float = 0.2
  eps0_high: float = 0.2
  # Strength of pacing: eps_k = eps0 * u_k ** alpha. alpha = 0 switches pacing off exactly.
  alpha: float = 1.0
  # Range of the paced bound: never a trust region so tight that a task stops learning, nor
  # so wide that a high-entropy task takes unbounded steps.
  eps_min: float = 0.05
  eps_max: float = 0.4
  # Added to the reference entropy so u_k stays finite when every task has collapsed to 0.
  delta: float = 1e-6
  # Reference entropy of scheme="target" (nats).
  target_entropy: float = 1.0
  # A task counts as present in a batch only with at least this many trained tokens; a task
  # with a handful of tokens gives an entropy estimate too noisy to move the state.
  min_tokens: int = 1
  # Spike detection: flag |H_k(t) - Ĥ_k(t-1)| > spike_kappa * sigma_k, where sigma_k is the
  # running RMS of that innovation (EMA with decay spike_rho, bias-corrected), and only after
  # spike_min_obs innovations so that the first few noisy estimates of sigma raise no alarms.
  spike_kappa: float = 3.0
  spike_rho: float = 0.9
  spike_min_obs: int = 5
  # The tokens H_k is measured on (ENTROPY_TOKENS). In an agentic reply most tokens are format
  # (tags, stop token) that the policy writes with near-zero entropy, so over "all" tokens H_k
  # mostly measures a task's share of format tokens; "action" measures the decision itself.
  entropy_tokens: str = "all"

  def __post_init__(self):
    if self.scheme not in PACING_SCHEMES:
      raise ValueError(f"scheme must be one of {PACING_SCHEMES}, got {self.scheme!r}")
    if self.entropy_tokens not in ENTROPY_TOKENS:
      raise ValueError(f"entropy_tokens must be one of {ENTROPY_TOKENS}, "
                       f"got {self.entropy_tokens!r}")
    if not 0.0 <= self.rho < 1.0 or not 0.0 <= self.spike_rho < 1.0:
      raise ValueError("rho and spike_rho must lie in [0, 1)")
    if not 0.0 < self.eps_min <= self.eps_max:
      raise ValueError(f"need 0 < eps_min <= eps_max, got {self.eps_min}, {self.eps_max}")
    if self.eps0_low <= 0 or self.eps0_high <= 0 or self.delta <= 0:
      raise ValueError("eps0_low, eps0_high and delta must be positive")


@flax.struct.dataclass
class PacingState:
  """Per-task entropy statistics carried across training steps ([K] arrays)."""
  ema_K: jax.Array          # Ĥ_k, smoothed entropy (0 until seen)
  seen_K: jax.Array         # bool, task has been present in at least one batch
  initial_K: jax.Array      # entropy at first sight (reference of scheme="initial")
  last_K: jax.Array         # raw H_k of the last batch the task was present in (crossovers)
  innov_sq_K: jax.Array     # EMA of (H_k(t) - Ĥ_k(t-1))**2, not bias-corrected
  innov_n_K: jax.Array      # int32, number of innovations seen (bias correction, warm-up)
  step: jax.Array           # int32, number of updates applied


def init_pacing(num_tasks: int) -> PacingState:
  """State before any batch: no task seen."""
  # A fresh array per field: a jitted step that donates the state may not see one buffer twice.
  zeros_K = lambda: jnp.zeros((num_tasks,), jnp.float32)
  return PacingState(ema_K=zeros_K(), seen_K=jnp.zeros((num_tasks,), bool), initial_K=zeros_K(),
                     last_K=zeros_K(), innov_sq_K=zeros_K(),
                     innov_n_K=jnp.zeros((num_tasks,), jnp.int32), step=jnp.zeros((), jnp.int32))


def _present(cnt_K: jax.Array, cfg: PacingConfig) -> jax.Array:
  return cnt_K >= max(cfg.min_tokens, 1)


def update_pacing(state: PacingState, ent_K: jax.Array, cnt_K: jax.Array,
                  cfg: PacingConfig) -> PacingState:
  """One EMA step for the tasks present in the batch; absent tasks keep their state."""
  ent_K = ent_K.astype(jnp.float32)
  present_K = _present(cnt_K, cfg)
  first_K = present_K & ~state.seen_K
  again_K = present_K & state.seen_K
  # First sight initialises instead of decaying from 0, which would report a spurious
  # near-zero entropy (and the tightest bound) for a task's first ~1/(1-rho) steps.
  smoothed_K = cfg.rho * state.ema_K + (1.0 - cfg.rho) * ent_K
  ema_K = jnp.where(first_K, ent_K, jnp.where(again_K, smoothed_K, state.ema_K))
  innov_K = ent_K - state.ema_K
  innov_sq_K = jnp.where(
      again_K, cfg.spike_rho * state.innov_sq_K + (1.0 - cfg.spike_rho) * innov_K**2,
      state.innov_sq_K)
  return PacingState(
      ema_K=ema_K,
      seen_K=state.seen_K | present_K,
      initial_K=jnp.where(first_K, ent_K, state.initial_K),
      last_K=jnp.where(present_K, ent_K, state.last_K),
      innov_sq_K=innov_sq_K,
      innov_n_K=state.innov_n_K + again_K.astype(jnp.int32),
      step=state.step + 1)


def entropy_ratio(state: PacingState, cfg: PacingConfig) -> jax.Array:
  """u_k = Ĥ_k / (reference + delta), the task's entropy relative to the scheme's reference: [K]."""
  seen_K = state.seen_K
  if cfg.scheme == "cross_task_mean":
    # Unweighted over tasks so that a task with long episodes does not set everyone's pace.
    num_seen = jnp.maximum(seen_K.sum(), 1).astype(jnp.float32)
    ref_K = jnp.full_like(state.ema_K, jnp.sum(jnp.where(seen_K, state.ema_K, 0.0)) / num_seen)
  elif cfg.scheme == "initial":
    ref_K = state.initial_K
  else:  # "target"
    ref_K = jnp.full_like(state.ema_K, cfg.target_entropy)
  return jnp.where(seen_K, state.ema_K / (ref_K + cfg.delta), 1.0)


def pacing_bounds(state: PacingState, cfg: PacingConfig) -> tuple[jax.Array, jax.Array]:
  """Task-wise clipping bounds (eps_low [K], eps_high [K]) in float32."""
  num_tasks = state.ema_K.shape[0]
  base_low_K = jnp.full((num_tasks,), cfg.eps0_low, jnp.float32)
  base_high_K = jnp.full((num_tasks,), cfg.eps0_high, jnp.float32)
  if cfg.alpha == 0:
    # Pacing off must be GRPO/DAPO bit for bit, even for a base outside [eps_min, eps_max]
    # (e.g. the Clip-Cov recipe's eps = 1): return the bases untouched, no clip.
    return base_low_K, base_high_K
  scale_K = entropy_ratio(state, cfg) ** cfg.alpha
  # Unseen tasks have u_k = 1, so they get the (clipped) base until their first batch.
  eps_low_K = jnp.clip(base_low_K * scale_K, cfg.eps_min, cfg.eps_max)
  eps_high_K = jnp.clip(base_high_K * scale_K, cfg.eps_min, cfg.eps_max)
  return eps_low_K.astype(jnp.float32), eps_high_K.astype(jnp.float32)


def entropy_crossovers(prev_K: jax.Array, cur_K: jax.Array, valid_K: jax.Array) -> jax.Array:
  """The number of task pairs whose entropy order flips between two steps (int32 scalar)."""
  # A flip is a strict sign change of H_i - H_j; ties on either side are not flips, so two
  # tasks that merely touch do not count. Both tasks must be valid (observed) at both steps.
  prev_diff_KxK = jnp.sign(prev_K[:, None] - prev_K[None, :])
  cur_diff_KxK = jnp.sign(cur_K[:, None] - cur_K[None, :])
  pair_valid_KxK = valid_K[:, None] & valid_K[None, :]
  flips_KxK = (prev_diff_KxK * cur_diff_KxK < 0) & pair_valid_KxK
  # The matrix is symmetric; count each unordered pair once.
  return jnp.sum(jnp.triu(flips_KxK, k=1)).astype(jnp.int32)


def entropy_spikes(state: PacingState, ent_K: jax.Array, cnt_K: jax.Array,
                   cfg: PacingConfig) -> jax.Array:
  """Tasks whose new entropy jumps more than kappa running sigmas from Ĥ: [K] bool.

  Call with the state *before* `update_pacing` on this batch: sigma and Ĥ are those of t-1.
  """
  ready_K = _present(cnt_K, cfg) & state.seen_K & (state.innov_n_K >= cfg.spike_min_obs)
  # Bias-correct the zero-initialised EMA, as Adam does, so early sigmas are not too small.
  n_K = jnp.maximum(state.innov_n_K, 1).astype(jnp.float32)
  sigma_K = jnp.sqrt(state.innov_sq_K / (1.0 - cfg.spike_rho**n_K))
  return ready_K & (jnp.abs(ent_K - state.ema_K) > cfg.spike_kappa * sigma_K)


def pacing_diagnostics(state: PacingState, ent_K: jax.Array, cnt_K: jax.Array,
                       cfg: PacingConfig) -> dict[str, jax.Array]:
  """Spikes and crossovers of this batch, from the state before `update_pacing`."""
  present_K = _present(cnt_K, cfg)
  # Crossovers compare this batch's raw entropies with each task's last observed ones.
  crossovers = entropy_crossovers(state.last_K, ent_K, state.seen_K & present_K)
  spikes_K = entropy_spikes(state, ent_K, cnt_K, cfg)
  return {"entropy_crossovers": crossovers, "entropy_spikes_K": spikes_K,
          "num_entropy_spikes": spikes_K.sum().astype(jnp.int32)}
