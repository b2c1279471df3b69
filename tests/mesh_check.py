"""Worker of tests/test_mesh.py: 1-device vs (data=2, fsdp=2, tensor=2) on 8 forced CPU devices.

Run as `XLA_FLAGS=--xla_force_host_platform_device_count=8 python tests/mesh_check.py OUT CKPT`;
writes a JSON of differences that the test asserts on.
"""

import functools
import json
import sys

import jax
import numpy as np

from eppo_jax import lora, objective, pacing, programs, steps
from eppo_jax import hosts
from eppo_jax import mesh as meshlib
from eppo_jax.checkpoint import Checkpointer
from eppo_jax.models.config import LoraConfig, ModelConfig
from eppo_jax.models.transformer import init_params
from eppo_jax.policy import ModelPolicy
from eppo_jax.sampling import SamplingConfig

# Every dimension the rules split is divisible by 2, so each axis really splits something.
MODEL = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=1,
                    num_heads=4, num_kv_heads=2, head_dim=8, attention_bias=True)
B, T, K, G = 16, 20, 3, 2
PROMPT = 6  # Tokens each group's rows share: the update runs them once per group.


def _model():
  params = init_params(MODEL, jax.random.PRNGKey(0))
  model, params = lora.add_lora(params, MODEL, LoraConfig(rank=4, alpha=8.0), jax.random.PRNGKey(1))
  # Non-zero B matrices, so the adapters change the forward pass from the first step.
  params = jax.tree_util.tree_map_with_path(
      lambda p, x: x + 0.03 * np.cos(np.arange(x.size).reshape(x.shape))
      if "lora_b" in jax.tree_util.keystr(p) else x, params)
  return model, params


