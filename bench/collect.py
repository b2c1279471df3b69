"""Episodes/s of the whole collection loop with the tiny model, and its generation/environment split.

  python bench/collect.py                       # the tiny preset's suite and batch
  python bench/collect.py --instances 32 --group 4 --batches 5

The model is the tiny preset's architecture with random weights (its replies are mostly invalid
actions, so episodes run to the turn limit: the slowest case for a given batch). Together with
`bench/envs.py` (environment steps/s) and `bench/train_step.py` (update tokens/s) this gives the
trainer's time split.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs import multitask  # noqa: E402  pylint: disable=wrong-import-position
from eppo_jax import agent, train  # noqa: E402  pylint: disable=wrong-import-position
from eppo_jax.envs.sampler import TaskSampler  # noqa: E402  pylint: disable=wrong-import-position


def main():
  parser = argparse.ArgumentParser(description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--preset", default="tiny")
  parser.add_argument("--instances", type=int, default=None, help="default: the preset's")
  parser.add_argument("--group", type=int, default=None, help="default: the preset's")
  parser.add_argument("--batches", type=int, default=3)
  args = parser.parse_args()

  config = multitask.get_config(args.preset)
  config.sft.enabled = False
  instances = args.instances or config.rollout.instances_per_step
  group = args.group or config.rollout.group_size
  trainer = train.Trainer(config, Path(tempfile.mkdtemp(prefix="collect_")), signals=None)
  trainer.setup()  # The trainer's model, shardings, policy and environments.
  sampler = TaskSampler(config.tasks.specs, seed=0)
  print(f"{jax.device_count()} devices; {instances} instances x {group} episodes per batch; "
        f"tasks {list(config.tasks.specs)}")
  rows = []
  for i in range(args.batches + 1):  # The first batch compiles.
    batch = [agent.Instance(k, config.tasks.specs[k], s) for k, s in sampler.sample(instances)]
    trainer.stepper.seconds = 0.0
    start = time.perf_counter()
    episodes = trainer.play(trainer.policy(jax.random.PRNGKey(i), greedy=False), batch, group)
    total = time.perf_counter() - start
    rows.append((total, trainer.stepper.seconds, len(episodes.rewards),
                 int(episodes.attention_mask.sum()), float(episodes.turns.mean())))
    print(f"batch {i}{' (compile)' if i == 0 else ''}: {total:.2f}s, "
          f"env {trainer.stepper.seconds:.3f}s,"
          f" {rows[-1][2]} episodes, {rows[-1][3]} tokens, {rows[-1][4]:.1f} turns/episode")
  total, env_s, n, tokens, _ = (np.sum([r[j] for r in rows[1:]]) for j in range(5))
  trainer.close()
  print(f"\nsteady state: {n / total:.1f} episodes/s, {tokens / total:.0f} tokens/s; "
        f"generation {100 * (total - env_s) / total:.1f}% / environments "
        f"{100 * env_s / total:.1f}% of collection time")


if __name__ == "__main__":
  main()
