"""LoRA as a pytree transform: adapters on/off/merged, HF export, and the frozen-base optimizer."""

import flax.traverse_util as tu
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eppo_jax
from eppo_jax import lora, programs
from eppo_jax.models.config import LORA_TARGETS, LoraConfig

from conftest import fast_logits, hf_logits, left_padded_batch, max_valid_diff

LENGTHS = (20, 13)
LORA = LoraConfig(rank=4, alpha=8.0)  # One config, so the compiled forward is shared by tests.


def _with_random_adapters(pre, seed=0, lora_cfg=LORA):
  """(config, params) with adapters whose B is random, so they change the output."""
  config, params = lora.add_lora(pre.params, pre.config, lora_cfg, jax.random.PRNGKey(seed))
  flat = tu.flatten_dict(params)
  key = jax.random.PRNGKey(seed + 1)
  for i, path in enumerate(sorted(p for p in flat if p[-1] == "lora_b")):
    flat[path] = 0.3 * jax.random.normal(jax.random.fold_in(key, i), flat[path].shape)
  return config, tu.unflatten_dict(flat)


def _lora_paths(params):
  return sorted(p for p in tu.flatten_dict(params) if lora.is_lora_path(p))


@pytest.fixture(scope="module")
def qwen2(hf_checkpoints):
  """Qwen2 (q/k/v bias, tied embeddings) loaded in float32, plus a left-padded batch."""
  _, model_dir = hf_checkpoints("qwen2_oldstyle")
  pre = eppo_jax.load_pretrained(model_dir, with_tokenizer=False)
  tokens, mask = left_padded_batch(pre.config.vocab_size, LENGTHS, seed=11)
  return pre, jnp.asarray(tokens), jnp.asarray(mask)


def test_add_lora_targets_and_initial_no_op(qwen2):
  """Adapters go on exactly the targeted projections and, with B = 0, change nothing."""
  pre, tokens, mask = qwen2
  config, params = lora.add_lora(pre.params, pre.config, LORA, jax.random.PRNGKey(0))
  assert config.lora == LORA
  adapted = {p[-2] for p in _lora_paths(params)}
  assert adapted == set(LORA_TARGETS)
  a = params["params"]["layers"]["mlp"]["down_proj"]["lora_a"]
  b = params["params"]["layers"]["mlp"]["down_proj"]["lora_b"]
  assert a.shape == (2, 48, 4) and b.shape == (2, 4, 32) and not np.any(b)
  # Per-layer A differ (each layer gets its own draw).
  assert not np.allclose(a[0], a[1])
  base = fast_logits(pre.params, pre.config, tokens, mask)
  start = fast_logits(params, config, tokens, mask)
  assert max_valid_diff(start, base, mask) < 1e-6

  _, some = lora.add_lora(pre.params, pre.config, LoraConfig(rank=2, targets=("q_proj", "v_proj")),
                          jax.random.PRNGKey(0))
  assert {p[-2] for p in _lora_paths(some)} == {"q_proj", "v_proj"}
  n_lora, n_all = lora.count(some)
  assert n_lora == 2 * ((32 * 2 + 2 * 32) + (32 * 2 + 2 * 16))  # L x (A + B) per target.
  assert n_all == n_lora + pre.config.num_params()


def test_lora_config_validation():
  """A non-positive rank or an unknown target is refused at construction."""
  with pytest.raises(ValueError, match="rank"):
    LoraConfig(rank=0)
  with pytest.raises(ValueError, match="lm_head"):
    LoraConfig(targets=("q_proj", "lm_head"))
  assert LoraConfig(rank=4, alpha=8.0).scale == 2.0


def test_base_params_is_exactly_the_base_model(qwen2):
  """Dropping the adapter leaves gives bit-for-bit the original model's logits."""
  pre, tokens, mask = qwen2
  config, params = _with_random_adapters(pre)
  adapted = np.asarray(fast_logits(params, config, tokens, mask))
  base = np.asarray(fast_logits(pre.params, pre.config, tokens, mask))
  off = np.asarray(fast_logits(lora.base_params(params), config, tokens, mask))
  assert max_valid_diff(adapted, base, mask) > 1e-2, "adapters should change the output"
  np.testing.assert_array_equal(off, base)
  assert _lora_paths(lora.base_params(params)) == []
  jax.tree_util.tree_map(np.testing.assert_array_equal, lora.base_params(params), pre.params)


