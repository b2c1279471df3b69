"""Blockwise, fused and splash attention against the dense reference: values, gradients, compiled
memory. Splash (the TPU kernel) runs in Pallas' interpreter here."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from eppo_jax.models import attention
from eppo_jax.models.attention import KeySource
from eppo_jax.models.config import ModelConfig
from eppo_jax.models.transformer import init_params, logits

TINY = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=8)
TOL = 1e-5


def _batch(t=40, seed=0):
  """Tokens [3,T]: one full row, one left-padded row, one right-padded row."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, TINY.vocab_size, (3, t)).astype(np.int32)
  mask = np.ones((3, t), bool)
  mask[1, :13] = False
  mask[2, t - 9:] = False
  return jnp.asarray(tokens), mask


def _loss(params, config, tokens, mask, weights):
  """A scalar that reads every valid position's logits (pads carry no loss, as in training)."""
  out = logits(params, config, tokens, mask)
  return jnp.sum(out * weights * jnp.asarray(mask)[..., None]) / mask.sum()


@pytest.mark.parametrize("name,overrides,blocks", [
    ("gqa", {}, (8, 16)),
    ("mha_qknorm", dict(num_kv_heads=4, qk_norm=True), (16, 8)),
    ("uneven", dict(num_heads=6, num_kv_heads=2), (7, 12)),
])
def test_blockwise_equals_dense_forward_and_gradient(name, overrides, blocks):
  config = TINY.replace(**overrides)
  params = init_params(config, jax.random.PRNGKey(1))
  tokens, mask = _batch()
  weights = jax.random.normal(jax.random.PRNGKey(2), (3, 40, config.vocab_size))
  dense = config.replace(attention_impl="dense")
  block = config.replace(attention_impl="blockwise", attention_block_q=blocks[0],
                         attention_block_k=blocks[1])
  value_and_grad = jax.jit(jax.value_and_grad(_loss), static_argnums=1)
  fwd = jax.jit(logits, static_argnums=1)
  out_d, out_b = np.asarray(fwd(params, dense, tokens, mask)), np.asarray(fwd(params, block,
                                                                              tokens, mask))
  assert np.abs(out_d[mask]).max() > 0.1, name
  np.testing.assert_allclose(out_b[mask], out_d[mask], atol=TOL, rtol=0)
  (_, grad_d), (_, grad_b) = (value_and_grad(params, c, tokens, mask, weights)
                              for c in (dense, block))
  for g_d, g_b in zip(jax.tree_util.tree_leaves(grad_d), jax.tree_util.tree_leaves(grad_b)):
    np.testing.assert_allclose(np.asarray(g_b), np.asarray(g_d), atol=TOL, rtol=0)
  assert max(float(jnp.abs(g).max()) for g in jax.tree_util.tree_leaves(grad_d)) > 0.1


