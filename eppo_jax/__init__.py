"""eppo_jax: multi-task agentic RL of LLMs with Entropy Pacing Policy Optimization, in JAX."""

import os as _os

# transformers serves only configs, tokenizers and chat templates here; without PyTorch it warns on
# import that its models are unavailable, which is expected and would only confuse a user.
_os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

from eppo_jax import lora
from eppo_jax.models.config import LoraConfig, ModelConfig
from eppo_jax.models.hf import Pretrained, export_hf, load_pretrained
from eppo_jax.models.tiny import TinySpec, build_tiny_model
from eppo_jax.models.transformer import forward_with_cache, init_cache, init_params, logits
from eppo_jax.objective import LossConfig, eppo_loss, grpo_advantages, kl_penalty, method_configs
from eppo_jax.pacing import (PacingConfig, PacingState, entropy_crossovers, entropy_spikes,
                             init_pacing, pacing_bounds, pacing_diagnostics, task_entropy,
                             update_pacing)
from eppo_jax.sampling import RolloutOutput, SamplingConfig, rollout

__version__ = "0.1.0"
