"""The Colab notebooks run end to end, shrunk through their `parameters` cell, in a fresh kernel.

Each notebook is executed with nbclient the way papermill does it: a cell tagged
`injected-parameters` is inserted after the cell tagged `parameters`, so the notebook's own defaults
stay as a user sees them and the test's small values win. The kernel is this interpreter
(`sys.executable`) described by a kernelspec written to a temporary directory, so no kernel has to
be installed and a venv's kernel cannot be confused with another Python's. Its environment pins JAX
to one CPU device (the test session itself uses four) and shares a persistent compilation cache
between the notebooks, which run the same small programs.
"""

import ast
import json
import os
import sys
import time
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

ROOT = Path(__file__).resolve().parent.parent
COLABS = ROOT / "colabs"
NOTEBOOKS = ("quickstart.ipynb", "hf_lora.ipynb", "entropy_dynamics.ipynb", "smollm2.ipynb")
CELL_TIMEOUT_S = 600  # Per cell; a cell that hangs fails the test instead of blocking the suite.
KERNEL_NAME = "eppo-jax-test"

# The `smoke` preset's sizes, shortened further: the run must take seconds, not minutes.
SMALL = dict(INSTALL=False, FRESH=True, PRESET="smoke", SFT_STEPS=2, NUM_STEPS=1,
             INSTANCES_PER_STEP=4, GROUP_SIZE=2, EVAL_EVERY=1, EVAL_INSTANCES_PER_TASK=1)


def write_kernelspec(kernels_dir: Path, env: dict) -> Path:
  """A kernelspec for this interpreter, with `env` added to the kernel's environment."""
  spec = kernels_dir / KERNEL_NAME
  spec.mkdir(parents=True, exist_ok=True)
  (spec / "kernel.json").write_text(json.dumps({
      "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
      "display_name": f"Python ({sys.executable})",
      "language": "python",
      "env": env,
  }))
  return kernels_dir


@pytest.fixture(scope="module")
def kernel_manager_factory(tmp_path_factory):
  """Returns a function that builds a KernelManager for a fresh kernel of this interpreter."""
  from jupyter_client.kernelspec import KernelSpecManager  # pylint: disable=g-import-not-at-top
  from jupyter_client.manager import KernelManager  # pylint: disable=g-import-not-at-top
  root = tmp_path_factory.mktemp("jupyter")
  cache = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(root / "jax_cache")
  env = {
      "XLA_FLAGS": "--xla_force_host_platform_device_count=1",
      "JAX_PLATFORMS": "cpu",
      "JAX_COMPILATION_CACHE_DIR": cache,
      "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.5",
      "HF_HUB_OFFLINE": "1",
      "HF_HUB_DISABLE_PROGRESS_BARS": "1",
      "TRANSFORMERS_VERBOSITY": "error",
      "TOKENIZERS_PARALLELISM": "false",
      "PYDEVD_DISABLE_FILE_VALIDATION": "1",
      # A notebook's install cell runs pip as on Colab, but the project (without its dependencies,
      # which this interpreter has) goes to a scratch directory, not into the test environment.
      "PIP_TARGET": str(root / "pip_target"),
      "PIP_NO_DEPS": "1",
      "PIP_NO_BUILD_ISOLATION": "0",  # pip's inverted spelling of --no-build-isolation.
      "PIP_DISABLE_PIP_VERSION_CHECK": "1",
  }
  ksm = KernelSpecManager(kernel_dirs=[str(write_kernelspec(root / "kernels", env))],
                          ensure_native_kernel=False)
  assert ksm.get_kernel_spec(KERNEL_NAME).argv[0] == sys.executable
  # IPC sockets: local only, and no warning about unencrypted TCP.
  make = lambda: KernelManager(kernel_name=KERNEL_NAME, kernel_spec_manager=ksm, transport="ipc",
                              ip=str(root / "kernel-ipc"))
  make.pip_target = root / "pip_target"
  return make


def _parameters_cell(nb) -> int:
  tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", [])]
  assert len(tagged) == 1, f"expected one cell tagged 'parameters', found {len(tagged)}"
  return tagged[0]


def _assigned_names(source: str) -> set:
  return {t.id for node in ast.parse(source).body if isinstance(node, ast.Assign)
          for t in node.targets if isinstance(t, ast.Name)}


def inject_parameters(nb, params: dict):
  """Papermill-style: a new cell after the `parameters` cell assigns `params`."""
  index = _parameters_cell(nb)
  unknown = set(params) - _assigned_names(nb.cells[index].source)
  assert not unknown, f"not parameters of this notebook: {sorted(unknown)}"
  source = "# Parameters injected by tests/test_notebooks.py\n" + "".join(
      f"{name} = {value!r}\n" for name, value in params.items())
  cell = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
  nb.cells.insert(index + 1, cell)
  return nb


