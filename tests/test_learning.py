"""RL makes a policy better where the better action is known: the whole trainer on a bandit.

`faulty_envs.LeftLake` pays 1 for "left" and 0 for any other move, in one turn. Its warm start
imitates an expert that says "left" on half the instances and "right" on the others, so the policy
starts near an even choice; every part of an RL step (episodes, their rewards, group advantages,
the loss, the optimizer, the sampler's new params) has to be right for the rate of "left" to rise.
"""

import numpy as np

import faulty_envs  # pylint: disable=unused-import  (registers the test tasks)

from eppo_jax import train
from pipeline_util import compile_cache, read_records, smoke_config  # pylint: disable=unused-import

STEPS = 12


def test_rl_raises_the_reward_of_a_bandit(compile_cache, tmp_path):
  """Measured: sampled success 0.41 at the first step, 0.75-0.88 over the last three; with the
  advantages' sign flipped in the update it falls to 0 (what this test is there to catch)."""
  del compile_cache
  # Its own tiny model: the task's one-turn transcripts make the tokenizer corpus.
  config = smoke_config(tmp_path / "tiny", **{
      "tasks.specs": ("leftlake_test:easy",), "rollout.max_turns": 1,
      "sft.demos_per_task": 64, "sft.steps": 200, "sft.batch_size": 16,
      "rollout.instances_per_step": 8, "rollout.group_size": 4, "optim.num_minibatches": 1,
      "optim.learning_rate": 1e-3, "optim.warmup_steps": 0, "train.num_steps": STEPS,
      "train.eval_every": 0, "train.eval_instances_per_task": 1, "train.tensorboard": False,
      "train.plots": False, "train.export_hf": False})
  train.train(config, tmp_path / "run")
  # Sampled success per step.
  success = np.array([r["success"] for r in read_records(tmp_path / "run") if "loss" in r])
  assert len(success) == STEPS
  # The warm start chooses between the two moves (its replies are valid), then RL takes "left".
  assert 0.2 <= success[:2].mean() <= 0.8, success
  assert success[-3:].mean() >= success[:2].mean() + 0.25, success
