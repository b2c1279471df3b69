r"""Trains a multi-task LLM agent with EPPO.

  python run.py --config=configs/multitask.py --workdir=runs/tiny
  python run.py --config=configs/multitask.py:qwen2.5-1.5b --config.method=grpo --workdir=...

Rerunning with the same --workdir resumes from its latest checkpoint.
"""

import logging as std_logging

from absl import app, flags, logging
from ml_collections import config_flags

config_flags.DEFINE_config_file("config", "configs/multitask.py", "Training configuration.",
                                lock_config=True)
flags.DEFINE_string("workdir", "runs/default", "Checkpoints, logs, plots and the exported model.")


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f"unexpected arguments: {argv[1:]}")
  if not flags.FLAGS["verbosity"].present:
    # Libraries (orbax, jax) log every detail at INFO; keep their warnings, and this package's info.
    logging.set_verbosity(logging.WARNING)
    std_logging.getLogger("eppo_jax").setLevel(std_logging.INFO)
  from eppo_jax import train  # pylint: disable=g-import-not-at-top
  print(f"config:\n{flags.FLAGS.config}", flush=True)
  record = train.train(flags.FLAGS.config, flags.FLAGS.workdir)
  summary = {k: v for k, v in record.items() if "success" in k and v is not None}
  print("final:", " ".join(f"{k}={v:.3f}" for k, v in sorted(summary.items())), flush=True)


if __name__ == "__main__":
  app.run(main)
