"""`ModelConfig.forward_flops_per_token` (the MFU numerator in bench/accelerator.py) vs. XLA.

XLA's HLO cost analysis counts a `while` body once, so the models here have one layer: the scanned
layer stack is then counted exactly.
"""

import jax
import jax.numpy as jnp
import pytest

import eppo_jax
from eppo_jax.models import transformer

CONFIGS = {
    "llama_tied": dict(tie_word_embeddings=True),
    "gqa_untied": dict(num_kv_heads=1),
    "qwen2_bias": dict(attention_bias=True, num_kv_heads=2),
    "qwen3_head_dim": dict(qk_norm=True, head_dim=48),
}


def _xla_flops(fn, *args) -> float:
  cost = jax.jit(fn).lower(*args).cost_analysis()
  return (cost[0] if isinstance(cost, list) else cost)["flops"]


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("seq_len", [16, 96])
def test_forward_and_backward_flops_match_xla(name, seq_len):
  cfg = eppo_jax.ModelConfig(**{**dict(vocab_size=512, hidden_size=128, intermediate_size=384,
                                       num_layers=1, num_heads=4, num_kv_heads=4, head_dim=32),
                                **CONFIGS[name]})
  params = eppo_jax.init_params(cfg, jax.random.PRNGKey(0))
  tokens = jnp.zeros((2, seq_len), jnp.int32)
  ours = cfg.forward_flops_per_token(seq_len) * tokens.size

  forward = lambda p: transformer.logits(p, cfg, tokens, jnp.ones_like(tokens))
  # Matmuls dominate; norms, RoPE, softmax and the rest add a few percent on top.
  assert 1.0 <= _xla_flops(forward, params) / ours < 1.03

  loss = lambda p: jnp.sum(forward(p) ** 2)
  backward = _xla_flops(jax.grad(loss), params) - _xla_flops(loss, params)
  assert 2.0 <= backward / ours < 2.05  # Twice the forward: input and weight grads.
