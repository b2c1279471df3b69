r"""Greedy success and pass@k per task: what sampling solves that greedy play does not.

An RL update can only raise what the sampling policy already finds. Per task, on the held-out
instances the trainer's evaluation uses (the same seeds, `TaskSampler.eval_instances`):

- greedy success (one greedy episode per instance, as `Trainer.evaluate` plays it),
- n sampled episodes per instance at the rollout's temperature, and from them pass@k, the
  probability that at least one of k samples succeeds, by the unbiased estimator
  1 - C(n - c, k) / C(n, k) over the instance's c successes (Chen et al. 2021), averaged over
  instances; pass@1 is the mean sampled success,
- the share of instances whose n samples disagree (0 < c < n): the groups of a training step
  whose rewards can differ, so that GRPO gives them an advantage,
- invalid actions per sampled episode, truncated episodes and turns.

`--pool train` plays the training seeds 0 .. instances - 1 of each task instead: the rooms a run
with `tasks.train_instances` set to that number trained on (what RL learned on its own rooms,
against the held-out ones); by default all of the run's rooms, and never more than it had.

The policy is a run's newest checkpoint (`--workdir`, set up on a scratch copy as in
`bench/grad_cosine.py`, so nothing there is written) or a preset's model as it loads, before any
training (`--preset`: zero-shot; a pretrained model's own skill, e.g. `smollm2-135m`).

  python bench/pass_at_k.py --workdir runs/default_sft/seed0/sft            # the warm start
  python bench/pass_at_k.py --preset smollm2-135m --instances 32 --samples 4 --chunk 64
  python bench/pass_at_k.py --workdir RUN --pool train                      # its own rooms
  python bench/pass_at_k.py --preset smoke --instances 2 --samples 2        # smoke

`--show N` also prints the first greedy replies of N instances per task (what the policy writes
where a game finds no move). `--chunk` bounds the episodes played at once (each holds
`rollout.max_episode_tokens` of KV cache). `--config.a.b=VALUE` overrides a config field, as in
`bench/study.py`. One host only.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))

import common  # noqa: E402  pylint: disable=wrong-import-position


def pass_at_k(n: int, c: np.ndarray, k: int) -> np.ndarray:
  """Unbiased pass@k per instance from c successes [I] among n samples: 1 - C(n-c, k) / C(n, k),
  as the product 1 - prod_{i=n-c+1..n} (1 - k / i), which neither overflows nor cancels."""
  if not 1 <= k <= n:
    raise ValueError(f"pass@{k} needs 1 <= k <= n = {n} samples")
  c = np.asarray(c)
  i = np.arange(1, n + 1)  # [n]
  # For instance j the factors i > n - c_j enter the product; the others are 1.
  factors = np.where(i[None, :] > (n - c)[:, None], 1.0 - k / i[None, :], 1.0)  # [I,n]
  return 1.0 - np.prod(factors, axis=1)


# Per-episode fields of the sampled episodes that the table reports.
EPISODE_FIELDS = ("success", "invalid_actions", "truncated", "turns")


def task_table(specs, task_ids_I, greedy_I, sampled: dict, n: int, ks) -> list[dict]:
  """One row per task from the greedy verdicts [I] and the sampled episodes' `EPISODE_FIELDS`
  ([I * n] each, the n samples of an instance next to each other, instances in order)."""
  rows = []
  successes_I = sampled["success"].reshape(len(task_ids_I), n).sum(axis=1)
  per_episode = np.repeat(task_ids_I, n)
  for k, spec in enumerate(specs):
    mine, eps = task_ids_I == k, per_episode == k
    c = successes_I[mine]
    rows.append({
        "task": spec, "instances": int(mine.sum()),
        "greedy": float(greedy_I[mine].mean()),
        **{f"pass@{j}": float(pass_at_k(n, c, j).mean()) for j in ks},
        "varied": float(((c > 0) & (c < n)).mean()),
        **{f: float(sampled[f][eps].mean()) for f in EPISODE_FIELDS[1:]},
    })
  return rows


def instance_list(sampler, per_task: int, pool: str) -> list[tuple[int, int]]:
  """(task id, seed) pairs: the held-out seeds the trainer evaluates on, or the first `per_task`
  training seeds, the pool of a run with `tasks.train_instances=per_task`."""
  if pool == "train":
    return [(k, seed) for k in range(sampler.num_tasks) for seed in range(per_task)]
  return sampler.eval_instances(per_task)


def instances_per_task(config, instances: Optional[int], pool: str) -> int:
  """How many instances per task to play: `instances`, else the evaluation's count (held-out) or
  the run's pool (train). ValueError for training seeds the run never drew, or for a run that
  trained on every seed with no count given (its pool is 2^31 rooms)."""
  if pool == "held_out":
    return instances or config.train.eval_instances_per_task
  rooms = config.tasks.train_instances
  if rooms and instances and instances > rooms:
    raise ValueError(f"--instances {instances} > this run's pool of {rooms} rooms per task "
                     "(tasks.train_instances); seeds beyond it are rooms it never trained on")
  if not (rooms or instances):
    raise ValueError("--pool train needs --instances: this config trains on every seed "
                     "(tasks.train_instances=0)")
  return instances or rooms


def show_replies(tokenizer, parts, instances, per_task: int, turns: int = 3) -> None:
  """Prints the first `turns` greedy replies of the first `per_task` instances of each task: what
  a policy writes where the games find no move."""
  episodes = [(batch, b) for batch in parts for b in range(len(batch.rewards))]  # instance order
  shown = {}
  for inst, (batch, b) in zip(instances, episodes):
    if shown.setdefault(inst.spec, 0) == per_task:
      continue
    shown[inst.spec] += 1
    print(f"{inst.spec} seed {inst.seed} (greedy, success {bool(batch.success[b])}, "
          f"{int(batch.invalid_actions[b])} invalid of {int(batch.turns[b])} turns):")
    for t, text in enumerate(batch.replies(tokenizer, b)[:turns]):
      print(f"  turn {t + 1}: {text!r}")
  print(flush=True)


def markdown(rows: list[dict]) -> str:
  keys = list(rows[0])
  lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
  for row in rows:
    lines.append("| " + " | ".join(f"{v:.3f}" if isinstance(v, float) else str(v)
                                     for v in row.values()) + " |")
  return "\n".join(lines)


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  source = parser.add_mutually_exclusive_group(required=True)
  source.add_argument("--workdir", help="a run or warm start with checkpoints/")
  source.add_argument("--preset", help="a configs/multitask.py preset's model, untrained")
  parser.add_argument("--instances", type=int, default=None,
                      help="instances per task (default: train.eval_instances_per_task; with "
                      "--pool train, the run's tasks.train_instances)")
  parser.add_argument("--pool", choices=("held_out", "train"), default="held_out",
                      help="held-out seeds (the evaluation's) or training seeds 0 .. instances-1")
  parser.add_argument("--samples", type=int, default=8, help="n, sampled episodes per instance")
  parser.add_argument("--k", type=int, nargs="+", default=[1, 2, 4, 8],
                      help="pass@k for these k (those above --samples are dropped)")
  parser.add_argument("--chunk", type=int, default=0,
                      help="most episodes played at once (0: all)")
  parser.add_argument("--seed", type=int, default=0, help="the sampling key")
  parser.add_argument("--show", type=int, default=0, metavar="N",
                      help="print the first greedy replies of N instances per task")
  parser.add_argument("--save", metavar="JSON", help="also write the table there")
  args, extra = parser.parse_known_args(argv)
  import study  # pylint: disable=g-import-not-at-top
  try:
    overrides = study.parse_overrides(extra)
  except ValueError as e:
    parser.error(str(e))
  if args.samples < 1 or (args.instances is not None and args.instances < 1) or args.chunk < 0:
    parser.error("--samples and --instances must be positive, --chunk at least 0")
  ks = sorted({k for k in args.k if 1 <= k <= args.samples})
  logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

  import jax  # pylint: disable=g-import-not-at-top
  # pylint: disable=g-import-not-at-top
  from configs import multitask
  from eppo_jax import agent, hosts, interrupt, train
  # pylint: enable=g-import-not-at-top

  if args.workdir:
    config = common.load_run_config(Path(args.workdir), overrides)
  else:
    try:
      config = multitask.get_config(args.preset)
      study.apply_overrides(config, overrides)
    except ValueError as e:
      parser.error(str(e))
    config.sft.enabled = False
    config.train.tensorboard = config.train.plots = False
    config.train.wandb_project = ""
  try:
    per_task = instances_per_task(config, args.instances, args.pool)
  except ValueError as e:
    parser.error(str(e))
  hosts.initialize(config.distributed)
  if jax.process_count() > 1:
    raise SystemExit("pass_at_k runs on one host")
  train.use_compilation_cache(config.train.compilation_cache)

  with tempfile.TemporaryDirectory(prefix="pass_at_k_") as scratch:
    if args.workdir:
      run = common.scratch_run(Path(args.workdir), config, Path(scratch))
    else:
      run = Path(scratch) / "run"
    trainer = train.Trainer(config, run, interrupt.StopRequest())
    try:
      start = time.time()
      trainer.setup()
      if args.workdir and trainer.resumed is None:
        raise SystemExit(f"no intact checkpoint under {args.workdir}/checkpoints")
      what = (f"{args.workdir} checkpoint {trainer.resumed}" if args.workdir
              else f"preset {args.preset}, untrained")
      print(f"policy: {what}; set up in {time.time() - start:.0f}s", file=sys.stderr, flush=True)
      instances = [agent.Instance(k, trainer.specs[k], seed)
                   for k, seed in instance_list(trainer.sampler, per_task, args.pool)]
      task_ids_I = np.array([inst.task_id for inst in instances])

      def play(greedy: bool, group: int, key) -> tuple[dict, list]:
        """`EPISODE_FIELDS` of `group` episodes per instance (instance order), in chunks, and the
        chunks' episode batches."""
        step = max(1, args.chunk // group) if args.chunk else len(instances)
        parts, begun = [], time.time()
        for i in range(0, len(instances), step):
          policy = trainer.policy(jax.random.fold_in(key, i), greedy=greedy)
          parts.append(trainer.play(policy, instances[i:i + step], group))
          done = min(i + step, len(instances))
          print(f"  {'greedy' if greedy else 'sampled'}: {done}/{len(instances)} instances x "
                f"{group}, {time.time() - begun:.0f}s", file=sys.stderr, flush=True)
        return {f: np.concatenate([getattr(p, f) for p in parts]) for f in EPISODE_FIELDS}, parts

      greedy, greedy_parts = play(True, 1, trainer.keys["eval"])
      greedy_I = greedy["success"]
      if args.show:
        show_replies(trainer.tokenizer, greedy_parts, instances, args.show)
      # Long runs (a pretrained model on a CPU) show the greedy result before the sampling.
      print("  greedy success: " + ", ".join(
          f"{spec} {greedy_I[task_ids_I == k].mean():.3f}" for k, spec in enumerate(trainer.specs)),
          file=sys.stderr, flush=True)
      sampled, _ = play(False, args.samples, jax.random.key(args.seed))
    finally:
      trainer.close()

  rows = task_table(trainer.specs, task_ids_I, greedy_I, sampled, args.samples, ks)
  which = "held-out" if args.pool == "held_out" else "training"
  print(f"\n{what}; {per_task} {which} instances per task, {args.samples} samples each at "
        f"temperature {config.rollout.temperature}\n")
  print(markdown(rows))
  if args.save:
    Path(args.save).write_text(json.dumps({"policy": what, "pool": args.pool,
                                           "samples": args.samples,
                                           "temperature": config.rollout.temperature,
                                           "tasks": rows}, indent=1))


if __name__ == "__main__":
  main()