def test_merge_equals_adapter_forward(qwen2):
  """Folding the adapters into the kernels gives the adapted model's logits, without adapters."""
  pre, tokens, mask = qwen2
  config, params = _with_random_adapters(pre)
  merged = lora.merge(params, config)
  assert _lora_paths(merged) == []
  adapted = fast_logits(params, config, tokens, mask)
  assert max_valid_diff(fast_logits(merged, pre.config, tokens, mask), adapted, mask) < 1e-4
  # The scale is alpha / rank: doubling alpha must double the kernel delta.
  k0 = pre.params["params"]["layers"]["self_attn"]["q_proj"]["kernel"]
  k1 = merged["params"]["layers"]["self_attn"]["q_proj"]["kernel"]
  k2 = lora.merge(params, config.replace(lora=LoraConfig(rank=4, alpha=16.0)))[
      "params"]["layers"]["self_attn"]["q_proj"]["kernel"]
  np.testing.assert_allclose(k2 - k0, 2 * (k1 - k0), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name,shard_bytes", [("qwen2_oldstyle", 4 << 30),
                                              ("llama3_tied", 20_000), ("qwen3", 4 << 30)])
def test_export_round_trip_through_transformers(hf_checkpoints, tmp_path, name, shard_bytes):
  """export_hf of an adapted model loads in transformers with the adapted model's logits."""
  import transformers  # pylint: disable=g-import-not-at-top
  _, model_dir = hf_checkpoints(name)
  pre = eppo_jax.load_pretrained(model_dir, with_tokenizer=False)
  config, params = _with_random_adapters(pre, seed=3)
  tokens, mask = left_padded_batch(pre.config.vocab_size, (48, 30), seed=2)
  ours = np.asarray(fast_logits(params, config, tokens, mask))
  assert max_valid_diff(ours, fast_logits(pre.params, pre.config, tokens, mask), mask) > 1e-2

  out = eppo_jax.export_hf(params, config, tmp_path / "export", max_shard_bytes=shard_bytes)
  sharded = (out / "model.safetensors.index.json").exists()
  assert sharded == (shard_bytes < 1 << 20)
  model = transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager")
  assert model.config.tie_word_embeddings == pre.config.tie_word_embeddings
  assert max_valid_diff(hf_logits(model.float().eval(), tokens, mask), ours, mask) < 1e-4
  # And our own loader reads the export back as the merged model (no adapters, base config).
  again = eppo_jax.load_pretrained(out, with_tokenizer=False)
  assert again.config == pre.config
  assert max_valid_diff(fast_logits(again.params, again.config, tokens, mask), ours, mask) < 1e-4


def test_reexport_into_same_directory_replaces_old_weights(hf_checkpoints, tmp_path):
  """Exporting again (sharded, then single-file) leaves no stale shards for any reader to pick."""
  _, model_dir = hf_checkpoints("llama")
  pre = eppo_jax.load_pretrained(model_dir, with_tokenizer=False)
  out = tmp_path / "export"
  eppo_jax.export_hf(pre.params, pre.config, out, max_shard_bytes=20_000)
  assert (out / "model.safetensors.index.json").exists()
  doubled = jax.tree_util.tree_map(lambda x: 2 * x, pre.params)
  eppo_jax.export_hf(doubled, pre.config, out)
  assert sorted(p.name for p in out.glob("model*")) == ["model.safetensors"]
  again = eppo_jax.load_pretrained(out, with_tokenizer=False)
  jax.tree_util.tree_map(np.testing.assert_array_equal, again.params, doubled)


def test_bf16_export_reloads_bit_exactly(hf_checkpoints, tmp_path):
  """bf16 params export as bf16 safetensors and load back unchanged."""
  _, model_dir = hf_checkpoints("qwen3")
  pre = eppo_jax.load_pretrained(model_dir, dtype=jnp.bfloat16, with_tokenizer=False)
  out = eppo_jax.export_hf(pre.params, pre.config, tmp_path / "bf16")
  again = eppo_jax.load_pretrained(out, dtype=jnp.bfloat16, with_tokenizer=False)
  assert again.config == pre.config
  jax.tree_util.tree_map(np.testing.assert_array_equal, again.params, pre.params)


