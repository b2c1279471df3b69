"""eppo_jax: multi-task agentic RL of LLMs with Entropy Pacing Policy Optimization, in JAX."""

from eppo_jax import lora
from eppo_jax.models.config import LoraConfig, ModelConfig
from eppo_jax.models.hf import Pretrained, export_hf, load_pretrained
from eppo_jax.models.tiny import TinySpec, build_tiny_model
from eppo_jax.models.transformer import forward_with_cache, init_cache, init_params, logits

__version__ = "0.1.0"