def _batch(seed: int) -> dict:
  rng = np.random.default_rng(seed)
  pos = np.arange(T)[None]
  attention = pos < rng.integers(T // 2, T + 1, size=B)[:, None]
  loss = attention & (pos >= rng.integers(PROMPT, PROMPT + 4, size=B)[:, None])
  group_ids = np.repeat(np.arange(B // G), G).astype(np.int32)
  tokens = rng.integers(1, MODEL.vocab_size, size=(B, T)).astype(np.int32)
  tokens[:, :PROMPT] = tokens[::G, :PROMPT].repeat(G, axis=0)  # A group's episodes share a prompt.
  return dict(tokens=tokens, attention_mask=attention, loss_mask=loss,
              task_ids=(group_ids % K).astype(np.int32), group_ids=group_ids,
              rewards=rng.normal(size=B).astype(np.float32))


def _max_diff(a, b) -> float:
  return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
             for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def train_steps(mesh, model, trainable, frozen, tx):
  """3 RL steps and 1 SFT step on `mesh` -> (state, metrics of the last step, SFT trainable)."""
  pc, lc = objective.method_configs("eppo")
  batches = [_batch(i) for i in range(3)]
  shared = min(steps.shared_prefix_length(b["tokens"], b["attention_mask"], b["loss_mask"], G,
                                          multiple=1) for b in batches)
  assert shared == PROMPT - 1, shared
  cfg = steps.StepConfig(model=model, pacing=pc, loss=lc, num_tasks=K, num_groups=B // G,
                         num_minibatches=2,
                         minibatch_sharding=meshlib.minibatch_sharding(mesh),
                         shared_prefix=shared, group_size=G)
  state = steps.TrainState(step=np.zeros((), np.int32), trainable=trainable,
                           opt_state=tx.init(trainable), pacing=pacing.init_pacing(K))
  state_sh, frozen_sh = meshlib.shardings(state, mesh), meshlib.shardings(frozen, mesh)
  state, frozen = hosts.put(state, state_sh), hosts.put(frozen, frozen_sh)
  step = jax.jit(functools.partial(steps.train_step, cfg=cfg, tx=tx),
                 in_shardings=(state_sh, frozen_sh, meshlib.batch_sharding(mesh),
                               meshlib.replicated(mesh)),
                 out_shardings=(state_sh, meshlib.replicated(mesh)))
  sft = jax.jit(functools.partial(steps.sft_step, model=model, tx=tx))
  sft_batch = {k: v for k, v in _batch(9).items() if k in ("tokens", "attention_mask", "loss_mask")}
  with jax.set_mesh(mesh):  # As the trainer runs them (activations pinned to their rows).
    for i in range(3):
      state, metrics = step(state, frozen, hosts.put_rows(batches[i], mesh),
                            jax.random.PRNGKey(i))
    sft_trainable, _, _ = sft(state.trainable, state.opt_state, frozen,
                              hosts.put_rows(sft_batch, mesh))
  return state, hosts.fetch(metrics), hosts.fetch(sft_trainable)


def greedy_turns(mesh, model, params):
  """Two greedy turns of 6 conversations (one empty) through ModelPolicy -> [(tokens, mask)]."""
  params = hosts.put(params, meshlib.shardings(params, mesh))
  policy = ModelPolicy(params, model, SamplingConfig(max_new_tokens=5, greedy=True,
                                                     stop_token_ids=(3,)), 64,
                       jax.random.PRNGKey(0), mesh)
  rng = np.random.default_rng(5)
  state, out = None, []
  for width in (8, 8):
    chunk = rng.integers(4, MODEL.vocab_size, size=(6, width)).astype(np.int32)
    mask = np.arange(width)[None] >= rng.integers(0, width - 2, size=6)[:, None]
    mask[2] = False  # A finished conversation.
    reply, reply_mask, state, _ = policy(np.where(mask, chunk, 0), mask, state, mask.any(1))
    out.append((np.asarray(reply), np.asarray(reply_mask)))
  return out


def main(out_path: str, ckpt_dir: str) -> None:
  model, params = _model()
  trainable, frozen = lora.partition(params, lora.trainable_mask(params))
  tx = programs.make_optimizer(3e-3, 0, 0.0, 1.0)
  one = meshlib.make_mesh(meshlib.MeshConfig(1, 1, 1), jax.devices()[:1])
  eight = meshlib.make_mesh(meshlib.MeshConfig(2, 2, 2))

  state1, metrics1, sft1 = train_steps(one, model, trainable, frozen, tx)
  state8, metrics8, sft8 = train_steps(eight, model, trainable, frozen, tx)
  sharded = sum(any(a is not None for a in x.sharding.spec)
                for x in jax.tree_util.tree_leaves(state8))

  turns1, turns8 = greedy_turns(one, model, params), greedy_turns(eight, model, params)
  rollout_equal = all(np.array_equal(a, b) for t1, t8 in zip(turns1, turns8)
                      for a, b in zip(t1, t8))

  # Written from the 8-device mesh, read back onto (data=1, fsdp=4, tensor=2).
  ckpt = Checkpointer(ckpt_dir)
  ckpt.save(3, state8, {"note": "mesh"})
  other = meshlib.make_mesh(meshlib.MeshConfig(1, 4, 2))
  target_sh = meshlib.shardings(state8, other)
  like = jax.tree_util.tree_map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                state8, target_sh)
  restored, meta = ckpt.restore(like)
  ckpt.close()
  follows = all(x.sharding == s for x, s in zip(jax.tree_util.tree_leaves(restored),
                                                jax.tree_util.tree_leaves(target_sh)))

  result = dict(
      devices=jax.device_count(), mesh=dict(eight.shape), sharded_leaves=int(sharded),
      train_max_abs_diff=_max_diff(hosts.fetch(state1), hosts.fetch(state8)),
      sft_max_abs_diff=_max_diff(sft1, sft8),
      update_size=_max_diff(hosts.fetch(state1.trainable), trainable),
      metrics={k: [np.asarray(metrics1[k], np.float64).tolist(),
                   np.asarray(metrics8[k], np.float64).tolist()] for k in metrics1},
      rollout_equal=bool(rollout_equal),
      rollout_tokens=int(sum(m.sum() for _, m in turns1)),
      restored_specs_follow_target=bool(follows and meta == {"note": "mesh"}),
      restore_max_abs_diff=_max_diff(hosts.fetch(restored), hosts.fetch(state8)))
  with open(out_path, "w") as f:
    json.dump(result, f)


if __name__ == "__main__":
  main(sys.argv[1], sys.argv[2])