def test_masked_optimizer_freezes_base_and_keeps_state_only_for_adapters(qwen2):
  """Adam through the mask: base bit-for-bit unchanged, adapters move, state only for adapters."""
  pre, tokens, mask = qwen2
  config, params = lora.add_lora(pre.params, pre.config, LORA, jax.random.PRNGKey(0))
  tx = lora.masked_optimizer(optax.adam(1e-2), lora.trainable_mask(params))
  opt_state = tx.init(params)

  def loss_fn(p):
    logp = jax.nn.log_softmax(eppo_jax.logits(p, config, tokens, mask)[:, :-1])
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.sum(nll * mask[:, 1:]) / jnp.sum(mask[:, 1:])

  @jax.jit
  def step(p, s):
    loss, grads = jax.value_and_grad(loss_fn)(p)
    updates, s = tx.update(grads, s, p)
    return optax.apply_updates(p, updates), s, loss, grads

  new, state, losses = params, opt_state, []
  for _ in range(3):
    new, state, loss, grads = step(new, state)
    losses.append(float(loss))
  assert losses[-1] < losses[0]

  flat_old, flat_new, flat_grad = (tu.flatten_dict(t) for t in (params, new, grads))
  lora_paths = _lora_paths(params)
  for path, old in flat_old.items():
    if lora.is_lora_path(path):
      assert not np.array_equal(flat_new[path], old), path
    else:
      # The base does receive gradient; only the mask keeps it still.
      assert np.any(flat_grad[path] != 0), path
      assert np.array_equal(flat_new[path], old), path

  state_shapes = sorted(x.shape for x in jax.tree_util.tree_leaves(state) if np.ndim(x) > 0)
  lora_shapes = sorted(flat_old[p].shape for p in lora_paths)
  assert state_shapes == sorted(lora_shapes * 2)  # Adam's mu and nu, nothing else.
  base_shapes = {v.shape for p, v in flat_old.items() if not lora.is_lora_path(p)}
  assert not base_shapes & set(state_shapes)


def test_partitioned_update_equals_the_masked_optimizer(qwen2):
  """The trainer's form of the LoRA-masked optimizer (`programs`: the plain optimizer on the
  partitioned trainable leaves, the frozen base a constant) gives the update that
  `lora.masked_optimizer` gives on the whole tree, over 3 steps of the trainer's AdamW."""
  pre, tokens, mask = qwen2
  config, params = lora.add_lora(pre.params, pre.config, LORA, jax.random.PRNGKey(0))
  trainable_mask = lora.trainable_mask(params)
  tx = programs.make_optimizer(1e-2, 0, 0.1, 1.0)  # Clipping and weight decay included.

  def loss_fn(p):
    logp = jax.nn.log_softmax(eppo_jax.logits(p, config, tokens, mask)[:, :-1])
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    return jnp.sum(nll * mask[:, 1:]) / jnp.sum(mask[:, 1:])

  masked = lora.masked_optimizer(tx, trainable_mask)

  @jax.jit
  def masked_step(p, s):
    updates, s = masked.update(jax.grad(loss_fn)(p), s, p)
    return optax.apply_updates(p, updates), s

  @jax.jit
  def partitioned_step(trainable, frozen, s):
    grads = jax.grad(lambda t: loss_fn(lora.combine(t, frozen)))(trainable)
    updates, s = tx.update(grads, s, trainable)
    return optax.apply_updates(trainable, updates), s

  whole, whole_state = params, masked.init(params)
  trainable, frozen = lora.partition(params, trainable_mask)
  part_state = tx.init(trainable)
  for _ in range(3):
    whole, whole_state = masked_step(whole, whole_state)
    trainable, part_state = partitioned_step(trainable, frozen, part_state)
  flat_whole = tu.flatten_dict(whole)
  flat_part = tu.flatten_dict(lora.combine(trainable, frozen))
  assert flat_whole.keys() == flat_part.keys()
  moved = 0
  for path, x in flat_whole.items():
    np.testing.assert_allclose(flat_part[path], x, rtol=1e-6, atol=1e-7, err_msg=str(path))
    moved += lora.is_lora_path(path) and not np.array_equal(x, tu.flatten_dict(params)[path])
  assert moved == len(_lora_paths(params))  # Every adapter moved: not two no-ops.


def test_trainable_mask_and_partition_round_trip(qwen2):
  """partition splits adapters from base by the mask; combine restores the original tree."""
  pre, _, _ = qwen2
  _, params = _with_random_adapters(pre)
  mask = lora.trainable_mask(params)
  flat_mask = tu.flatten_dict(mask)
  assert {p for p, m in flat_mask.items() if m} == set(_lora_paths(params))
  assert all(tu.flatten_dict(lora.trainable_mask(params, full_finetune=True)).values())

  trainable, frozen = lora.partition(params, mask)
  assert set(tu.flatten_dict(trainable)) == set(_lora_paths(params))
  assert not set(tu.flatten_dict(frozen)) & set(tu.flatten_dict(trainable))
  rebuilt = lora.combine(trainable, frozen)
  assert jax.tree_util.tree_structure(rebuilt) == jax.tree_util.tree_structure(params)
  jax.tree_util.tree_map(np.testing.assert_array_equal, rebuilt, params)