@pytest.mark.parametrize("impl", ["xla", "splash"])
def test_fused_attention_equals_dense(impl):
  """The model's logits and gradients with a left- and a right-padded row."""
  params = init_params(TINY, jax.random.PRNGKey(1))
  tokens, mask = _batch()
  weights = jax.random.normal(jax.random.PRNGKey(3), (3, 40, TINY.vocab_size))
  fwd = jax.jit(logits, static_argnums=1)
  grad = jax.jit(jax.grad(_loss), static_argnums=1)
  dense, xla = TINY.replace(attention_impl="dense"), TINY.replace(attention_impl=impl)
  np.testing.assert_allclose(np.asarray(fwd(params, xla, tokens, mask))[mask],
                             np.asarray(fwd(params, dense, tokens, mask))[mask], atol=TOL, rtol=0)
  for g_d, g_x in zip(jax.tree_util.tree_leaves(grad(params, dense, tokens, mask, weights)),
                      jax.tree_util.tree_leaves(grad(params, xla, tokens, mask, weights))):
    np.testing.assert_allclose(np.asarray(g_x), np.asarray(g_d), atol=TOL, rtol=0)


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="cuDNN's kernel needs an NVIDIA GPU")
def test_cudnn_attention_equals_dense_on_a_gpu():
  """cuDNN's fused kernel in bfloat16 (it has no float32 path) against the dense path in bfloat16:
  logits and gradients with padded rows, within bfloat16's rounding."""
  config = TINY.replace(dtype="bfloat16", head_dim=64, hidden_size=128)
  params = init_params(config, jax.random.PRNGKey(1))
  tokens, mask = _batch()
  weights = jax.random.normal(jax.random.PRNGKey(3), (3, 40, config.vocab_size))
  fwd = jax.jit(logits, static_argnums=1)
  grad = jax.jit(jax.grad(_loss), static_argnums=1)
  dense, cudnn = config.replace(attention_impl="dense"), config.replace(attention_impl="cudnn")
  want = np.asarray(fwd(params, dense, tokens, mask))[mask]
  np.testing.assert_allclose(np.asarray(fwd(params, cudnn, tokens, mask))[mask], want,
                             atol=0.03 * np.abs(want).max(), rtol=0)
  for g_d, g_c in zip(jax.tree_util.tree_leaves(grad(params, dense, tokens, mask, weights)),
                      jax.tree_util.tree_leaves(grad(params, cudnn, tokens, mask, weights))):
    g_d, g_c = np.asarray(g_d, np.float32), np.asarray(g_c, np.float32)
    np.testing.assert_allclose(g_c, g_d, atol=0.03 * np.abs(g_d).max() + 1e-6, rtol=0)


def test_blockwise_over_cache_and_chunk_equals_dense():
  """A prefill chunk over cache slots (some invalid, an unused tail) and its own causal keys."""
  rng = np.random.default_rng(4)
  b, t, s, kh, g, h = 2, 20, 48, 2, 3, 8
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  q = normal(b, t, kh, g, h)
  cache_valid = np.zeros((b, s), bool)
  cache_valid[0, 5:30] = True
  cache_valid[1, 2:17] = True  # Slots 30.. are the unused tail: whole blocks are skipped.
  chunk_valid = np.ones((b, t), bool)
  chunk_valid[1, :6] = False  # Left-padded chunk.
  sources = [KeySource(normal(b, kh, s, h), normal(b, kh, s, h), jnp.asarray(cache_valid), False),
             KeySource(normal(b, kh, t, h), normal(b, kh, t, h), jnp.asarray(chunk_valid), True)]
  dense = attention.attend(q, sources, impl="dense", block_q=8, block_k=8, dtype=jnp.float32)
  blockwise = jax.jit(lambda q: attention.attend(q, sources, impl="blockwise", block_q=8,
                                                  block_k=8, dtype=jnp.float32))(q)
  np.testing.assert_allclose(np.asarray(blockwise), np.asarray(dense), atol=TOL, rtol=0)


def test_chunk_behind_its_prefix_equals_the_tail_of_full_attention():
  """One causal source of S keys whose last T are the queries (the update's shared prompt): the
  dense path and the kernel's custom VJP == the last T rows of full self-attention over S, values
  and gradients."""
  rng = np.random.default_rng(6)
  b, s, t, kh, g, h = 2, 45, 29, 2, 3, 8
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  q_full, k, v = normal(b, s, kh, g, h), normal(b, kh, s, h), normal(b, kh, s, h)
  valid = np.ones((b, s), bool)
  valid[1, :4] = False  # A left-padded prompt.
  valid[0, s - 3:] = False  # A right-padded reply.
  valid = jnp.asarray(valid)
  w = normal(b, t, kh, g, h)

  def full(q_full, k, v):  # Reference: every position queries, the last T rows are kept.
    out = attention.attend(q_full, [KeySource(k, v, valid, True)], impl="dense", block_q=8,
                           block_k=8, dtype=jnp.float32)
    return jnp.sum(out[:, s - t:] * w * valid[:, s - t:, None, None, None])

  def tail(impl):
    def f(q_full, k, v):
      out = attention.attend(q_full[:, s - t:], [KeySource(k, v, valid, True)], impl=impl,
                             block_q=8, block_k=8, dtype=jnp.float32)
      return jnp.sum(out * w * valid[:, s - t:, None, None, None])
    return f

  want, want_grads = jax.value_and_grad(full, argnums=(0, 1, 2))(q_full, k, v)
  for impl in ("dense", "blockwise", "splash"):
    got, grads = jax.jit(jax.value_and_grad(tail(impl), argnums=(0, 1, 2)))(q_full, k, v)
    np.testing.assert_allclose(float(got), float(want), rtol=1e-5, err_msg=impl)
    for x, y in zip(grads, want_grads):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=TOL, rtol=0, err_msg=impl)
  assert float(jnp.abs(want_grads[1]).max()) > 0.1


