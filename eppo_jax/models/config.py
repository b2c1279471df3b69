"""Static model description: a frozen, hashable dataclass usable as a jit static argument."""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
  """Low-rank adapters on the named projections; the update is `x @ A @ B * alpha / rank`."""

  rank: int = 8
  alpha: float = 16.0
  targets: tuple[str, ...] = LORA_TARGETS

  def __post_init__(self):
    if self.rank <= 0:
      raise ValueError(f"LoraConfig.rank must be positive, got {self.rank}")
    unknown = set(self.targets) - set(LORA_TARGETS)
    if unknown:
      raise ValueError(f"LoraConfig.targets has unknown projections {sorted(unknown)}; "
                       f"choose from {LORA_TARGETS}")

  @property
  def scale(self) -> float:
    return self.alpha / self.rank


# Attention kernels (`models/attention.py`); "blockwise" runs on every backend.
ATTENTION_IMPLS = ("blockwise", "dense", "xla", "cudnn", "splash")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Decoder hyper-parameters shared by Llama 3.x, Qwen2/2.5 and Qwen3."""

  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int
  rms_norm_eps: float = 1e-6
  rope_theta: float = 10000.0
  # Sorted (key, value) pairs of HF's `rope_scaling` dict (a tuple keeps the config hashable).
  rope_scaling: Optional[tuple[tuple[str, object], ...]] = None
  tie_word_embeddings: bool = False
  attention_bias: bool = False  # Qwen2/2.5 put a bias on q, k and v.
  qk_norm: bool = False  # Qwen3 RMS-normalises q and k per head before RoPE.
  max_position_embeddings: int = 4096
  architecture: str = "LlamaForCausalLM"
  dtype: str = "float32"  # Activations / matmul inputs; logits are always float32.
  param_dtype: str = "float32"  # Storage dtype of the weights.
  remat: bool = False  # Recompute each layer in the backward pass to save activation memory.
  # "blockwise": query x key blocks with an online softmax, no [B,N,T,S] scores (dense when the
  # sequence fits one block); "dense": all scores at once (the reference); "xla" / "cudnn":
  # `jax.nn.dot_product_attention` with that implementation for the uncached forward (cudnn needs
  # an NVIDIA GPU and half precision), blockwise elsewhere; "splash": Pallas' TPU kernel for one
  # causal source (the update), blockwise elsewhere (`attention.attend`).
  attention_impl: str = "blockwise"
  attention_block_q: int = 512  # Queries per block of the blockwise kernel.
  attention_block_k: int = 512  # Keys per block of the blockwise kernel.
  # Run the layers in a Python loop over weights split once per call (each decode loop, and the
  # update's teacher-forced passes) instead of a scan over the stacked [L, ...] weights. On CPU the
  # scan copies a layer's weights at every decode step and reads the backward pass's saved
  # activations through slices, which costs more than the matmuls of a small model (the update of
  # the tiny model: ~20% faster unrolled). Costs one transient copy of the layer weights per call
  # and compile time linear in L. None = on CPU only.
  unroll_layers: Optional[bool] = None
  lora: Optional[LoraConfig] = None

  def __post_init__(self):
    if self.num_heads % self.num_kv_heads:
      raise ValueError(f"num_heads={self.num_heads} is not a multiple of "
                       f"num_kv_heads={self.num_kv_heads}")
    impls = ATTENTION_IMPLS
    if self.attention_impl not in impls:
      raise ValueError(f"ModelConfig.attention_impl must be one of {impls}, got "
                       f"{self.attention_impl!r}")
    if self.attention_block_q <= 0 or self.attention_block_k <= 0:
      raise ValueError("ModelConfig.attention_block_q and attention_block_k must be positive")
    for name in ("dtype", "param_dtype"):
      if getattr(self, name) not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"ModelConfig.{name} must be float32, bfloat16 or float16")

  @property
  def compute_dtype(self):
    return jnp.dtype(self.dtype)

  @property
  def weight_dtype(self):
    return jnp.dtype(self.param_dtype)

  @property
  def rope_scaling_dict(self) -> dict:
    return dict(self.rope_scaling or ())

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  def num_params(self) -> int:
    """Parameter count of the base model (no adapters)."""
    d, f, v = self.hidden_size, self.intermediate_size, self.vocab_size
    q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
    attn = d * q + 2 * d * kv + q * d + (q + 2 * kv if self.attention_bias else 0)
    attn += 2 * self.head_dim if self.qk_norm else 0
    layer = attn + 3 * d * f + 2 * d
    head = 0 if self.tie_word_embeddings else v * d
    return v * d + self.num_layers * layer + d + head

  def forward_flops_per_token(self, seq_len: int) -> int:
    """Matmul FLOPs of one token's forward pass in a `seq_len` sequence (the MFU numerator).

    2 x (every projection, MLP and the LM head) + 4 x L x N x H x seq_len for scores and values,
    counted over the full sequence as the implementation computes them (no causal halving).
    Adapters, norms, RoPE and the softmax are left out; the backward pass costs twice this.
    """
    d, f = self.hidden_size, self.intermediate_size
    q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
    matmul = self.num_layers * (d * q + 2 * d * kv + q * d + 3 * d * f) + d * self.vocab_size
    return 2 * matmul + 4 * self.num_layers * q * seq_len
