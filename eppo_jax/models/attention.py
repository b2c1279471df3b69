"""Attention kernels: a dense reference, a blockwise online-softmax kernel, JAX's fused one, and
Pallas' splash attention (the TPU kernel).

Shape letters: B batch, T queries, S keys, K key/value heads, G query heads per key/value head
(grouped-query attention), H head dim.

Keys come in *sources*, each a `KeySource(k_BxKxSxH, v_BxKxSxH, valid_BxS, causal)`: the cache
slots written before a chunk (`causal=False`: every valid slot is visible) and the chunk itself
(`causal=True`: the T queries are the source's last T positions, so key j is visible to query t
when j <= t + S - T; S = T for a chunk alone, S > T for a chunk behind the keys of its prefix). One
softmax runs over all sources, so a chunk attends to the cache and to itself without concatenating
the two.

The blockwise kernel walks query blocks x key blocks with a running max and sum in float32, and
skips key blocks above the causal diagonal and blocks without a valid key (the unused tail of a
cache). No `[B, heads, T, S]` array exists: its temporaries scale with one block pair. The case
of one causal source (a sequence, or a chunk behind its prefix) has a custom VJP of the same
structure (the flash-attention backward, recomputing each block's probabilities from the saved
log-sum-exp), so training memory does not grow with T x S either.

A fully masked query row (a pad) gets a uniform average of the values it visited, never NaN; its
output differs between implementations and is never read by a valid position.

`resolve("auto", platform, dtype)` names the kernel for a chip: splash on TPUs, cuDNN's fused
kernel on NVIDIA GPUs in half precision, blockwise elsewhere.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp

MASK_VALUE = -1e30  # Finite, so a fully masked (padding) query row gives a uniform, not NaN, row.
IMPLEMENTATIONS = ("blockwise", "dense", "xla", "cudnn", "splash")
SPLASH_BLOCK = 128  # The TPU kernel's tiles are multiples of 128 positions.


def resolve(impl: str, platform: str, dtype) -> str:
  """The kernel `impl` names on a chip of `platform` ("cpu", "gpu", "tpu") computing in `dtype`:
  "auto" is splash on TPUs, cuDNN on GPUs in half precision (its fused kernel has no float32
  path), blockwise elsewhere; any other name is kept."""
  if impl != "auto":
    return impl
  if platform == "tpu":
    return "splash"
  if platform == "gpu" and jnp.dtype(dtype).itemsize == 2:
    return "cudnn"
  return "blockwise"


class KeySource(NamedTuple):
  k_BxKxSxH: jax.Array
  v_BxKxSxH: jax.Array
  valid_BxS: jax.Array  # bool
  causal: bool  # Key j visible to query t only when j <= t + S - T (the queries' own keys).


def _offset(src: KeySource, t: int) -> int:
  """Key index of query 0 in a causal source of S keys whose last T positions are the queries."""
  return src.k_BxKxSxH.shape[2] - t if src.causal else 0


def _visible(valid_BxS, causal: bool, q_start, k_start, tq: int, sk: int):
  """[B,tq,sk] bool: which keys of a block each query of a block may attend to; `q_start` is the
  first query's key index (its index in the block sequence plus the source's `_offset`)."""
  visible_BxTxS = jnp.broadcast_to(valid_BxS[:, None, :], (valid_BxS.shape[0], tq, sk))
  if causal:
    q_T = q_start + jnp.arange(tq)
    k_S = k_start + jnp.arange(sk)
    visible_BxTxS = visible_BxTxS & (k_S[None, :] <= q_T[:, None])[None]
  return visible_BxTxS


def _scores(q_BxKxGxTxH, k_BxKxSxH, visible_BxTxS, scale):
  s = jnp.einsum("bkgth,bksh->bkgts", q_BxKxGxTxH, k_BxKxSxH.astype(q_BxKxGxTxH.dtype),
                 preferred_element_type=jnp.float32) * scale
  return jnp.where(visible_BxTxS[:, None, None], s, MASK_VALUE)


def _attend_sources(q, sources, visible, dtype, scores_spec: str, out_spec: str):
  """One softmax over all sources' scores, then the probability-weighted values.

  `q` is laid out for the einsum specs; `visible` holds one mask per source, [B,...,S], that
  broadcasts over the K and G axes of the scores.
  """
  scale = 1 / math.sqrt(q.shape[-1])
  scores = [jnp.where(vis[:, None, None],
                      jnp.einsum(scores_spec, q, src.k_BxKxSxH.astype(q.dtype),
                                 preferred_element_type=jnp.float32) * scale, MASK_VALUE)
            for src, vis in zip(sources, visible)]
  probs = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1).astype(dtype)
  out, start = 0, 0
  for src in sources:
    s = src.k_BxKxSxH.shape[2]
    out = out + jnp.einsum(out_spec, probs[..., start:start + s], src.v_BxKxSxH.astype(dtype))
    start += s
  return out


def dense_attention(q_BxTxKxGxH, sources, dtype):
  """Reference: all scores at once, one softmax over the concatenated sources -> [B,T,K,G,H]."""
  t = q_BxTxKxGxH.shape[1]
  visible = [_visible(src.valid_BxS, src.causal, _offset(src, t), 0, t, src.k_BxKxSxH.shape[2])
             for src in sources]  # [B,T,S] each.
  return _attend_sources(q_BxTxKxGxH.transpose(0, 2, 3, 1, 4), sources, visible, dtype,
                         "bkgth,bksh->bkgts", "bkgts,bksh->btkgh")


def single_query_attention(q_Bx1xKxGxH, sources, dtype):
  """`dense_attention` for one query per row (a decode step) -> [B,1,K,G,H].

  The same products without the length-1 query axis: XLA:CPU runs the dense path's
  [B,K,G,1,S] scores and its transposed [B,1,K,G,H] output as slower batched calls (a decode
  step's attention over 256 cache slots, batch 16: 1.4 ms dense vs 0.6 ms here with the tiny
  model's 2 x 2 heads; equal with 12 x 1). A multiply-and-reduce form was 40x slower with one
  query head per key head.
  """
  visible = [_visible(src.valid_BxS, src.causal, _offset(src, 1), 0, 1,
                      src.k_BxKxSxH.shape[2])[:, 0] for src in sources]  # [B,S] each.
  out_BxKxGxH = _attend_sources(q_Bx1xKxGxH[:, 0], sources, visible, dtype, "bkgh,bksh->bkgs",
                                "bkgs,bksh->bkgh")
  return out_BxKxGxH[:, None]


# ----------------------------------------------------------------------------------------------
# Blockwise kernel.


def _pad_to(x, axis: int, multiple: int, value=0):
  size = x.shape[axis]
  extra = -size % multiple
  if not extra:
    return x
  widths = [(0, 0)] * x.ndim
  widths[axis] = (0, extra)
  return jnp.pad(x, widths, constant_values=value)


def _padded_source(src: KeySource, block_k: int) -> KeySource:
  """Keys padded to a whole number of blocks; the padding keys are invalid."""
  return KeySource(_pad_to(src.k_BxKxSxH, 2, block_k), _pad_to(src.v_BxKxSxH, 2, block_k),
                   _pad_to(src.valid_BxS, 1, block_k, False), src.causal)


def _key_block(src: KeySource, j, block_k: int):
  """(k, v, valid) of key block j."""
  take = lambda x, axis: jax.lax.dynamic_slice_in_dim(x, j * block_k, block_k, axis)
  return take(src.k_BxKxSxH, 2), take(src.v_BxKxSxH, 2), take(src.valid_BxS, 1)


def _block_needed(src: KeySource, valid_BxS, q_start, k_start, block_q: int):
  """Whether a key block can hold a key visible to the query block (else it is skipped)."""
  needed = jnp.any(valid_BxS)
  if src.causal:
    needed = needed & (k_start <= q_start + block_q - 1)
  return needed


def _forward_query_block(q_BxKxGxTxH, sources, offsets, q_start, block_k: int, dtype):
  """Online softmax of one query block over every key block -> (out f32, log-sum-exp f32).

  `offsets[i]` is `_offset` of source i before padding.
  """
  b, kh, g, tq, h = q_BxKxGxTxH.shape
  scale = 1 / math.sqrt(h)
  carry = (jnp.full((b, kh, g, tq), MASK_VALUE, jnp.float32),  # running max
           jnp.zeros((b, kh, g, tq), jnp.float32),  # running sum of exp(score - max)
           jnp.zeros((b, kh, g, tq, h), jnp.float32))  # running sum of exp(score - max) * v

  for src, offset in zip(sources, offsets):
    def step(carry, j, src=src, q_start=q_start + offset):
      k_blk, v_blk, valid_blk = _key_block(src, j, block_k)
      k_start = j * block_k

      def update(carry):
        m, l, acc = carry
        visible = _visible(valid_blk, src.causal, q_start, k_start, tq, block_k)
        s = _scores(q_BxKxGxTxH, k_blk, visible, scale)
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[..., None])
        correction = jnp.exp(m - m_new)
        l = l * correction + p.sum(axis=-1)
        pv = jnp.einsum("bkgts,bksh->bkgth", p.astype(dtype), v_blk.astype(dtype),
                        preferred_element_type=jnp.float32)
        return m_new, l, acc * correction[..., None] + pv

      needed = _block_needed(src, valid_blk, q_start, k_start, tq)
      return jax.lax.cond(needed, update, lambda c: c, carry), None

    carry, _ = jax.lax.scan(step, carry, jnp.arange(src.k_BxKxSxH.shape[2] // block_k))
  m, l, acc = carry
  return acc / l[..., None], m + jnp.log(l)


def _blockwise_forward(q_BxTxKxGxH, sources, block_q: int, block_k: int, dtype):
  """-> (out [B,T,K,G,H] in `dtype`, log-sum-exp [B,K,G,T] f32); pads T and S to whole blocks."""
  t = q_BxTxKxGxH.shape[1]
  q_BxKxGxTxH = _pad_to(q_BxTxKxGxH, 1, block_q).transpose(0, 2, 3, 1, 4)
  offsets = [_offset(src, t) for src in sources]
  sources = [_padded_source(src, block_k) for src in sources]

  def query_block(_, i):
    q_blk = jax.lax.dynamic_slice_in_dim(q_BxKxGxTxH, i * block_q, block_q, 3)
    out, lse = _forward_query_block(q_blk, sources, offsets, i * block_q, block_k, dtype)
    return None, (out.astype(dtype), lse)

  _, (out_QxBxKxGxTxH, lse_QxBxKxGxT) = jax.lax.scan(
      query_block, None, jnp.arange(q_BxKxGxTxH.shape[3] // block_q))
  nq, b, kh, g, tq, h = out_QxBxKxGxTxH.shape
  out_BxTxKxGxH = out_QxBxKxGxTxH.transpose(1, 0, 4, 2, 3, 5).reshape(b, nq * tq, kh, g, h)[:, :t]
  lse_BxKxGxT = lse_QxBxKxGxT.transpose(1, 2, 3, 0, 4).reshape(b, kh, g, nq * tq)[..., :t]
  return out_BxTxKxGxH, lse_BxKxGxT


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _causal_blockwise(q_BxTxKxGxH, k_BxKxSxH, v_BxKxSxH, valid_BxS, block_q, block_k, dtype):
  """Attention over one causal source (a sequence, or a chunk behind its prefix's keys),
  differentiable in O(S) memory."""
  return _blockwise_forward(q_BxTxKxGxH, [KeySource(k_BxKxSxH, v_BxKxSxH, valid_BxS, True)],
                            block_q, block_k, dtype)[0]


def _causal_blockwise_fwd(q, k, v, valid, block_q, block_k, dtype):
  out, lse = _blockwise_forward(q, [KeySource(k, v, valid, True)], block_q, block_k, dtype)
  return out, (q, k, v, valid, out, lse)


def _causal_blockwise_bwd(block_q, block_k, dtype, residuals, dout_BxTxKxGxH):
  """Flash-attention backward: per block pair, probabilities from the saved log-sum-exp."""
  q, k, v, valid, out, lse = residuals
  t, h = q.shape[1], q.shape[-1]
  offset = _offset(KeySource(k, v, valid, True), t)
  scale = 1 / math.sqrt(h)
  # D_t = sum_h dO * O, the softmax Jacobian's correction term.
  delta_BxKxGxT = jnp.einsum("btkgh,btkgh->bkgt", dout_BxTxKxGxH.astype(jnp.float32),
                             out.astype(jnp.float32))
  pad_q = lambda x, axis: _pad_to(x, axis, block_q)
  q_BxKxGxTxH = pad_q(q, 1).transpose(0, 2, 3, 1, 4)
  do_BxKxGxTxH = pad_q(dout_BxTxKxGxH, 1).transpose(0, 2, 3, 1, 4)
  lse_BxKxGxT, delta_BxKxGxT = pad_q(lse, 3), pad_q(delta_BxKxGxT, 3)
  src = _padded_source(KeySource(k, v, valid, True), block_k)
  s_pad = src.k_BxKxSxH.shape[2]

  def query_block(carry, i):
    sl = lambda x: jax.lax.dynamic_slice_in_dim(x, i * block_q, block_q, 3)
    q_start = i * block_q + offset  # Key index of the block's first query.
    q_blk, do_blk, lse_blk, delta_blk = sl(q_BxKxGxTxH), sl(do_BxKxGxTxH), sl(lse_BxKxGxT), sl(
        delta_BxKxGxT)

    def key_block(carry, j):
      k_start = j * block_k
      k_blk, v_blk, valid_blk = _key_block(src, j, block_k)

      def update(carry):
        dq, dk, dv = carry
        visible = _visible(valid_blk, True, q_start, k_start, block_q, block_k)
        p = jnp.exp(_scores(q_blk, k_blk, visible, scale) - lse_blk[..., None])
        dv_blk = jnp.einsum("bkgts,bkgth->bksh", p.astype(dtype), do_blk.astype(dtype),
                            preferred_element_type=jnp.float32)
        dp = jnp.einsum("bkgth,bksh->bkgts", do_blk.astype(dtype), v_blk.astype(dtype),
                        preferred_element_type=jnp.float32)
        ds = (p * (dp - delta_blk[..., None]) * scale).astype(dtype)
        dq = dq + jnp.einsum("bkgts,bksh->bkgth", ds, k_blk.astype(dtype),
                             preferred_element_type=jnp.float32)
        dk_blk = jnp.einsum("bkgts,bkgth->bksh", ds, q_blk.astype(dtype),
                            preferred_element_type=jnp.float32)
        add = lambda acc, blk: jax.lax.dynamic_update_slice_in_dim(
            acc, jax.lax.dynamic_slice_in_dim(acc, k_start, block_k, 2) + blk, k_start, 2)
        return dq, add(dk, dk_blk), add(dv, dv_blk)

      needed = _block_needed(src, valid_blk, q_start, k_start, block_q)
      return jax.lax.cond(needed, update, lambda c: c, carry), None

    dq0 = jnp.zeros(q_blk.shape, jnp.float32)
    (dq, dk, dv), _ = jax.lax.scan(key_block, (dq0,) + carry, jnp.arange(s_pad // block_k))
    return (dk, dv), dq

  zeros_kv = jnp.zeros(src.k_BxKxSxH.shape, jnp.float32)
  (dk, dv), dq_QxBxKxGxTxH = jax.lax.scan(query_block, (zeros_kv, zeros_kv),
                                          jnp.arange(q_BxKxGxTxH.shape[3] // block_q))
  nq, b, kh, g, tq, _ = dq_QxBxKxGxTxH.shape
  dq = dq_QxBxKxGxTxH.transpose(1, 0, 4, 2, 3, 5).reshape(b, nq * tq, kh, g, h)[:, :t]
  s = k.shape[2]
  return (dq.astype(q.dtype), dk[:, :, :s].astype(k.dtype), dv[:, :, :s].astype(v.dtype), None)


_causal_blockwise.defvjp(_causal_blockwise_fwd, _causal_blockwise_bwd)


# ----------------------------------------------------------------------------------------------


def _balanced_block(block: int, length: int) -> int:
  """The block size for `length` positions: as many blocks as `block` needs, evened out and rounded
  up to a multiple of 8, so the padding is under 8 per block (72 positions with blocks of 64: two
  of 40, not two of 64)."""
  count = -(-length // block)
  return min(block, -(-length // (count * 8)) * 8)


def attend(q_BxTxKxGxH, sources, *, impl: str, block_q: int, block_k: int, dtype):
  """Attention of T queries over the key sources -> [B,T,K,G,H] in `dtype`.

  `impl` "blockwise" falls back to the dense path, statically, when the T x S scores are no more
  than one block pair's (short sequences, decode chunks), and a single query (a decode step)
  takes `single_query_attention` under every `impl` but the "dense" reference. "xla" / "cudnn"
  call `jax.nn.dot_product_attention` for the uncached causal case (one causal source, T == S)
  and use the blockwise kernel otherwise; "splash" runs Pallas' kernel for any one causal source
  (a sequence, or a chunk behind its prefix: the update) and the blockwise kernel otherwise. One
  causal source takes the kernel's custom VJP (training memory O(S)); several sources are
  differentiated through the forward kernel.
  """
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"attention_impl must be one of {IMPLEMENTATIONS}, got {impl!r}")
  t = q_BxTxKxGxH.shape[1]
  one_causal = len(sources) == 1 and sources[0].causal
  self_attention = one_causal and sources[0].k_BxKxSxH.shape[2] == t
  if impl in ("xla", "cudnn") and self_attention:
    return _fused(q_BxTxKxGxH, sources[0], impl, dtype)
  if impl == "splash" and one_causal and t > 1:
    return _splash(q_BxTxKxGxH, sources[0], block_q, block_k, dtype)
  if t == 1 and impl != "dense":
    return single_query_attention(q_BxTxKxGxH, sources, dtype)
  # Scores no larger than one block pair's: the dense path needs no more memory than the kernel,
  # and decode steps (a few queries over a long cache) avoid the kernel's loop over key blocks,
  # which is many times slower there.
  small = t * sum(src.k_BxKxSxH.shape[2] for src in sources) <= block_q * block_k
  if impl == "dense" or small:
    return dense_attention(q_BxTxKxGxH, sources, dtype)
  block_q = _balanced_block(block_q, t)
  if one_causal:
    block_k = _balanced_block(block_k, sources[0].k_BxKxSxH.shape[2])
    src = sources[0]
    return _causal_blockwise(q_BxTxKxGxH, src.k_BxKxSxH, src.v_BxKxSxH, src.valid_BxS, block_q,
                             block_k, jnp.dtype(dtype))
  return _blockwise_forward(q_BxTxKxGxH, sources, block_q, block_k, dtype)[0]


def _fused(q_BxTxKxGxH, src: KeySource, impl: str, dtype):
  """`jax.nn.dot_product_attention` (causal, pad keys masked); pad query rows are zeroed."""
  b, t, kh, g, h = q_BxTxKxGxH.shape
  to_bskh = lambda x: x.transpose(0, 2, 1, 3).astype(dtype)
  out = jax.nn.dot_product_attention(
      q_BxTxKxGxH.reshape(b, t, kh * g, h).astype(dtype), to_bskh(src.k_BxKxSxH),
      to_bskh(src.v_BxKxSxH), mask=src.valid_BxS[:, None, None, :], is_causal=True,
      implementation=impl)
  # A query whose every key is masked has no defined output (a fused kernel may give NaN).
  out = jnp.where(src.valid_BxS[:, :, None, None], out, 0)
  return out.reshape(b, t, kh, g, h)


def _round_up(x: int, multiple: int) -> int:
  return -(-x // multiple) * multiple


def _splash_kernel(heads: int, tq: int, sk: int, offset: int, bq: int, bk: int, interpret: bool):
  """Pallas' splash kernel for `heads` query heads of `tq` queries over `sk` keys, query i seeing
  keys <= i + offset, as (q [N,Tq,H], k, v [K,Sk,H], q_seg [Tq], kv_seg [Sk]) -> [N,Tq,H]. Its
  mask tables become constants of the program being traced (not kept across traces: they would
  be that trace's values)."""
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk_lib
  # pylint: disable-next=g-import-not-at-top
  from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as mask_lib
  mask = mask_lib.MultiHeadMask([mask_lib.CausalMask((tq, sk), offset=offset)] * heads)
  blocks = sk_lib.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq,
                             block_kv_dkv=bk, block_kv_dkv_compute=bk, block_q_dq=bq,
                             block_kv_dq=bk)
  kernel = sk_lib.make_splash_mha(mask, block_sizes=blocks, head_shards=1, q_seq_shards=1,
                                  interpret=interpret)
  return lambda q, k, v, q_seg, kv_seg: kernel(q, k, v, sk_lib.SegmentIds(q=q_seg, kv=kv_seg))


def _on_tpu() -> bool:
  """Whether the program being traced runs on TPUs: the platform of the mesh in context (an AOT
  compilation for a TPU topology from a CPU host), else the default backend's."""
  device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
  platform = getattr(device, "platform", None) or jax.default_backend()
  return platform == "tpu"


def _splash(q_BxTxKxGxH, src: KeySource, block_q: int, block_k: int, dtype):
  """Pallas' splash attention (flash attention with a block-sparse causal mask: the blocks above
  the diagonal are never loaded) for one causal source, vmapped over rows and, under a mesh, run
  per shard (rows over data x fsdp, key/value heads over tensor when they divide). Pad keys are
  masked by segment ids (a valid query sees valid keys; a pad query sees pad keys, at least its
  own, so no row is empty); pad query rows are zeroed. Off TPUs it runs in Pallas' interpreter
  (the tests' reference check on CPU)."""
  b, t, kh, g, h = q_BxTxKxGxH.shape
  s = src.k_BxKxSxH.shape[2]
  # Tiles of 128-multiples; queries padded at the end, keys by as many again and to a tile, so
  # that a pad query's own (pad) key lies inside the padded keys.
  bq = min(_round_up(block_q, SPLASH_BLOCK), _round_up(t, SPLASH_BLOCK))
  tp = _round_up(t, bq)
  bk = min(_round_up(block_k, SPLASH_BLOCK), _round_up(s + tp - t, SPLASH_BLOCK))
  sp = _round_up(s + tp - t, bk)
  q_valid_BxT = src.valid_BxS[:, s - t:]
  scale = 1.0 / math.sqrt(h)
  # [B,N,Tp,H] with head n = k * G + g: the kernel's key head for query head n is n // G.
  q_BxNxTxH = (q_BxTxKxGxH.astype(jnp.float32) * scale).astype(dtype).reshape(b, t, kh * g, h)
  q_BxNxTxH = jnp.pad(q_BxNxTxH.transpose(0, 2, 1, 3), ((0, 0), (0, 0), (0, tp - t), (0, 0)))
  pad_keys = lambda x: jnp.pad(x.astype(dtype), ((0, 0), (0, 0), (0, sp - s), (0, 0)))
  k_BxKxSxH, v_BxKxSxH = pad_keys(src.k_BxKxSxH), pad_keys(src.v_BxKxSxH)
  q_seg_BxT = jnp.pad(q_valid_BxT.astype(jnp.int32), ((0, 0), (0, tp - t)))
  kv_seg_BxS = jnp.pad(src.valid_BxS.astype(jnp.int32), ((0, 0), (0, sp - s)))
  interpret = not _on_tpu()

  def run(q_BxNxTxH, k_BxKxSxH, v_BxKxSxH, q_seg_BxT, kv_seg_BxS):
    kernel = _splash_kernel(q_BxNxTxH.shape[1], tp, sp, s - t, bq, bk, interpret)
    return jax.vmap(kernel)(q_BxNxTxH, k_BxKxSxH, v_BxKxSxH, q_seg_BxT, kv_seg_BxS)

  mesh = jax.sharding.get_abstract_mesh()
  if not mesh.empty and {"data", "fsdp", "tensor"} <= set(mesh.axis_names):
    rows = ("data", "fsdp") if b % (mesh.shape["data"] * mesh.shape["fsdp"]) == 0 else None
    heads = "tensor" if kh % mesh.shape["tensor"] == 0 else None
    P = jax.sharding.PartitionSpec
    run = jax.shard_map(run, in_specs=(P(rows, heads), P(rows, heads), P(rows, heads), P(rows),
                                       P(rows)),
                        out_specs=P(rows, heads), check_vma=False)
  out_BxNxTxH = run(q_BxNxTxH, k_BxKxSxH, v_BxKxSxH, q_seg_BxT, kv_seg_BxS)
  out = out_BxNxTxH[:, :, :t].transpose(0, 2, 1, 3).reshape(b, t, kh, g, h)
  return jnp.where(q_valid_BxT[:, :, None, None, None], out, 0).astype(dtype)
