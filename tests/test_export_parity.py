"""A run's exported HF model, played greedily by transformers (bench/export_parity.py), makes the
same moves as the project's own greedy evaluation of the run's checkpoint, episode for episode."""

import sys

import jax
import numpy as np

from eppo_jax import lora, train, workdir as workdir_lib
from eppo_jax.models import hf
from pipeline_util import ROOT, smoke_config, smoke_tiny_dir  # pylint: disable=unused-import

sys.path.insert(0, str(ROOT / "bench"))

import export_parity  # pylint: disable=g-import-not-at-top,wrong-import-position


def _run_with_export(config, workdir):
  """A workdir as a finished run leaves it: config.json, a checkpoint and hf_export/. The LoRA
  adapters are random and large first: the export's merge changes every projection, and the
  policy's replies become garbage that depends on every token it saw (a random model with small
  weights answers every prompt with the same newlines), so a conversation continued differently
  on one side shows in its replies."""
  workdir_lib.claim(config, workdir)
  trainer = train.Trainer(config, workdir, None)
  try:
    trainer.setup()
    leaves, tree = jax.tree_util.tree_flatten(trainer.state.trainable)
    rng = np.random.default_rng(0)
    trainer.state = trainer.state.replace(trainable=jax.tree_util.tree_unflatten(tree, [
        x + 0.3 * rng.standard_normal(x.shape).astype(x.dtype) for x in leaves]))
    trainer.save()
    hf.export_hf(lora.combine(trainer.state.trainable, trainer.frozen), trainer.model,
                 workdir / "hf_export", trainer.tokenizer)
  finally:
    trainer.close()


def test_transformers_plays_the_export_as_the_project_evaluates(tmp_path, smoke_tiny_dir):
  """Float32 on both sides: every episode's replies, token for token, and so its actions. (With
  noise of std 0.05 added to one exported layer's down_proj, all six episodes part: measured.)"""
  config = smoke_config(smoke_tiny_dir, **{
      "model.lora_rank": 4, "model.lora_alpha": 8.0, "sft.enabled": False,
      "tasks.system_prompt": "instructions", "rollout.max_turns": 3, "train.tensorboard": False,
      "train.plots": False})
  workdir = tmp_path / "run"
  _run_with_export(config, workdir)
  result = export_parity.compare(workdir, per_task=3, dtype="float32")
  assert result.pop("step") == 0 and len(result.pop("seconds")) == 2
  turns = 0
  for spec, s in result.items():
    assert len(s["project"]) == len(s["transformers"]) == 3, spec
    for a, b in zip(s["project"], s["transformers"]):
      assert a.replies == b.replies and a.actions == b.actions, (spec, a, b)
      turns += len(a.replies)
    assert s["identical_actions"] == s["identical_replies"] == 1.0
    assert s["success_project"] == s["success_transformers"]
  assert turns > 2 * 3  # Episodes went on past their first turn: the continued chat is compared.
  replies = {tuple(map(tuple, e.replies)) for s in result.values() for e in s["project"]}
  assert len(replies) > 2  # Input-dependent replies, not one answer to every prompt.