def test_single_query_equals_dense():
  """A decode step: one query per row over cache slots (one row with none valid) and itself (one
  row a pad), under each implementation against the dense reference."""
  rng = np.random.default_rng(5)
  b, s, kh, g, h = 3, 37, 2, 3, 8
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  q = normal(b, 1, kh, g, h)
  cache_valid = rng.random((b, s)) < 0.6
  cache_valid[2] = False
  sources = [KeySource(normal(b, kh, s, h), normal(b, kh, s, h), jnp.asarray(cache_valid), False),
             KeySource(normal(b, kh, 1, h), normal(b, kh, 1, h), jnp.asarray([[1], [0], [1]], bool),
                       True)]
  dense = np.asarray(attention.attend(q, sources, impl="dense", block_q=8, block_k=8,
                                      dtype=jnp.float32))
  assert np.abs(dense).max() > 0.1
  for impl in ("blockwise", "xla"):
    out = jax.jit(lambda q: attention.attend(q, sources, impl=impl, block_q=8, block_k=8,
                                             dtype=jnp.float32))(q)
    np.testing.assert_allclose(np.asarray(out), dense, atol=TOL, rtol=0, err_msg=impl)


def test_blockwise_memory_does_not_grow_with_t_squared():
  """Compiled forward + backward temporaries: dense holds B*N*T*T floats, blockwise far less."""
  b, t, kh, g, h = 1, 2048, 2, 2, 16
  spec = jax.ShapeDtypeStruct
  q = spec((b, t, kh, g, h), jnp.float32)
  kv = spec((b, kh, t, h), jnp.float32)
  valid = spec((b, t), jnp.bool_)

  def temp_bytes(impl):
    def loss(q, k, v, valid):
      out = attention.attend(q, [KeySource(k, v, valid, True)], impl=impl, block_q=128,
                             block_k=128, dtype=jnp.float32)
      return jnp.sum(out * out)
    compiled = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, valid).compile()
    return compiled.memory_analysis().temp_size_in_bytes

  scores_bytes = b * kh * g * t * t * 4
  dense, blockwise = temp_bytes("dense"), temp_bytes("blockwise")
  assert dense >= scores_bytes  # The reference does hold the scores: the measure sees them.
  assert blockwise < scores_bytes / 16, (blockwise, scores_bytes)


