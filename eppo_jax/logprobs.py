"""Log-prob and entropy of the policy softmax(logits / temperature): one formula for everyone.

The sampler (`sampling.sample_token`), the update (`steps`) and pacing (`pacing.token_entropy`) all
call `token_logprobs_and_entropy`, so sampled and re-scored numbers are of one distribution by
construction. The update never holds float32 logits over the whole vocabulary at every position:
`head_logprobs_and_entropy` runs the LM head on final hidden states in chunks of positions (and of
the vocabulary, with an online logsumexp, where the vocabulary is large), each chunk recomputed in
the backward pass, so its memory does not grow with positions x vocabulary.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from eppo_jax.models.config import ModelConfig
from eppo_jax.models.transformer import lm_head

# Positions per chunk of the LM head and vocabulary columns per chunk: a chunk's float32 logits are
# POSITION_CHUNK x VOCAB_CHUNK x 4 bytes (128 MiB), whatever the batch, episode length or vocabulary.
POSITION_CHUNK = 1024
VOCAB_CHUNK = 32768


def token_logprobs_and_entropy(logits_BxTxV, tokens_BxT, temperature: float = 1.0):
  """(log pi(token) [B,T], entropy [B,T]) of softmax(logits / temperature), in float32."""
  # bf16 logits are upcast first: the entropy is a difference of two large numbers.
  z_BxTxV = logits_BxTxV.astype(jnp.float32) / temperature
  lse_BxT = jax.nn.logsumexp(z_BxTxV, axis=-1)
  z_tok_BxT = jnp.take_along_axis(z_BxTxV, tokens_BxT[..., None].astype(jnp.int32), axis=-1)[..., 0]
  # H = logsumexp(z) - sum(softmax(z) z) never takes log(p): a probability that underflows to 0
  # contributes 0 * z = 0 instead of 0 * -inf = NaN.
  probs_BxTxV = jnp.exp(z_BxTxV - lse_BxT[..., None])
  entropy_BxT = lse_BxT - jnp.sum(probs_BxTxV * z_BxTxV, axis=-1)
  return z_tok_BxT - lse_BxT, entropy_BxT


def _online_vocab(h_CxD, kernel_DxV, tokens_C, temperature: float, config: ModelConfig,
                  vocab_chunk: int):
  """`token_logprobs_and_entropy` of lm_head(h) over vocabulary chunks: ([C], [C]) float32.

  Carries per position the running max m, s = sum exp(z - m), w = sum exp(z - m) z and the target's
  z, rescaled when m grows; then logsumexp = m + log s and entropy = logsumexp - w / s.
  """
  v = kernel_DxV.shape[1]
  c = h_CxD.shape[0]
  num = -(-v // vocab_chunk)

  def body(carry, i):
    m_C, s_C, w_C, ztok_C = carry
    # The last chunk is shifted left to stay inside the matrix (no padded copy of the head); the
    # columns it shares with the previous chunk are masked out.
    start = jnp.minimum(i * vocab_chunk, v - vocab_chunk)
    cols_W = start + jnp.arange(vocab_chunk)
    valid_W = cols_W >= i * vocab_chunk
    w_DxW = lax.dynamic_slice_in_dim(kernel_DxV, start, vocab_chunk, axis=1)
    z_CxW = lm_head(h_CxD, w_DxW, config) / temperature
    z_CxW = jnp.where(valid_W[None], z_CxW, -jnp.inf)
    # The result does not depend on m, so its gradient is not taken through the max.
    m_new_C = lax.stop_gradient(jnp.maximum(m_C, jnp.max(z_CxW, axis=-1)))
    scale_C = jnp.exp(m_C - m_new_C)
    p_CxW = jnp.exp(z_CxW - m_new_C[:, None])
    s_C = s_C * scale_C + jnp.sum(p_CxW, axis=-1)
    w_C = w_C * scale_C + jnp.sum(p_CxW * jnp.where(valid_W[None], z_CxW, 0.0), axis=-1)
    hit_CxW = (cols_W[None] == tokens_C[:, None]) & valid_W[None]
    ztok_C = ztok_C + jnp.sum(jnp.where(hit_CxW, z_CxW, 0.0), axis=-1)
    return (m_new_C, s_C, w_C, ztok_C), None

  zeros_C = jnp.zeros((c,), jnp.float32)
  init = (jnp.full((c,), -jnp.inf, jnp.float32), zeros_C, zeros_C, zeros_C)
  (m_C, s_C, w_C, ztok_C), _ = lax.scan(jax.checkpoint(body, prevent_cse=False), init,
                                        jnp.arange(num))
  lse_C = m_C + jnp.log(s_C)
  return ztok_C - lse_C, lse_C - w_C / s_C


def head_logprobs_and_entropy(hidden_BxRxD, kernel_DxV, tokens_BxR, temperature: float,
                              config: ModelConfig, *, position_chunk: int = POSITION_CHUNK,
                              vocab_chunk: int = VOCAB_CHUNK):
  """(log pi(token) [B,R], entropy [B,R]) float32 of softmax(lm_head(hidden) / temperature).

  Equal to `token_logprobs_and_entropy(lm_head(hidden, kernel), tokens, temperature)`, but the
  logits only ever exist for one chunk of positions (and vocabulary) at a time, forward and
  backward: each chunk is under `jax.checkpoint`, so the backward pass recomputes it.
  """
  b, r, d = hidden_BxRxD.shape
  v = kernel_DxV.shape[1]
  n = b * r
  chunk = min(position_chunk, n)
  num = -(-n // chunk)
  h_NxD = hidden_BxRxD.reshape(n, d)
  tok_N = tokens_BxR.reshape(n).astype(jnp.int32)
  if num * chunk != n:  # Pad to whole chunks; the padded rows are dropped below.
    h_NxD = jnp.pad(h_NxD, ((0, num * chunk - n), (0, 0)))
    tok_N = jnp.pad(tok_N, (0, num * chunk - n))

  if v > vocab_chunk:
    def score(h_CxD, tokens_C):
      return _online_vocab(h_CxD, kernel_DxV, tokens_C, temperature, config, vocab_chunk)
  else:
    def score(h_CxD, tokens_C):
      logits_CxV = lm_head(h_CxD, kernel_DxV, config)
      return token_logprobs_and_entropy(logits_CxV, tokens_C, temperature)

  score = jax.checkpoint(score, prevent_cse=False)
  logp, ent = lax.map(lambda xs: score(*xs),
                      (h_NxD.reshape(num, chunk, d), tok_N.reshape(num, chunk)))
  return logp.reshape(-1)[:n].reshape(b, r), ent.reshape(-1)[:n].reshape(b, r)