def run_notebook(name: str, params: dict, make_km, cwd: Path = COLABS) -> tuple:
  """Executes colabs/`name` with `params` in `cwd` (colabs/, as Jupyter would) -> (nb, seconds)."""
  nb = inject_parameters(nbformat.read(str(COLABS / name), as_version=4), params)
  km = make_km()
  client = nbclient.NotebookClient(nb, km=km, timeout=CELL_TIMEOUT_S,
                                   resources={"metadata": {"path": str(cwd)}})
  start = time.time()
  try:
    client.execute()
  finally:
    if km.has_kernel:  # nbclient leaves a kernel it was handed running.
      km.shutdown_kernel(now=True)
    keep = os.environ.get("EPPO_NOTEBOOK_OUTPUT_DIR")  # Executed copies, to look at the plots.
    if keep:
      Path(keep).mkdir(parents=True, exist_ok=True)
      nbformat.write(nb, str(Path(keep) / name))
  return nb, time.time() - start


def _text(nb) -> str:
  """All stream and text outputs of an executed notebook."""
  parts = []
  for cell in nb.cells:
    for out in cell.get("outputs", []):
      if out.get("output_type") == "stream":
        parts.append(out.get("text", ""))
      elif "data" in out:
        parts.append(out["data"].get("text/plain", ""))
  return "".join(parts)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_is_clean_and_parameterised(name):
  """Committed without outputs; a title, explanations, and exactly one `parameters` cell."""
  nb = nbformat.read(str(COLABS / name), as_version=4)
  nbformat.validate(nb)
  assert nb.cells[0].cell_type == "markdown" and nb.cells[0].source.startswith("# ")
  assert sum(c.cell_type == "markdown" for c in nb.cells) >= 5
  for cell in nb.cells:
    if cell.cell_type == "code":
      assert cell.outputs == [] and cell.execution_count is None, "strip the outputs"
  params = _assigned_names(nb.cells[_parameters_cell(nb)].source)
  assert {"INSTALL", "WORKDIR"} <= params


def test_quickstart(tmp_path, kernel_manager_factory):
  """The default job (shrunk): SFT, RL, metrics, plots and the HF export."""
  workdir = tmp_path / "quickstart"
  nb, seconds = run_notebook("quickstart.ipynb", dict(SMALL, WORKDIR=str(workdir)),
                             kernel_manager_factory)
  print(f"quickstart.ipynb: {seconds:.0f}s")
  for path in ("metrics.jsonl", "plots.png", "final_metrics.json", "hf_export/config.json"):
    assert (workdir / path).exists(), path
  assert "recomputed" in _text(nb)