def test_splash_per_shard_equals_dense_on_a_data_x_tensor_mesh():
  """Under a 2 x 2 mesh the kernel runs per shard (rows over data, key/value heads over tensor):
  values and gradients as the dense reference's on one device."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:4]).reshape(2, 1, 2), ("data", "fsdp", "tensor"))
  rng = np.random.default_rng(7)
  b, s, t, kh, g, h = 4, 50, 50, 2, 2, 8
  normal = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  q, w = normal(b, t, kh, g, h), normal(b, t, kh, g, h)
  k, v = normal(b, kh, s, h), normal(b, kh, s, h)
  valid = np.ones((b, s), bool)
  valid[1, :7] = False
  valid[2, 30:] = False
  valid = jnp.asarray(valid)

  def loss(impl):
    def f(q, k, v):
      out = attention.attend(q, [KeySource(k, v, valid, True)], impl=impl, block_q=128,
                             block_k=128, dtype=jnp.float32)
      return jnp.sum(out * w * valid[:, :, None, None, None])
    return jax.value_and_grad(f, argnums=(0, 1, 2))

  want, want_grads = loss("dense")(q, k, v)
  P = jax.sharding.PartitionSpec
  put = lambda x, spec: jax.device_put(x, jax.sharding.NamedSharding(mesh, spec))
  with jax.set_mesh(mesh):
    got, grads = jax.jit(loss("splash"))(put(q, P(("data", "fsdp"), None, "tensor")),
                                         put(k, P(("data", "fsdp"), "tensor")),
                                         put(v, P(("data", "fsdp"), "tensor")))
  np.testing.assert_allclose(float(got), float(want), rtol=1e-5)
  for x, y in zip(grads, want_grads):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=TOL, rtol=0)
  assert float(jnp.abs(want_grads[0]).max()) > 0.1


@pytest.mark.parametrize("platform,dtype,want", [
    ("tpu", "bfloat16", "splash"), ("tpu", "float32", "splash"), ("gpu", "bfloat16", "cudnn"),
    ("gpu", "float32", "blockwise"), ("cpu", "bfloat16", "blockwise")])
def test_auto_names_the_kernel_of_the_chip(platform, dtype, want):
  assert attention.resolve("auto", platform, dtype) == want
  assert attention.resolve("dense", platform, dtype) == "dense"


def test_bad_attention_impl_is_refused():
  with pytest.raises(ValueError, match="attention_impl"):
    TINY.replace(attention_impl="flash")


def test_decode_steps_take_the_dense_path_and_long_chunks_the_kernel():
  """Dense exactly when the T x S scores fit one block pair: a decode step over a 4096-slot cache
  has 4096 scores per head (dense, no loop), a 1024-token chunk 4M (blockwise, a scan)."""
  spec = jax.ShapeDtypeStruct

  def uses_scan(t, s):
    args = (spec((2, t, 2, 2, 16), jnp.float32), spec((2, 2, s, 16), jnp.float32),
            spec((2, 2, s, 16), jnp.float32), spec((2, s), jnp.bool_))
    jaxpr = jax.make_jaxpr(lambda q, k, v, valid: attention.attend(
        q, [KeySource(k, v, valid, False)], impl="blockwise", block_q=512, block_k=512,
        dtype=jnp.float32))(*args)
    return "scan" in str(jaxpr)

  assert not uses_scan(1, 4096) and not uses_scan(64, 4096)
  assert uses_scan(1024, 4096) and uses_scan(65, 4096)


def test_a_chunk_shorter_than_a_block_is_not_padded_to_one():
  """A 64-token chunk over an 8192-slot cache (blockwise: 64 x 8192 scores > one block pair) uses
  64-query blocks: its temporaries are a fraction of a 512-token chunk's, not the same."""
  spec = jax.ShapeDtypeStruct

  def temporaries(t):
    args = (spec((8, t, 2, 2, 16), jnp.float32), spec((8, 2, 8192, 16), jnp.float32),
            spec((8, 2, 8192, 16), jnp.float32), spec((8, 8192), jnp.bool_))
    fn = jax.jit(lambda q, k, v, valid: attention.attend(
        q, [KeySource(k, v, valid, False)], impl="blockwise", block_q=512, block_k=512,
        dtype=jnp.float32))
    return fn.lower(*args).compile().memory_analysis().temp_size_in_bytes

  assert 4 * temporaries(64) < temporaries(512)


def test_blocks_are_evened_out_over_the_sequence():
  """As many blocks as the configured size needs, each a multiple of 8 and no larger, with less
  than 8 padding positions per block (72 tokens at block 64: two blocks of 40, not of 64)."""
  for block in (8, 64, 512):
    for length in range(1, 1100):
      size = attention._balanced_block(block, length)
      count = -(-length // size)
      assert size % 8 == 0 and size <= max(block, 8), (block, length, size)
      assert count == -(-length // block), (block, length, size)
      assert count * size - length < 8 * count, (block, length, size)
