r"""Trains a multi-task LLM agent with EPPO.

  python run.py --config=configs/multitask.py --workdir=runs/tiny
  python run.py --config=configs/multitask.py:qwen2.5-1.5b --config.method=grpo --workdir=...

Rerunning with the same --workdir resumes from its latest checkpoint; a rerun with a different
config is refused (see --config.train.allow_config_change). Ctrl-C or SIGTERM stop the run after
the current step, with a checkpoint saved.
"""

import logging as std_logging
import runpy
import sys

from absl import app, flags, logging
from ml_collections import config_flags

config_flags.DEFINE_config_file("config", "configs/multitask.py", "Training configuration.",
                                lock_config=True)
flags.DEFINE_string("workdir", "runs/default", "Checkpoints, logs, plots and the exported model.")


def _unknown_override(argv) -> str | None:
  """The first `--config.a.b=...` override naming a field the config file does not have."""
  from eppo_jax import config_check  # pylint: disable=g-import-not-at-top
  spec = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")),
              "configs/multitask.py")
  path, _, preset = spec.partition(":")
  try:
    config = runpy.run_path(path)["get_config"](*([preset] if preset else []))
  except Exception:  # A bad file or preset: absl's own message says more.
    return None
  for arg in argv:
    if arg.startswith("--config."):
      field = arg[len("--config."):].split("=", 1)[0]
      missing = config_check.unknown_field(config, field)
      if missing:
        return missing
  return None


def parse_flags(argv):
  """absl's flag parsing, with a one-line error for user mistakes instead of a traceback."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    sys.exit(f"error: {e}\nPass --helpshort or --helpfull to see help on flags.")
  except (AttributeError, KeyError) as e:  # ml_collections' answer to an unknown override.
    field = _unknown_override(argv)
    if field is None:
      raise
    sys.exit(f"error: --config.{field}: the config has no field config.{field} ({e})")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    # Libraries (orbax, jax) log every detail at INFO; keep their warnings, and this package's info.
    logging.set_verbosity(logging.WARNING)
    std_logging.getLogger("eppo_jax").setLevel(std_logging.INFO)
  # pylint: disable-next=g-import-not-at-top
  from eppo_jax import interrupt, train
  print(f"config:\n{flags.FLAGS.config}", flush=True)
  try:
    record = train.train(flags.FLAGS.config, flags.FLAGS.workdir)
  except train.REPORTED_ERRORS as e:
    sys.exit(f"error: {e}")
  except interrupt.Interrupted as e:
    print(e, flush=True)
    sys.exit(128 + e.signum)
  summary = {k: v for k, v in record.items() if "success" in k and v is not None}
  print("final:", " ".join(f"{k}={v:.3f}" for k, v in sorted(summary.items())), flush=True)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
