"""Runs a script as the 2 processes of one `jax.distributed` job on localhost (multi-host tests)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path


def free_port() -> int:
  """A TCP port free on localhost now (for the coordinator)."""
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def run(script: Path, out_dir: Path, cwd, timeout_s: float) -> list[dict]:
  """Starts `python script I OUT` for I = 0, 1 and returns the JSON each wrote to its OUT.

  Fails with the process's last output if one exits non-zero; kills both after `timeout_s` (a
  host left waiting in a collective never exits on its own).
  """
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # The script sets its own.
  outs = [out_dir / f"out{i}.json" for i in range(2)]
  procs = [subprocess.Popen([sys.executable, str(script), str(i), str(out)], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
           for i, out in enumerate(outs)]
  logs = []
  try:
    for p in procs:
      logs.append(p.communicate(timeout=timeout_s)[0])
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for i, p in enumerate(procs):
    assert p.returncode == 0, f"process {i}:\n{logs[i][-5000:]}"
  return [json.loads(out.read_text()) for out in outs]
