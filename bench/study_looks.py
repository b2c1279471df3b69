"""How often the study's decision rule calls an effect where there is none, over several looks.

The evidence study (docs/results.md) read its primary metric at 5 paired seeds, then at 10, found
it unresolved both times, and added seeds for one more look at 30. This simulates that design under
"no effect": per-seed differences EPPO - GRPO with mean 0, drawn either from a normal with the
10 observed differences' SD or by resampling those differences centred on 0 (which keeps their
heavy tail), and the study's own rule (`study_stats.bootstrap_ci` + `verdict`) at each look.

  python bench/study_looks.py
"""

from __future__ import annotations

import argparse
from typing import Sequence

import numpy as np

import study_stats as stats

# Worst-task success at step 100, EPPO - GRPO, seeds 0-9, in eval episodes of 128 (docs/results.md).
OBSERVED = np.array([0, 10, -42, -5, -1, 19, -7, 6, -11, -3]) / 128


def false_effect_rates(draw, looks: Sequence[int], sims: int,
                       num_resamples: int) -> tuple[dict, float, float]:
  """Under no effect: ({n: P("effect" first called at the look at n)}, P(it reaches the last look),
  P("effect" at the last look read alone)).

  A simulated study stops at its first look whose verdict is not "unresolved", as the study does.
  """
  counts = dict.fromkeys(looks, 0)
  only_last = reached_last = 0
  for _ in range(sims):
    diffs = draw(looks[-1])
    verdicts = [stats.verdict(stats.bootstrap_ci(diffs[:n], num_resamples=num_resamples), n=n)
                for n in looks]
    decided = next((i for i, v in enumerate(verdicts[:-1]) if v != "unresolved"), len(looks) - 1)
    reached_last += decided == len(looks) - 1
    if verdicts[decided] == "effect":
      counts[looks[decided]] += 1
    only_last += verdicts[-1] == "effect"
  return {n: c / sims for n, c in counts.items()}, reached_last / sims, only_last / sims


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--looks", type=int, nargs="+", default=(5, 10, 30),
                      help="seed counts at which the verdict is read, increasing")
  parser.add_argument("--sims", type=int, default=2000)
  parser.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples per look")
  parser.add_argument("--seed", type=int, default=1)
  args = parser.parse_args()
  looks = tuple(args.looks)
  if looks[0] < stats.MIN_SEEDS or list(looks) != sorted(set(looks)):
    parser.error(f"--looks needs increasing seed counts from {stats.MIN_SEEDS}, got {args.looks}")
  rng = np.random.default_rng(args.seed)
  sd = OBSERVED.std(ddof=1)
  models = {
      f"normal, SD {sd:.3f}": lambda n: rng.normal(0.0, sd, n),
      "observed differences, centred": lambda n: rng.choice(OBSERVED - OBSERVED.mean(), n),
  }
  print(f"P(\"effect\" | no effect), looks at {', '.join(map(str, looks))} seeds, "
        f"{args.sims} simulated studies, {args.resamples} bootstrap resamples per look")
  for name, draw in models.items():
    per_look, reached, only_last = false_effect_rates(draw, looks, args.sims, args.resamples)
    added = ", ".join(f"at {n} {rate:.3f}" for n, rate in per_look.items())
    last = looks[-1]
    print(f"  {name}: over all looks {sum(per_look.values()):.3f} ({added}); at {last} once the "
          f"earlier looks left it unresolved {per_look[last] / reached:.3f}; "
          f"one look at {last} alone {only_last:.3f}")


if __name__ == "__main__":
  main()
