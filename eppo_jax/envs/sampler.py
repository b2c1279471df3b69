"""Seeded multi-task sampling of (task id, instance seed) pairs that survives a resume."""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

# Training seeds lie below this bound and evaluation seeds at or above it: never the same instance.
EVAL_SEED_OFFSET = 2**31


def eval_seeds(n: int) -> list[int]:
  """The fixed held-out instance seeds (the same `n` for every task), disjoint from training."""
  return [EVAL_SEED_OFFSET + i for i in range(n)]


class TaskSampler:
  """Draws which task and which instance each GRPO group plays; task ids index `specs`.

  `specs` is a list of task specs ("sokoban:easy") or a {spec: weight} mapping. Task `k`
  is drawn with probability weights[k] / sum(weights). Training seeds are uniform in
  [0, num_train_instances) (default: [0, 2**31)), so evaluation seeds never collide with them.
  """

  def __init__(self, specs: Sequence[str] | Mapping[str, float],
               weights: Sequence[float] | None = None, seed: int = 0,
               num_train_instances: int | None = None):
    if isinstance(specs, Mapping):
      if weights is not None:
        raise ValueError("give weights either in the mapping or as `weights`, not both")
      specs, weights = list(specs.keys()), list(specs.values())
    self.specs = list(specs)
    if not self.specs:
      raise ValueError("TaskSampler needs at least one task spec")
    if len(set(self.specs)) != len(self.specs):
      raise ValueError(f"duplicate task specs: {self.specs}")
    self.weights = [1.0] * len(self.specs) if weights is None else [float(w) for w in weights]
    if len(self.weights) != len(self.specs):
      raise ValueError(f"{len(self.weights)} weights for {len(self.specs)} tasks")
    if min(self.weights) < 0 or sum(self.weights) <= 0:
      raise ValueError(f"weights must be non-negative with a positive sum: {self.weights}")
    self.num_train_instances = int(num_train_instances or EVAL_SEED_OFFSET)
    if not 0 < self.num_train_instances <= EVAL_SEED_OFFSET:
      raise ValueError(f"num_train_instances must be in (0, {EVAL_SEED_OFFSET}]")
    self.seed = int(seed)
    self._probs = np.asarray(self.weights) / sum(self.weights)
    self._rng = np.random.default_rng(self.seed)

  @property
  def num_tasks(self) -> int:
    return len(self.specs)

  def sample(self, n: int) -> list[tuple[int, int]]:
    """`n` (task_id, instance_seed) pairs; call once per batch of groups."""
    task_ids = self._rng.choice(self.num_tasks, size=n, p=self._probs)
    seeds = self._rng.integers(0, self.num_train_instances, size=n)
    return [(int(t), int(s)) for t, s in zip(task_ids, seeds)]

  def eval_instances(self, per_task: int) -> list[tuple[int, int]]:
    """Every task crossed with the fixed held-out seeds: the same list in every run."""
    return [(k, s) for k in range(self.num_tasks) for s in eval_seeds(per_task)]

  def state_dict(self) -> dict:
    """JSON-serialisable state; `load_state_dict` of it continues the exact same sequence."""
    return {"specs": list(self.specs), "weights": list(self.weights), "seed": self.seed,
            "num_train_instances": self.num_train_instances,
            "bit_generator": self._rng.bit_generator.state}

  def load_state_dict(self, state: Mapping) -> None:
    """Restore the generator; the task list must match the one the state was saved with.

    The training pool stays this sampler's: a run resumed from another run's checkpoint (a warm
    start) may draw from another pool, and whether a workdir may change it is the config check's
    decision (eppo_jax/workdir.py), not the generator's.
    """
    if list(state["specs"]) != self.specs:
      raise ValueError(f"sampler state is for tasks {state['specs']}, not {self.specs}")
    self.weights = [float(w) for w in state["weights"]]
    self._probs = np.asarray(self.weights) / sum(self.weights)
    self.seed = int(state["seed"])
    self._rng.bit_generator.state = dict(state["bit_generator"])