def _tiny_qwen2(out_dir: Path) -> Path:
  """A random 2-layer Qwen2 (q/k/v bias, tied embeddings) with a locally trained tokenizer."""
  import torch  # pylint: disable=g-import-not-at-top
  import transformers  # pylint: disable=g-import-not-at-top
  from eppo_jax import envs  # pylint: disable=g-import-not-at-top
  from eppo_jax.models.tiny import train_tokenizer  # pylint: disable=g-import-not-at-top
  corpus = []
  for spec in ("sokoban:easy", "frozenlake:easy", "countdown:easy"):
    for seed in range(8):
      env = envs.make(spec)
      observation, _ = env.reset(seed)
      corpus += [env.instructions, observation] + [envs.format_action(a) for a in env.solve()]
      env.close()
  tokenizer = train_tokenizer(corpus, 400)
  config = transformers.Qwen2Config(
      vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
      tie_word_embeddings=True, rms_norm_eps=1e-6, eos_token_id=tokenizer.eos_token_id,
      pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
  torch.manual_seed(0)
  model = transformers.Qwen2ForCausalLM(config).float().eval()
  model.save_pretrained(str(out_dir))
  tokenizer.save_pretrained(str(out_dir))
  return out_dir


def test_hf_lora(tmp_path, kernel_manager_factory):
  """LoRA on an HF Qwen2 directory, EPPO, merged export that transformers loads and runs.

  Opened outside any checkout, as Colab opens it: the install cell clones REPO_URL (here this
  repository, by file URL) and pip-installs the clone.
  """
  model_dir = _tiny_qwen2(tmp_path / "tiny_qwen2")
  workdir = tmp_path / "hf_lora"
  outside = tmp_path / "colab"
  outside.mkdir()
  params = dict(INSTALL=True, REPO_URL=f"file://{ROOT}", DOWNLOAD=False, FRESH=True,
                MODEL=str(model_dir),
                WORKDIR=str(workdir), NUM_STEPS=1, INSTANCES_PER_STEP=2, GROUP_SIZE=2,
                MAX_TURNS=2, MAX_NEW_TOKENS=8, MAX_EPISODE_TOKENS=512, MICRO_BATCH=2,
                LORA_RANK=4, DTYPE="float32", EVAL_EVERY=1, EVAL_INSTANCES_PER_TASK=1)
  nb, seconds = run_notebook("hf_lora.ipynb", params, kernel_manager_factory, cwd=outside)
  print(f"hf_lora.ipynb: {seconds:.0f}s")
  clone = outside / "eppo_jax_repo"
  assert f"repository: {clone}" in _text(nb)
  assert (clone / ".git").is_dir() and (clone / "configs" / "multitask.py").exists()
  assert (kernel_manager_factory.pip_target / "eppo_jax" / "__init__.py").exists()
  exported = json.loads((workdir / "hf_export" / "config.json").read_text())
  assert exported["architectures"] == ["Qwen2ForCausalLM"]
  text = _text(nb)
  assert "Qwen2ForCausalLM" in text and "reply:" in text


def test_entropy_dynamics(tmp_path, kernel_manager_factory):
  """One shared SFT warm start, then EPPO and GRPO resumed from its step-0 checkpoint."""
  workdir = tmp_path / "dynamics"
  # The preset's update schedule: the programs compiled for the quickstart are reused.
  params = dict(SMALL, WORKDIR=str(workdir), NUM_MINIBATCHES=2, PPO_EPOCHS=1)
  nb, seconds = run_notebook("entropy_dynamics.ipynb", params, kernel_manager_factory)
  print(f"entropy_dynamics.ipynb: {seconds:.0f}s")
  for method in ("eppo", "grpo"):
    records = [json.loads(line) for line in (workdir / method / "metrics.jsonl").open()]
    # Resumed from the warm start: the SFT history is there and RL went to the last step.
    assert any("sft_loss" in r for r in records)
    assert max(r["step"] for r in records) == SMALL["NUM_STEPS"]
  assert "crossovers" in _text(nb)


def _tiny_gguf(out_dir: Path) -> Path:
  """A random 2-layer Llama written as llama.cpp writes SmolLM2's file (Q4_1 weights, Q8_0 tied
  embedding, the `smollm` pre-tokenizer, ChatML), by tests/test_gguf.py's writer."""
  from conftest import make_hf_model  # pylint: disable=g-import-not-at-top
  from test_gguf import VARIANTS, train_tokenizer, write_gguf  # pylint: disable=g-import-not-at-top
  tokenizer = train_tokenizer("smollm")
  tied, quant = VARIANTS["q4_1_tied"]
  model = make_hf_model("llama", seed=7, tie_word_embeddings=tied,
                        vocab_size=tokenizer.get_vocab_size(), hidden_size=64,
                        intermediate_size=96, max_position_embeddings=2048)
  out_dir.mkdir(parents=True, exist_ok=True)
  return write_gguf(out_dir / "tiny.Q4_1.gguf", model, tokenizer, quant=quant)


def test_smollm2(tmp_path, kernel_manager_factory):
  """The smollm2-135m preset on a tiny GGUF written here (no download): conversion, zero-shot
  evaluation, SFT + one RL step, plots, the export loaded back and played by transformers."""
  pytest.importorskip("gguf")
  source = _tiny_gguf(tmp_path / "gguf")
  model_dir, workdir = tmp_path / "model", tmp_path / "smollm2"
  params = dict(INSTALL=False, GGUF_SOURCE=str(source), MODEL_DIR=str(model_dir),
                WORKDIR=str(workdir), FRESH=True, ZERO_SHOT_INSTANCES=1, SFT_STEPS=2,
                SFT_BATCH_SIZE=4, DEMOS_PER_TASK=4, NUM_STEPS=1, INSTANCES_PER_STEP=2,
                GROUP_SIZE=2, MAX_TURNS=2, MAX_NEW_TOKENS=8, MAX_EPISODE_TOKENS=1024,
                MICRO_BATCHES=1, LORA_RANK=4, DTYPE="float32", EVAL_EVERY=1,
                EVAL_INSTANCES_PER_TASK=1, PARITY_INSTANCES=1)
  nb, seconds = run_notebook("smollm2.ipynb", params, kernel_manager_factory)
  print(f"smollm2.ipynb: {seconds:.0f}s")
  assert (model_dir / "config.json").exists() and (model_dir / "tokenizer.json").exists()
  for path in ("metrics.jsonl", "final_metrics.json", "hf_export/config.json"):
    assert (workdir / path).exists(), path
  records = [json.loads(line) for line in (workdir / "metrics.jsonl").open()]
  assert any("sft_loss" in r for r in records) and max(r["step"] for r in records) == 1
  text = _text(nb)
  assert "LlamaForCausalLM" in text and "reply:" in text
  assert "identical actions 1.00, identical replies 1.00" in text
