"""Linen decoder for Llama 3.x, Qwen2/2.5 and Qwen3, with a slot-based KV cache.

Shape letters: B batch, T new tokens, S cache slots, L layers, D hidden, F MLP width, N query heads,
K key/value heads, H head dim, V vocab.

The cache is a fixed array of `S` slots per sequence plus a validity mask. Every call writes its `T`
tokens into slots `[index, index + T)` for all rows at once; rows whose chunk is shorter are
left-padded inside the chunk and the pad slots stay masked. RoPE positions count only valid tokens,
so a conversation assembled from ragged chunks (prompt, reply, observation, reply, ...) sees exactly
the positions and keys of the same conversation written contiguously, and `logits()` on the compacted
sequence reproduces the cached computation.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp

from eppo_jax import mesh
from eppo_jax.models.attention import KeySource, attend
from eppo_jax.models.config import ModelConfig

Params = Any
# Keys/values are stored [L,B,K,S,H] (slots next to head_dim) so that a layer's slice feeds both
# attention matmuls without a transposing copy of the cache at every decode step.
Cache = dict  # {"k","v": [L,B,K,S,H], "mask": [B,S] bool, "index": [] int32, "pos": [B] int32}


def rope_frequencies(config: ModelConfig) -> jnp.ndarray:
  """Inverse frequencies [H/2] with the config's scaling (none, linear or llama3)."""
  h = config.head_dim
  inv_freq = 1.0 / (config.rope_theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
  scaling = config.rope_scaling_dict
  kind = scaling.get("rope_type", scaling.get("type", "default"))
  if kind == "default":
    return inv_freq
  if kind == "linear":
    return inv_freq / scaling["factor"]
  if kind == "llama3":
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are stretched by `factor`, short ones kept, the band between interpolated.
    scaled = jnp.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return jnp.where(medium, blended, scaled)
  raise NotImplementedError(f"rope_scaling type {kind!r} is not supported "
                            "(supported: default, linear, llama3)")


def apply_rope(x_BxTxNxH, sin_BxTxH, cos_BxTxH):
  """Rotates pairs (i, i + H/2), the HF convention."""
  x1, x2 = jnp.split(x_BxTxNxH, 2, axis=-1)
  rotated = jnp.concatenate([-x2, x1], axis=-1)
  sin, cos = sin_BxTxH[:, :, None, :], cos_BxTxH[:, :, None, :]
  return (x_BxTxNxH * cos + rotated * sin).astype(x_BxTxNxH.dtype)


class RMSNorm(nn.Module):
  eps: float
  dtype: Any
  param_dtype: Any

  @nn.compact
  def __call__(self, x):
    scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
    x32 = x.astype(jnp.float32)
    normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return scale.astype(self.dtype) * normed.astype(self.dtype)


class Linear(nn.Module):
  """Dense layer with an optional LoRA branch, applied only when its leaves are in the params.

  Dropping the `lora_a`/`lora_b` leaves from the params (see `lora.base_params`) therefore gives the
  frozen base model: that is how the KL reference policy is evaluated without a second copy.
  """

  features: int
  config: ModelConfig
  use_bias: bool = False

  @nn.compact
  def __call__(self, x):
    cfg = self.config
    kernel = self.param("kernel", nn.initializers.normal(0.02), (x.shape[-1], self.features),
                        cfg.weight_dtype)
    x = x.astype(cfg.compute_dtype)
    y = x @ kernel.astype(cfg.compute_dtype)
    if self.use_bias:
      bias = self.param("bias", nn.initializers.zeros, (self.features,), cfg.weight_dtype)
      y = y + bias.astype(cfg.compute_dtype)
    lora = cfg.lora
    wants_lora = lora is not None and self.name in lora.targets
    if wants_lora and (self.is_initializing() or self.has_variable("params", "lora_a")):
      a = self.param("lora_a", nn.initializers.variance_scaling(1.0, "fan_in", "normal"),
                     (x.shape[-1], lora.rank), jnp.float32)
      b = self.param("lora_b", nn.initializers.zeros, (lora.rank, self.features), jnp.float32)
      y = y + ((x @ a.astype(x.dtype)) @ b.astype(x.dtype)) * lora.scale
    return y


class Attention(nn.Module):
  config: ModelConfig
  prefix_cache: bool = False  # See `Transformer.prefix_cache`.

  @nn.compact
  def __call__(self, x_BxTxD, sin, cos, token_mask_BxT, kv_cache):
    cfg = self.config
    b, t, _ = x_BxTxD.shape
    n, k, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q_BxTxNxH = Linear(n * h, cfg, cfg.attention_bias, name="q_proj")(x_BxTxD).reshape(b, t, n, h)
    k_BxTxKxH = Linear(k * h, cfg, cfg.attention_bias, name="k_proj")(x_BxTxD).reshape(b, t, k, h)
    v_BxTxKxH = Linear(k * h, cfg, cfg.attention_bias, name="v_proj")(x_BxTxD).reshape(b, t, k, h)
    if cfg.qk_norm:
      norm = lambda name: RMSNorm(cfg.rms_norm_eps, cfg.compute_dtype, cfg.weight_dtype, name=name)
      q_BxTxNxH, k_BxTxKxH = norm("q_norm")(q_BxTxNxH), norm("k_norm")(k_BxTxKxH)
    q_BxTxNxH = apply_rope(q_BxTxNxH, sin, cos)
    k_BxTxKxH = apply_rope(k_BxTxKxH, sin, cos)

    # Grouped-query attention: query heads are grouped G = N / K per key/value head.
    q_BxTxKxGxH = q_BxTxNxH.reshape(b, t, k, n // k, h)
    k_BxKxTxH, v_BxKxTxH = k_BxTxKxH.transpose(0, 2, 1, 3), v_BxTxKxH.transpose(0, 2, 1, 3)
    sources = []
    new_cache = None
    if kv_cache is not None:
      # Attend to the cache slots written before this chunk and to the chunk itself, and return
      # only the chunk: `forward_with_cache` writes all layers' chunks into the cache in one
      # in-place update. Updating this layer's cache slice here instead made XLA copy the whole
      # cache through the layer scan at every decode step.
      cache_k, cache_v, cache_valid_BxS = kv_cache  # [B,K,S,H], [B,K,S,H], [B,S]
      # Round-trip through the cache dtype, so the chunk is seen exactly as later reads will see it.
      k_BxKxTxH, v_BxKxTxH = k_BxKxTxH.astype(cache_k.dtype), v_BxKxTxH.astype(cache_v.dtype)
      new_cache = (k_BxKxTxH, v_BxKxTxH)
      if self.prefix_cache:  # One causal sequence of S + T keys, the queries its last T.
        cat = lambda a, b: jnp.concatenate([a, b], axis=-2)
        k_BxKxTxH, v_BxKxTxH = cat(cache_k, k_BxKxTxH), cat(cache_v, v_BxKxTxH)
        token_mask_BxT = jnp.concatenate([cache_valid_BxS, token_mask_BxT], axis=1)
      else:
        sources.append(KeySource(cache_k, cache_v, cache_valid_BxS, causal=False))
    sources.append(KeySource(k_BxKxTxH, v_BxKxTxH, token_mask_BxT, causal=True))
    out = attend(q_BxTxKxGxH, sources, impl=cfg.attention_impl, block_q=cfg.attention_block_q,
                 block_k=cfg.attention_block_k, dtype=cfg.compute_dtype)
    out_BxTxD = Linear(cfg.hidden_size, cfg, name="o_proj")(out.reshape(b, t, n * h))
    return out_BxTxD, new_cache


class MLP(nn.Module):
  config: ModelConfig

  @nn.compact
  def __call__(self, x_BxTxD):
    cfg = self.config
    gate = Linear(cfg.intermediate_size, cfg, name="gate_proj")(x_BxTxD)
    up = Linear(cfg.intermediate_size, cfg, name="up_proj")(x_BxTxD)
    return Linear(cfg.hidden_size, cfg, name="down_proj")(nn.silu(gate) * up)


class DecoderLayer(nn.Module):
  """Pre-norm block; scanned over layers: `kv_cache` is this layer's (k, v) cache slice, and the
  returned cache is this layer's (k, v) of the new chunk (written by `forward_with_cache`)."""

  config: ModelConfig
  prefix_cache: bool = False

  @nn.compact
  def __call__(self, x_BxTxD, sin, cos, token_mask_BxT, kv_cache, cache_valid_BxS):
    cfg = self.config
    x_BxTxD = mesh.constrain_rows(x_BxTxD)  # On a mesh: gather this layer's weights, not rows.
    norm = lambda name: RMSNorm(cfg.rms_norm_eps, cfg.compute_dtype, cfg.weight_dtype, name=name)
    layer_cache = None if kv_cache is None else (*kv_cache, cache_valid_BxS)
    attn_out, new_cache = Attention(cfg, self.prefix_cache, name="self_attn")(
        norm("input_layernorm")(x_BxTxD), sin, cos, token_mask_BxT, layer_cache)
    x_BxTxD = x_BxTxD + attn_out
    x_BxTxD = x_BxTxD + MLP(cfg, name="mlp")(norm("post_attention_layernorm")(x_BxTxD))
    return mesh.constrain_rows(x_BxTxD), new_cache


HEADS = ("logits", "last", "hidden")


class Transformer(nn.Module):
  """Token ids in, float32 logits out; layers are scanned so compile time does not grow with L.

  `head` picks the output: "logits" at every position [B,T,V], "last" for the last position only
  [B,1,V] (a left-padded prefill needs no more), or "hidden", the final-norm hidden states [B,T,D]
  for a caller that applies the LM head itself (in chunks, see `eppo_jax.logprobs`).

  With `prefix_cache`, `kv_cache` holds the keys and values of exactly the S positions before the
  chunk, in order (no unused slots): the update's shared prompt (`prefix_hidden_states`). The
  chunk then attends over one causal sequence of S + T keys, the case the blockwise kernel
  differentiates in O(S) memory. Either way a call with a cache returns the chunk's own (k, v).
  """

  config: ModelConfig
  prefix_cache: bool = False

  @nn.compact
  def __call__(self, tokens_BxT, positions_BxT, token_mask_BxT, kv_cache=None,
               cache_valid_BxS=None, head: str = "logits"):
    """`token_mask_BxT` marks valid tokens (attention is causal over them); with a cache,
    `kv_cache` = (k, v) [L,B,K,S,H] are the slots before the chunk and `cache_valid_BxS` the
    visible ones among them."""
    if head not in HEADS:
      raise ValueError(f"head must be one of {HEADS}, got {head!r}")
    cfg = self.config
    embed = nn.Embed(cfg.vocab_size, cfg.hidden_size, param_dtype=cfg.weight_dtype,
                     embedding_init=nn.initializers.normal(0.02), name="embed_tokens")
    x_BxTxD = embed(tokens_BxT).astype(cfg.compute_dtype)
    angles = positions_BxT[..., None].astype(jnp.float32) * rope_frequencies(cfg)
    angles_BxTxH = jnp.concatenate([angles, angles], axis=-1)
    sin, cos = (f(angles_BxTxH).astype(cfg.compute_dtype) for f in (jnp.sin, jnp.cos))

    per_layer = self.variables.get("params", {}).get("layers")
    if isinstance(per_layer, tuple):  # Split by `unstack_layers`: one tree per layer.
      # A Python loop over layers whose weights are separate buffers: each layer reads its weights
      # in place. Slicing the stacked [L, ...] weights (scan or unrolled) copies each layer's slice
      # at every call, which on CPU costs more than a decode step's matmuls.
      new_k, new_v = [], []
      for l, p in enumerate(per_layer):
        layer_cache = None if kv_cache is None else (kv_cache[0][l], kv_cache[1][l])
        x_BxTxD, c = DecoderLayer(cfg, self.prefix_cache).apply(
            {"params": p}, x_BxTxD, sin, cos, token_mask_BxT, layer_cache, cache_valid_BxS)
        if c is not None:
          new_k.append(c[0])
          new_v.append(c[1])
      new_cache = (jnp.stack(new_k), jnp.stack(new_v)) if new_k else None
    else:
      layer_cls = nn.remat(DecoderLayer, prevent_cse=False) if cfg.remat else DecoderLayer
      layers = nn.scan(layer_cls, variable_axes={"params": 0}, split_rngs={"params": True},
                       in_axes=(nn.broadcast, nn.broadcast, nn.broadcast, 0, nn.broadcast),
                       length=cfg.num_layers)
      x_BxTxD, new_cache = layers(cfg, self.prefix_cache, name="layers")(
          x_BxTxD, sin, cos, token_mask_BxT, kv_cache, cache_valid_BxS)

    x_BxTxD = RMSNorm(cfg.rms_norm_eps, cfg.compute_dtype, cfg.weight_dtype, name="norm")(x_BxTxD)
    if head == "hidden" and not self.is_initializing():
      return x_BxTxD, new_cache
    if head == "last":
      x_BxTxD = x_BxTxD[:, -1:]
    if cfg.tie_word_embeddings:
      logits = lm_head(x_BxTxD, embed.embedding.T, cfg)
    else:
      logits = nn.Dense(cfg.vocab_size, use_bias=False, dtype=cfg.compute_dtype,
                        param_dtype=cfg.weight_dtype, name="lm_head")(x_BxTxD)
    return logits.astype(jnp.float32), new_cache


def lm_head(x_BxTxD, kernel_DxV, config: ModelConfig) -> jax.Array:
  """float32 logits of hidden states through the head matrix, in the model's compute dtype."""
  dtype = config.compute_dtype
  return (x_BxTxD.astype(dtype) @ kernel_DxV.astype(dtype)).astype(jnp.float32)


def head_kernel(params: Params, config: ModelConfig) -> jax.Array:
  """The LM head matrix [D,V]: the embedding's transpose when tied (LoRA never adapts the head)."""
  p = params["params"]
  return p["embed_tokens"]["embedding"].T if config.tie_word_embeddings else p["lm_head"]["kernel"]


def init_params(config: ModelConfig, rng: jax.Array) -> Params:
  """Random parameters (plus LoRA leaves when `config.lora` is set), without materialising a batch."""
  tokens = jnp.zeros((1, 1), jnp.int32)
  return Transformer(config).init(rng, tokens, tokens, jnp.ones((1, 1), bool))


def unstack_layers(params: Params) -> Params:
  """The same params with the stacked [L, ...] layer weights split into a tuple of L trees.

  `Transformer` runs such params layer by layer in a Python loop. A decode loop splits once per
  call (one copy of the layer weights) so that its steps read every weight in place.
  """
  inner = dict(params["params"])
  stacked = inner["layers"]
  num_layers = jax.tree_util.tree_leaves(stacked)[0].shape[0]
  leaves, treedef = jax.tree_util.tree_flatten(stacked)
  # One split per leaf, not L index slices: differentiated, a split becomes one concatenation of
  # the L layer gradients, while each slice would pad its gradient to the whole [L, ...] leaf
  # before the sum (L^2 / 2 leaf-sized additions).
  pieces = [jnp.split(x, num_layers) for x in leaves]  # Per leaf: L arrays [1, ...].
  inner["layers"] = tuple(treedef.unflatten([p[l][0] for p in pieces]) for l in range(num_layers))
  return {**params, "params": inner}


def positions_from_mask(mask_BxT, start_B=None):
  """RoPE position of each token = number of valid tokens before it (pads repeat a neighbour's)."""
  pos = jnp.cumsum(mask_BxT.astype(jnp.int32), axis=1) - 1
  if start_B is not None:
    pos = pos + start_B[:, None]
  return jnp.maximum(pos, 0)


def unrolls_layers(config: ModelConfig) -> bool:
  """Whether calls run the layers unrolled over split weights (`ModelConfig.unroll_layers`)."""
  unroll = config.unroll_layers
  return unroll if unroll is not None else jax.default_backend() == "cpu"


def layer_params(params: Params, config: ModelConfig) -> Params:
  """`params` laid out for this config's calls: split per layer (`unstack_layers`) when layers are
  unrolled, else as they are. The split is a copy of the layer weights: a caller that runs several
  passes with the same params splits once and passes the result. Gradients flow back through it
  to the stacked weights."""
  if unrolls_layers(config) and not isinstance(params["params"]["layers"], tuple):
    return unstack_layers(params)
  return params


def logits(params: Params, config: ModelConfig, tokens_BxT, attention_mask_BxT,
           head: str = "logits") -> jax.Array:
  """Full causal forward without cache -> float32 logits [B,T,V]; works on left or right padding."""
  valid_BxT = attention_mask_BxT.astype(bool)
  params = layer_params(params, config)
  out, _ = Transformer(config).apply(params, tokens_BxT, positions_from_mask(valid_BxT), valid_BxT,
                                     head=head)
  return out


def hidden_states(params: Params, config: ModelConfig, tokens_BxT, attention_mask_BxT) -> jax.Array:
  """Like `logits` but stops before the LM head: final-norm hidden states [B,T,D] (compute dtype)."""
  return logits(params, config, tokens_BxT, attention_mask_BxT, head="hidden")


def prefix_hidden_states(params: Params, config: ModelConfig, tokens_BxT, attention_mask_BxT,
                         prefix: int, group: int) -> jax.Array:
  """`hidden_states(...)[:, prefix:]` ([B,T-prefix,D]), with the first `prefix` tokens run once
  per group of `group` consecutive rows: the caller guarantees that the rows of a group hold the
  same first `prefix` tokens and mask (a GRPO group's prompt). Their keys and values are computed
  on one row per group and repeated to the group's rows, so gradients through them sum over the
  group, as they do through G separate copies.
  """
  b, t = tokens_BxT.shape
  if not 0 < prefix < t or b % group:
    raise ValueError(f"prefix {prefix} of {t} tokens, {b} rows in groups of {group}")
  valid_BxT = attention_mask_BxT.astype(bool)
  positions_BxT = positions_from_mask(valid_BxT)
  model = Transformer(config, prefix_cache=True)
  params = layer_params(params, config)
  bg = b // group
  # Reshapes rather than strided slices: on a mesh whose devices hold whole groups of rows, taking
  # each group's first row and repeating it back stay local to each device.
  prompt = lambda x_BxT: x_BxT[:, :prefix].reshape((bg, group, prefix))[:, 0]  # [Bg,P], Bg = B/G
  valid_BgxP = prompt(valid_BxT)
  empty = jnp.zeros((config.num_layers, bg, config.num_kv_heads, 0, config.head_dim),
                    config.compute_dtype)
  _, (k_LxBgxKxPxH, v_LxBgxKxPxH) = model.apply(
      params, prompt(tokens_BxT), prompt(positions_BxT), valid_BgxP, (empty, empty),
      valid_BgxP[:, :0], head="hidden")

  def repeat(x, axis: int):  # [..., Bg, ...] -> [..., B, ...], each group's row G times.
    x = jnp.expand_dims(x, axis + 1)
    shape = x.shape[:axis + 1] + (group,) + x.shape[axis + 2:]
    return jnp.broadcast_to(x, shape).reshape(x.shape[:axis] + (b,) + x.shape[axis + 2:])

  hidden_BxTxD, _ = model.apply(
      params, tokens_BxT[:, prefix:], positions_BxT[:, prefix:], valid_BxT[:, prefix:],
      (repeat(k_LxBgxKxPxH, 1), repeat(v_LxBgxKxPxH, 1)), repeat(valid_BgxP, 0),
      head="hidden")
  return hidden_BxTxD


def init_cache(config: ModelConfig, batch: int, max_len: int, dtype=None) -> Cache:
  """Empty cache of `max_len` slots per sequence."""
  shape = (config.num_layers, batch, config.num_kv_heads, max_len, config.head_dim)
  dtype = dtype or config.compute_dtype
  return {
      "k": jnp.zeros(shape, dtype),
      "v": jnp.zeros(shape, dtype),
      "mask": jnp.zeros((batch, max_len), bool),
      "index": jnp.zeros((), jnp.int32),  # Next slot to write, shared by all rows.
      "pos": jnp.zeros((batch,), jnp.int32),  # Next RoPE position of each row.
  }


def split_cache(cache: Cache, window: int) -> Cache:
  """The first `window` slots of the cache, with k / v split into tuples of L layer arrays
  [B,K,window,H]: the decode loop's private view when layers are unrolled (`sampling.rollout_body`).
  Each step then reads each layer's keys in place, where taking layer l of the stacked [L, ...]
  cache copies it at every step. Everything outside that loop sees the stacked layout."""
  split = lambda c: tuple(x[0] for x in jnp.split(c[:, :, :, :window], c.shape[0]))
  return {**cache, "k": split(cache["k"]), "v": split(cache["v"]),
          "mask": cache["mask"][:, :window]}


def write_split_chunk(cache: Cache, chunk_kv) -> Cache:
  """Writes a chunk's keys and values (`forward_with_cache(..., defer_write=True)`) into a cache
  split by `split_cache`, layer by layer."""
  k_LxBxKxTxH, v_LxBxKxTxH, index = chunk_kv

  def put(c, x_LxBxKxTxH):
    return tuple(jax.lax.dynamic_update_slice(c_l, x_LxBxKxTxH[l], (0, 0, index, 0))
                 for l, c_l in enumerate(c))
  return {**cache, "k": put(cache["k"], k_LxBxKxTxH), "v": put(cache["v"], v_LxBxKxTxH)}


def merge_cache(cache: Cache, part: Cache) -> Cache:
  """`cache` with its first slots replaced by `part` (from `split_cache`, then written to)."""
  put = lambda c, p: jax.lax.dynamic_update_slice(c, jnp.stack(p), (0, 0, 0, 0, 0))
  return {**part, "k": put(cache["k"], part["k"]), "v": put(cache["v"], part["v"]),
          "mask": jax.lax.dynamic_update_slice(cache["mask"], part["mask"], (0, 0))}


def forward_with_cache(params: Params, config: ModelConfig, tokens_BxT, token_mask_BxT,
                       cache: Cache, window: Optional[int] = None, defer_write: bool = False,
                       head: str = "logits"):
  """Writes `T` new tokens at `cache["index"]` -> (float32 logits [B,T,V], cache).

  `head="last"` returns the last column's logits only ([B,1,V]), see `Transformer`.

  Rows may be left-padded inside the chunk (`token_mask_BxT` False on pads); pads are never attended.
  The chunk attends only to the first `window` slots of the cache (static; default all S): the
  caller guarantees `index + T <= window <= S` (checked statically where shapes allow), so a call
  pays for the slots in use rather than for the whole episode's cache.

  With `defer_write`, the chunk's keys and values are returned instead of written, as a third
  output for `write_split_chunk`; the cache's mask and index already count them. The unrolled
  decode loop writes them at the start of its next step: a write in the same step as the layers'
  reads of the cache is not ordered after the last layer's read, and XLA then copies the whole
  cache at every step.
  """
  t, s = tokens_BxT.shape[1], cache["mask"].shape[1]
  window = s if window is None else window
  if not t <= window <= s:
    raise ValueError(f"chunk of {t} tokens and window {window} do not fit a cache of {s} slots")
  index = cache["index"]
  valid_BxT = token_mask_BxT.astype(bool)
  positions_BxT = positions_from_mask(valid_BxT, cache["pos"])
  # Slots before the chunk; the chunk's own keys come straight from this call's projections.
  old_valid_BxP = cache["mask"][:, :window] & (jnp.arange(window) < index)[None]
  # A split cache (`split_cache`, always cut to its window) is passed whole.
  used = lambda c: c if window == s else c[:, :, :, :window]
  out, (k_LxBxKxTxH, v_LxBxKxTxH) = Transformer(config).apply(
      params, tokens_BxT, positions_BxT, valid_BxT, (used(cache["k"]), used(cache["v"])),
      old_valid_BxP, head=head)
  new_cache = {
      **cache,
      "mask": jax.lax.dynamic_update_slice(cache["mask"], valid_BxT, (0, index)),
      "index": index + t,
      "pos": cache["pos"] + valid_BxT.sum(axis=1, dtype=jnp.int32),
  }
  if defer_write:
    return out, new_cache, (k_LxBxKxTxH, v_LxBxKxTxH, index)
  put = lambda c, x_LxBxKxTxH: jax.lax.dynamic_update_slice(c, x_LxBxKxTxH, (0, 0, 0, index, 0))
  return out, {**new_cache, "k": put(cache["k"], k_LxBxKxTxH), "v": put(cache["v"], v_LxBxKxTxH)}
