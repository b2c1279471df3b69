"""Helpers shared by the benchmarks."""

import os


def use_cores(n: int) -> int:
  """Pins this process (and its children) to its first `n` allowed cores (0 = all); -> core count.

  Both sides then get the same cores: XLA sizes its thread pool from the affinity mask, and torch
  is given as many threads. On a shared machine, fewer cores than the machine has also keeps
  torch's OpenMP barriers from waiting on threads that other processes' load has descheduled.
  """
  allowed = sorted(os.sched_getaffinity(0))
  if n:
    os.sched_setaffinity(0, allowed[:n])
  return len(os.sched_getaffinity(0))
