r"""How much signal one optimizer update's batch carries: the between-batch gradient cosine.

If the policy gradients of two independent batches of E episodes point the same way (cosine well
above 0), an update on E episodes follows a signal; near 0, it is mostly noise. Under the usual
model (each batch's gradient = the true gradient + noise that shrinks as 1/sqrt(E)) the expected
cosine is E / (E + k) for a constant k of the policy and task mix, so it should rise with E.

Method, from the policy of a finished run or warm start (`--workdir`, e.g. `runs/default/seed0/sft`
from `bench/study.py`; its `config.json` is the config):

1. The trainer is set up on a scratch copy of the workdir's checkpoints (and tiny model), so that
   nothing in `--workdir` is written: `train.Trainer.setup` restores the newest intact checkpoint,
   its task-sampler position included.
2. P batches are played with the sampling policy at that checkpoint, by the trainer's own episode
   loop (`Trainer.play_step` of the RL steps after the checkpoint's: with `--seed 0` the very
   instances and samples training would play next, with the policy held fixed; with
   `--same-instances` every batch replays the first batch's instances with its own samples).
   Each batch is instances_per_step x group_size episodes, GRPO groups intact, and gets its
   advantages as a training step does (`steps.update_inputs` on the whole played batch: the
   config's estimator, its per-task std, a left-out episode's NaN reward, GiGPO's host-side
   per-token advantages).
3. For each size E (a multiple of group_size), N disjoint E-episode batches are cut from the
   played episodes in order (consecutive whole groups, as the update's minibatches are cut; a
   batch larger than a played batch spans several of them, each keeping its own advantages).
   Each one's gradient is the gradient of the first update of `steps.train_step`: the loss
   `objective.eppo_loss` with the config's method, aggregation, KL and entropy terms, at the
   checkpoint's params, with the old policy equal to the current one (ratio exactly 1, so the
   clip bounds do not act) - `steps.minibatch_grads` with no old log-probs, on the batch's own
   rows, not a mean of per-group gradients. It is flattened over the trainable params.
4. Per E: the mean over the N (N - 1) / 2 pairs of the cosine between two batches' gradients, and
   its standard error by the jackknife over batches (the pairs share batches, so they are not
   independent). Also the mean gradient norm and the batches' groups with reward variance
   (groups whose rewards are all equal have zero advantage and add no gradient).

Every size uses the first N x E played episodes, so the sizes share episodes; within a size the
batches are disjoint. P = ceil(N x max(E) / (instances_per_step x group_size)).

  python bench/grad_cosine.py --workdir runs/default/seed0/sft
  python bench/grad_cosine.py --workdir runs/default/seed0/sft --episodes 16 --batches 48
  # The old default's update batch (4 minibatches of 16 episodes: 4 groups of 4, group std):
  python bench/grad_cosine.py --workdir runs/default/seed0/sft --episodes 16 64 --batches 12 \
      --config.rollout.group_size=4 --config.per_task_std=False
  python bench/grad_cosine.py --workdir /tmp/gc_smoke --episodes 2 4 --batches 4   # smoke preset

`--config.a.b=VALUE` overrides a field of the workdir's config (as in `bench/study.py`); fields
that change the model or its shapes cannot restore its checkpoint. One host only.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import logging
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # pylint: disable=g-import-not-at-top,wrong-import-position


# ----------------------------------------------------------------------------------------------
# Cosines (NumPy).


def pairwise_cosines(grads_NxD: np.ndarray) -> np.ndarray:
  """[N,N] cosine between every two rows of `grads_NxD` (float64; a zero row gives NaN)."""
  g = np.asarray(grads_NxD, np.float64)
  with np.errstate(invalid="ignore", divide="ignore"):
    unit = g / np.linalg.norm(g, axis=1, keepdims=True)
  return unit @ unit.T


def mean_pairwise_cosine(grads_NxD: np.ndarray) -> tuple[float, float]:
  """(mean cosine over the N (N - 1) / 2 pairs of distinct rows, its jackknife standard error
  over rows; NaN for N < 3)."""
  cos = pairwise_cosines(grads_NxD)
  n = len(cos)
  if n < 2:
    return float("nan"), float("nan")
  off = cos[~np.eye(n, dtype=bool)].reshape(n, n - 1)
  total = off.sum() / 2  # Each pair once.
  mean = total / (n * (n - 1) / 2)
  if n < 3:
    return float(mean), float("nan")
  # Leave row i out: the pairs among the other n - 1 rows.
  leave_out = (total - off.sum(axis=1)) / ((n - 1) * (n - 2) / 2)
  se = math.sqrt((n - 1) / n * np.sum((leave_out - leave_out.mean()) ** 2))
  return float(mean), se


def leave_one_out_cosine(grads_NxD: np.ndarray, steps_NxD: np.ndarray) -> float:
  """Mean over j of the cosine between batch j's update `steps_NxD[j]` and the mean gradient of
  the other batches (an estimate of the true gradient that is independent of batch j): how well
  an update taken on one batch follows the signal. With `steps = grads` it measures the gradient
  itself; with `steps = sign(grads)`, Adam's first update from a fresh state (m / sqrt(v) =
  g / |g| per weight), which moves every weight by the same amount whatever its signal."""
  g = np.asarray(grads_NxD, np.float64)
  if len(g) < 2:  # No other batch to compare with.
    return float("nan")
  others = (g.sum(0, keepdims=True) - g) / max(len(g) - 1, 1)
  s = np.asarray(steps_NxD, np.float64)
  with np.errstate(invalid="ignore", divide="ignore"):
    cos = (s * others).sum(1) / (np.linalg.norm(s, axis=1) * np.linalg.norm(others, axis=1))
  return float(np.mean(cos))


# ----------------------------------------------------------------------------------------------
# Episodes -> the update's rows.


def update_rows(trainer, episodes, jit_inputs) -> tuple[dict, int]:
  """(the rows the first update reads (`steps.update_inputs`) of one played batch, made as
  `Trainer.rl_step` makes its batch: advantages over the whole played batch; the prompt length
  its groups share, `steps.shared_prefix_length`)."""
  from eppo_jax import gigpo, groups, programs, steps, train  # pylint: disable=g-import-not-at-top
  c, r = trainer.config, trainer.config.rollout
  steps.check_loss_budget(episodes.loss_mask, trainer.step_cfg.loss_tokens_per_row)
  keep = groups.spread_filter(episodes, r.keep_groups) if r.keep_groups < 1 else None
  advantages = None
  if c.advantage_estimator == "gigpo":
    advantages = gigpo.token_advantages(episodes, gamma=c.gigpo.gamma, omega=c.gigpo.omega,
                                        step_normalize=c.gigpo.step_normalize)
  arrays = train.batch_arrays(episodes, 0, tuple(programs.batch_spec(c, trainer.step_cfg, 1)),
                              advantages, keep)
  data, _ = jit_inputs(trainer.state.trainable, trainer.frozen, arrays)
  shared = steps.shared_prefix_length(arrays["tokens"], arrays["attention_mask"],
                                      arrays["loss_mask"], r.group_size)
  return {k: np.asarray(v) for k, v in data.items()}, shared


def join_rows(parts: list[dict]) -> dict:
  """Played batches' rows as one pool, [B,T] arrays padded to the widest (the padding is masked
  out and after every scored position: it changes no score)."""
  width = max(p["tokens"].shape[1] for p in parts)
  pad = lambda x: np.pad(x, ((0, 0), (0, width - x.shape[1])))
  return {k: np.concatenate([pad(p[k]) if k in ("tokens", "attention_mask") else p[k]
                             for p in parts]) for k in parts[0]}


# ----------------------------------------------------------------------------------------------


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workdir", required=True, help="a run or warm start with checkpoints/")
  parser.add_argument("--episodes", type=int, nargs="+", default=[16, 64, 128],
                      help="batch sizes E in episodes (multiples of the group size)")
  parser.add_argument("--batches", type=int, default=6,
                      help="N, disjoint batches per size (N (N - 1) / 2 pairs)")
  parser.add_argument("--seed", type=int, default=0,
                      help="0: the instances and samples training plays next; another value "
                           "draws other ones")
  parser.add_argument("--same-instances", action="store_true",
                      help="every played batch replays the first one's instances with new "
                           "samples: the cosine of updates on the same instances")
  parser.add_argument("--save", metavar="JSON",
                      help="also write each size's cosine matrix and gradient norms there")
  args, extra = parser.parse_known_args(argv)
  import study  # pylint: disable=g-import-not-at-top
  try:
    overrides = study.parse_overrides(extra)
  except ValueError as e:
    parser.error(str(e))
  if args.batches < 2:
    parser.error("--batches needs at least 2 (a cosine is between two batches)")
  logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  # pylint: disable=g-import-not-at-top
  from eppo_jax import groups, hosts, interrupt, lora, steps, train
  from eppo_jax.envs.sampler import TaskSampler
  # pylint: enable=g-import-not-at-top

  workdir = Path(args.workdir)
  config = common.load_run_config(workdir, overrides)
  r = config.rollout
  group, played = r.group_size, r.instances_per_step * r.group_size
  if bad := [e for e in args.episodes if e <= 0 or e % group]:
    parser.error(f"--episodes {bad}: each size must be a positive multiple of the group size "
                 f"{group} (whole groups)")
  hosts.initialize(config.distributed)
  if jax.process_count() > 1:
    raise SystemExit("grad_cosine runs on one host")
  train.use_compilation_cache(config.train.compilation_cache)

  with tempfile.TemporaryDirectory(prefix="grad_cosine_") as scratch:
    run = common.scratch_run(workdir, config, Path(scratch))
    stamp = None  # The tiny model's fingerprint: setup rebuilds a model that does not match it.
    if config.model.source == "tiny":
      stamp = Path(config.model.tiny_dir) / "eppo_jax_tiny.json"
    before = stamp.read_text() if stamp else None
    trainer = train.Trainer(config, run, interrupt.StopRequest())
    try:
      start = time.time()
      trainer.setup()
      if stamp and stamp.read_text() != before:
        raise SystemExit("the run's tiny model was built from other texts than this checkout's "
                         "environments make (they changed since): its checkpoint does not fit")
      if trainer.resumed is None:
        raise SystemExit(f"no intact checkpoint under {workdir}/checkpoints")
      first = trainer.step + 1
      if args.seed:  # Other instances (sampler) and other samples (rollout keys of other steps).
        seed = int(np.random.SeedSequence([config.seed, args.seed]).generate_state(1)[0])
        trainer.sampler = TaskSampler(trainer.specs, list(config.tasks.weights) or None, seed=seed)
        first += args.seed * 1_000_000
      print(f"policy: {workdir} checkpoint {trainer.resumed} (RL step {trainer.step}), "
            f"{config.method}, {len(trainer.specs)} tasks; set up in {time.time() - start:.0f}s",
            file=sys.stderr, flush=True)

      cfg = trainer.step_cfg
      jit_inputs = jax.jit(lambda t, f, b: steps.update_inputs(lora.combine(t, f), b, cfg))
      num_played = math.ceil(args.batches * max(args.episodes) / played)
      rows, shared, varied_G = [], [], []
      zero_var = np.zeros((2, len(trainer.specs)))
      start, drawn = time.time(), trainer.sampler.state_dict()
      for i in range(num_played):
        if args.same_instances:  # The same draw of instances; the step's own sampling keys.
          trainer.sampler.load_state_dict(drawn)
        episodes, _ = trainer.play_step(first + i)
        zero_var += groups.per_task_zero_variance(episodes, len(trainer.specs))
        varied_G.append(~groups.zero_variance(episodes))  # Groups in row order, G rows each.
        batch_rows, batch_shared = update_rows(trainer, episodes, jit_inputs)
        rows.append(batch_rows)
        shared.append(batch_shared)
        print(f"  played batch {i + 1}/{num_played}: {len(episodes.rewards)} episodes, "
              f"{time.time() - start:.0f}s", file=sys.stderr, flush=True)
      play_s = time.time() - start
      pool, varied_G = join_rows(rows), np.concatenate(varied_G)
      # Each size cuts whole groups, so each group's shared prompt runs once, as in the trainer
      # (the same numbers up to float rounding); 0 with optim.share_prompt off.
      shared = min(shared) if config.optim.share_prompt else 0
      print(f"  {len(pool['tokens'])} episodes of {pool['tokens'].shape[1]} tokens (padded), "
            f"{int(pool['attention_mask'].sum(1).mean())} on average; shared prompt {shared}",
            file=sys.stderr, flush=True)

      @functools.partial(jax.jit, static_argnames=("cfg",))
      def gradient(trainable, frozen, mb, key, cfg):
        ones_K = jnp.ones((cfg.num_tasks,), jnp.float32)  # Any bounds: unused at ratio 1.
        (loss, _), grads = steps.minibatch_grads(trainable, frozen, mb, key, ones_K, ones_K,
                                                 None, cfg)
        flat = jnp.concatenate([g.astype(jnp.float32).ravel()
                                for g in jax.tree_util.tree_leaves(grads)])
        return flat, loss

      results = []
      for e in args.episodes:
        micro = cfg.micro_batches
        if e % (micro * (group if shared else 1)):
          micro = 1
        size_cfg = dataclasses.replace(cfg, shared_prefix=shared, micro_batches=micro)
        start, grads, varied = time.time(), [], []
        for j in range(args.batches):
          mb = {k: v[j * e:(j + 1) * e] for k, v in pool.items()}
          key = jax.random.fold_in(trainer.keys["train"], j)
          flat, _ = gradient(trainer.state.trainable, trainer.frozen, mb, key, size_cfg)
          grads.append(np.asarray(flat, np.float64))
          varied.append(int(varied_G[j * e // group:(j + 1) * e // group].sum()))
        grads = np.stack(grads)
        norms = np.linalg.norm(grads, axis=1)
        # A batch without reward variance (and no KL or entropy term) has a zero gradient: its
        # update does nothing and its cosine is undefined, so it is left out of the mean.
        kept = grads[norms > 0]
        mean, se = mean_pairwise_cosine(kept)
        results.append(dict(e=e, n=int((norms > 0).sum()), mean=mean, se=se,
                            to_rest=leave_one_out_cosine(kept, kept),
                            sign_to_rest=leave_one_out_cosine(kept, np.sign(kept)),
                            norm=float(norms.mean()),
                            varied=float(np.mean(varied)), norms=norms.tolist(),
                            cosines=np.round(pairwise_cosines(grads), 6).tolist(),
                            seconds=time.time() - start))
        print(f"  E={e}: {args.batches} gradients in {time.time() - start:.0f}s", file=sys.stderr,
              flush=True)
    finally:
      trainer.close()

  zero_K, groups_K = zero_var
  print(f"\npolicy {workdir} (checkpoint {trainer.resumed}), {config.method}, advantages "
        f"{config.advantage_estimator}{' per-task std' if config.per_task_std else ''}, "
        f"played {num_played} x {r.instances_per_step} instances x {group} episodes "
        f"({play_s:.0f}s), seed {args.seed}"
        f"{', the same instances in every batch' if args.same_instances else ''}")
  varied_K = groups_K - zero_K
  print("groups with reward variance: " + f"{int(varied_K.sum())} of {int(groups_K.sum())}; " +
        ", ".join(f"{spec} {int(v)}/{int(n)}" for spec, v, n in
                  zip(trainer.specs, varied_K, groups_K)))
  print()
  print("| E (episodes) | groups | batches (nonzero gradient) | mean cosine | s.e. | gradient to "
        "the rest | Adam's first step to the rest | mean grad norm | groups with reward variance "
        "per batch |")
  print("|---|---|---|---|---|---|---|---|---|")
  for res in results:
    print(f"| {res['e']} | {res['e'] // group} | {args.batches} ({res['n']}) | {res['mean']:.4f} "
          f"| {res['se']:.4f} | {res['to_rest']:.4f} | {res['sign_to_rest']:.4f} "
          f"| {res['norm']:.4g} | {res['varied']:.2f} |")
  print("(to the rest: the mean cosine between one batch's update and the mean gradient of the "
        "other batches)")
  if args.save:
    Path(args.save).write_text(json.dumps(
        {"workdir": str(workdir), "checkpoint": trainer.resumed, "seed": args.seed,
         "same_instances": args.same_instances,
         "overrides": dict(overrides), "group_size": group,
         "groups_with_variance": varied_K.tolist(), "groups": groups_K.tolist(),
         "sizes": results}, indent=1))


if __name__ == "__main__":
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
  main()
