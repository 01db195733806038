"""The config schema: typed dataclasses that hold every default.

Hydra YAML in ``conf/`` supplies values only; it is merged onto
``OmegaConf.structured(Config)`` so unknown keys and wrong types are refused
while composing, and converted once into these dataclasses. Per-field rules
(allowed choices, ranges) are declared next to the field with :func:`choice`
and :func:`bounded`; rules that span fields live in ``validate.py``.

The defaults are small and safe (CPU, float32, two workers, short
sequences); a run normally starts from a preset in ``conf/exp/`` (the
``tiny`` one when the command line names none), which sets what the run needs.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from easytrain.config.fields import CHOICES, HIGH, LOW, LOW_OPEN, Section, bounded, choice  # noqa: F401 - re-exported
from easytrain.config.runtime import LaunchConfig, RayConfig, WatchdogConfig  # noqa: F401 - re-exported


# ----------------------------------------------------------------------------- model


MASKED_ATTENTION = ("sdpa", "eager")
"""model.attn_implementation values that take an explicit attention mask (prompt-shared passes need one)."""


@dataclass
class LoraConfig(Section):
    rank: int = bounded(0, low=0)
    """LoRA rank; 0 turns LoRA off (full fine-tuning)."""
    alpha: float = bounded(16.0, low=0, low_open=True)
    """LoRA scaling numerator: the update is scaled by alpha / rank."""
    dropout: float = bounded(0.0, low=0.0, high=0.99)
    """Dropout on the LoRA branch."""
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    """Module name suffixes to adapt, or ["all-linear"] for every linear layer of the language model."""


@dataclass
class ModelConfig(Section):
    path: str = "tiny:qwen2_5_vl"
    """HF folder or hub id, tiny:<model_type> of a family with a tiny model (built locally, random weights; the
    README's family table lists them), or random:<conf/model file stem> (that preset's real shape, random
    weights, its family's tiny tokenizer)."""
    tiny_size: str = choice("tiny", "tiny", "small")
    """Size of a tiny: model: tiny (~0.2M parameters) or small (~4M)."""
    tiny_seed: int = 0
    """Seed the tiny: model's weights and tokenizer (and a random: model's weights and tokenizer) are built from."""
    tokenizer_path: Optional[str] = None
    """Tokenizer/processor folder when it differs from model.path."""
    cache_dir: Optional[str] = None
    """Where tiny models (and hub downloads) are cached; default ~/.cache/easytrain."""
    dtype: str = choice("float32", "float32", "bfloat16", "float16")
    """Dtype of trained parameters' compute copy (master weights stay float32 under FSDP mixed precision)."""
    attn_implementation: str = choice("sdpa", "sdpa", "eager", "flash_attention_2", "auto")
    """transformers attention kernel; ``auto``: flash_attention_2 on a GPU run where flash-attn is installed,
    else sdpa. On GPU, sdpa's padding-free and Ulysses passes attend sample by sample (no S x S mask)."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, ~30% more compute."""
    dedupe_images: bool = True
    """Run the vision tower once per distinct image in a forward (a prompt's n responses share its images) and
    give every copy its features: same values, a fraction of the vision compute (rollout with the hf engine,
    reference, actor)."""
    freeze_vision_tower: bool = False
    """Do not train the vision encoder (saves its gradients and optimizer states)."""
    freeze_aligner: bool = False
    """Do not train the vision-language projector (merger)."""
    freeze_llm: bool = False
    """Do not train the language model (only vision tower and/or projector learn)."""
    trust_remote_code: bool = False
    """Allow model code from the model folder; off unless you trust the source."""
    lora: LoraConfig = field(default_factory=LoraConfig)


# ----------------------------------------------------------------------------- data


@dataclass
class DataConfig(Section):
    train_files: Any = "synthetic:shapes"
    """Training data: a path (jsonl, parquet, HF dataset folder), repo@split, synthetic:<task>, or a list of these."""
    val_files: Any = "synthetic:shapes"
    """Validation data, same forms as train_files; null for none."""
    prompt_key: str = "problem"
    """Column holding the prompt text (may contain <image> placeholders)."""
    answer_key: str = "answer"
    """Column holding the ground truth the reward checks."""
    image_key: Optional[str] = "images"
    """Column holding images (bytes, paths, or base64); null for text-only data."""
    image_dir: Optional[str] = None
    """Folder that relative image paths are resolved against."""
    allow_outside_image_dir: bool = False
    """Read image paths that lead outside data.image_dir (absolute paths, '..', links out of it; the current
    folder when image_dir is null); by default such a row is skipped (image_outside_dir)."""
    format_prompt: Optional[str] = None
    """Jinja template file applied to each prompt before the chat template (gets `content`)."""
    max_prompt_length: int = bounded(256, low=1)
    """Tokens of a prompt, text plus image tokens; longer prompts are filtered."""
    max_response_length: int = bounded(32, low=1)
    """Tokens generated per response."""
    rollout_batch_size: int = bounded(8, low=1)
    """Prompts per RL step (each gets worker.rollout.n responses)."""
    val_batch_size: int = bounded(16, low=-1)
    """Prompts per validation batch; -1 for the whole validation set at once."""
    min_pixels: int = bounded(3136, low=1)
    """Images smaller than this (in pixels) are upscaled; 3136 = 56x56 = 4 vision tokens."""
    max_pixels: int = bounded(12544, low=1)
    """Images larger than this are downscaled; each 28x28 block is one vision token (12544 = 16 tokens)."""
    limit_images: int = bounded(1, low=0)
    """Most images per sample; rows with more are skipped."""
    video_key: Optional[str] = None
    """Column holding videos: per row a list of videos, each a list of frames (any image form) or a video file
    (path or bytes, read with PyAV); null for data without video. `<video>` marks where each goes in the prompt."""
    video_fps: float = bounded(2.0, low=0.0, low_open=True)
    """Frames per second a video file is sampled at; a list of frames is taken to be at this rate."""
    limit_videos: int = bounded(1, low=0)
    """Most videos per sample; rows with more are skipped (too_many_videos)."""
    max_frames: int = bounded(16, low=1)
    """Most frames per video: a frame list with more is skipped (too_many_frames); a video file sampled at
    video_fps to more is sampled evenly to this many instead. Frames are sized like images (min/max_pixels)."""
    shuffle: bool = True
    """Shuffle training data each epoch (seeded by trainer.seed)."""
    downscale_images_to_fit: bool = False
    """Shrink the images of a prompt over max_prompt_length until it fits, instead of skipping it."""
    num_workers: int = bounded(2, low=0)
    """Data loader processes preparing batches (image processing) beside the driver; 0 = in the driver."""
    synthetic_size: int = bounded(512, low=1)
    """Rows of the train split of a synthetic:<task> dataset."""
    synthetic_val_size: int = bounded(64, low=1)
    """Rows of the validation split of a synthetic:<task> dataset."""
    synthetic_difficulty: int = bounded(1, low=0)
    """Synthetic task difficulty: distractor shapes per image (and a larger canvas above 1); 0 = none."""
    messages_key: str = "messages"
    """SFT: column holding a conversation (a list of {role, content} turns, `<image>` marking where images go);
    data without it is read in the prompt/answer schema (data.prompt_key / data.answer_key) as one exchange.
    A whole SFT sample (text plus image tokens) must fit max_prompt_length + max_response_length."""
    blank_images: bool = False
    """Replace every image (and video frame) by a blank (white) one of the same size: shows how much a model reads
    its images."""
    profile_rows: int = bounded(2000, low=0)
    """Rows per split the data profile reads before launch (`easytrain plan`, the check before a run): what the
    rows cost in pixels and tokens, the costliest rows, what other limits would keep; drawn at random (seeded)
    from larger data, all rows of smaller. 0: no profile."""


# ----------------------------------------------------------------------------- workers


@dataclass
class FSDPConfig(Section):
    full_shard: bool = True
    """Shard parameters, gradients and optimizer states (ZeRO-3 like); false shards only grads and optimizer states."""
    shard_size: int = bounded(-1, low=-1)
    """Ranks one copy of the model is sharded over (hybrid sharding replicates across groups); -1 = every rank of the role."""


@dataclass
class OffloadConfig(Section):
    params: bool = False
    """Keep parameters in host RAM between uses (FSDP CPU offload)."""
    optimizer: bool = False
    """Keep optimizer states in host RAM (actor only)."""


@dataclass
class OptimConfig(Section):
    lr: float = bounded(1e-6, low=0.0, low_open=True)
    """Peak learning rate of AdamW."""
    weight_decay: float = bounded(1e-2, low=0.0)
    """AdamW weight decay."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    """AdamW betas."""
    warmup_steps: int = bounded(0, low=0)
    """Linear warm-up, in optimizer steps."""
    scheduler: str = choice("constant", "constant", "cosine", "linear")
    """Learning-rate schedule after warm-up."""
    max_grad_norm: float = bounded(1.0, low=0.0)
    """Gradient clipping by global norm; 0 turns clipping off."""


@dataclass
class DeepSpeedConfig(Section):
    zero_stage: int = bounded(3, low=1, high=3)
    """ZeRO stage: 1 shards optimizer states, 2 also gradients, 3 also parameters."""
    offload_params: bool = False
    """ZeRO-3: keep parameters in host RAM between uses."""
    offload_optimizer: bool = False
    """ZeRO 1-3: keep optimizer states in host RAM and step there."""


@dataclass
class RoleConfig(Section):
    """Placement and memory settings of the roles that run a training model (the actor and the reference; the
    rollout engine has its own, below)."""

    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    ulysses_size: int = bounded(1, low=1)
    """Ranks one sequence is split over (DeepSpeed-Ulysses sequence parallelism)."""


@dataclass
class ActorConfig(RoleConfig):
    global_batch_size: int = bounded(8, low=1)
    """Prompts per optimizer step, each with its worker.rollout.n responses."""
    micro_batch_size_per_device_for_update: int = bounded(4, low=1)
    """Sequences per forward/backward on one device during the update (gradient accumulation fills the rest)."""
    micro_batch_size_per_device_for_experience: int = bounded(8, low=1)
    """Sequences per forward on one device when computing log-probs."""
    ppo_epochs: int = bounded(1, low=1)
    """Passes over each rollout batch."""
    clip_ratio_low: float = bounded(0.2, low=0.0)
    """PPO lower clip: ratio >= 1 - clip_ratio_low."""
    clip_ratio_high: float = bounded(0.28, low=0.0)
    """PPO upper clip: ratio <= 1 + clip_ratio_high (higher than low: DAPO's clip-higher)."""
    clip_ratio_dual: float = bounded(3.0, low=1.0)
    """Dual-clip bound for negative advantages (ratio <= clip_ratio_dual)."""
    loss_agg_mode: str = choice("token-mean", "token-mean", "seq-mean-token-mean")
    """How token losses become the loss: mean over all tokens of the mini batch, or per-sequence means averaged."""
    strategy: str = choice("fsdp", "fsdp", "deepspeed")
    """How the actor is distributed: fsdp (FSDP2, default) or deepspeed (ZeRO, worker.actor.deepspeed; SFT only)."""
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    padding_free: bool = False
    """SFT and RL passes: pack each micro batch's samples into one flattened sequence with no padding (samples
    do not attend to each other), micro batches filled up to max_token_len_per_device tokens instead of a fixed
    count."""
    max_token_len_per_device: int = bounded(4096, low=1)
    """Token budget of one packed micro batch (padding_free); a longer sample is refused by validation."""
    share_prompt: bool = True
    """Actor and reference forward passes: run the samples of one prompt in a micro batch as one row, the
    prompt (and its images) once and each response attending to it (same values up to float rounding); with
    sdpa/eager attention and no sequence parallelism (flash_attention_2 takes no such mask)."""
    reuse_log_probs_on_policy: bool = True
    """Skip the old-log-prob pass when the update is exactly on-policy (ppo_epochs=1 and one optimizer
    step per rollout batch): the old log-probs then equal the detached current ones."""
    optim: OptimConfig = field(default_factory=OptimConfig)


@dataclass
class RefConfig(RoleConfig):
    pass


@dataclass
class ValSamplingConfig(Section):
    n: int = bounded(1, low=1)
    """Responses per validation prompt (scores are averaged over them)."""
    temperature: float = bounded(0.0, low=0.0)
    """Validation temperature; 0 = greedy."""
    top_p: float = bounded(1.0, low=0.0, high=1.0, low_open=True)
    """Validation nucleus sampling mass."""
    top_k: int = bounded(-1, low=-1)
    """Validation top-k; -1 = off."""


@dataclass
class MultiTurnConfig(Section):
    enable: bool = False
    """Multi-turn rollouts: a response that ends in a tool call (the Hermes format
    <tool_call>{...}</tool_call>, which ChatML templates describe) gets the tool's result as a tool turn and generation goes on; only the
    model's own tokens are trained (docs/rollout.md#multi-turn-tools)."""
    max_turns: int = bounded(3, low=1)
    """Model turns per response at most; the last one is kept whole, as a single-turn response (1 = single-turn)."""
    tools: list[str] = field(default_factory=list)
    """Tool functions, each path/to/file.py:name or package.module:name (named like reward functions); the model
    sees their JSON schemas, taken from the signatures and docstrings."""
    tool_timeout_s: float = bounded(10.0, low=0.0, low_open=True)
    """A tool call running longer is stopped: the sample gets an error turn and is counted (rollout/tool_errors)."""
    max_tool_output_chars: int = bounded(2000, low=1)
    """A tool's text result is cut to this many characters."""
    max_tool_images: int = bounded(2, low=0)
    """Images the tool turns of one response may hold together (a turn that would pass it is an error turn); the
    planner prices them beside the prompt's images."""


@dataclass
class RolloutConfig(Section):
    engine: str = choice("hf", "hf", "vllm")
    """Generation engine: hf (transformers generate, any device) or vllm."""
    n: int = bounded(4, low=1)
    """Responses sampled per prompt."""
    temperature: float = bounded(1.0, low=0.0)
    """Sampling temperature; 0 = greedy."""
    top_p: float = bounded(1.0, low=0.0, high=1.0, low_open=True)
    """Nucleus sampling mass."""
    top_k: int = bounded(-1, low=-1)
    """Top-k sampling; -1 = off."""
    static_cache: str = choice("auto", "auto", "on", "off")
    """hf engine: auto = on CUDA (a static KV cache, decode steps compiled into CUDA graphs; finished rows stay
    in the batch), off on CPU; on = the static cache also on CPU (eager; for tests); off = never: easytrain's
    dynamic loop (each prompt prefilled once for its n samples, finished rows leave the batch)."""
    gpu_memory_utilization: float = bounded(0.6, low=0.0, high=1.0, low_open=True)
    """Fraction of each GPU's memory vLLM may reserve (weights + KV cache)."""
    tensor_parallel_size: int = bounded(1, low=1)
    """GPUs one vLLM engine spans."""
    stop_tokens: list[str] = field(default_factory=list)
    """Extra tokens that end a response like EOS (each must be one token of the vocabulary), e.g. ["</answer>"]."""
    max_model_len: Optional[int] = None
    """vLLM: longest prompt + response an engine serves; null = data.max_prompt_length + data.max_response_length."""
    max_num_batched_tokens: int = bounded(8192, low=1)
    """vLLM: tokens one engine step schedules (prefill chunking)."""
    max_num_seqs: int = bounded(256, low=1)
    """vLLM: sequences decoded at once per engine."""
    enforce_eager: bool = False
    """vLLM: no CUDA graphs (less memory, slower decode); always on for CPU."""
    sleep_level: int = bounded(2, low=0, high=2)
    """Fused workers (trainer.colocate=true): the engine frees its memory between rollouts (2 = drop weights and
    KV cache, the next weight sync refills them; 1 = offload weights to host and drop the KV cache, which
    copies the old weights back only for the sync to overwrite them), 0 = never sleep. vLLM sleeps on GPU only;
    the HF engine at level 2 also on CPU (its host copy is freed while the actor trains)."""
    sync_bucket_mb: float = bounded(256.0, low=0.0, low_open=True)
    """Weight sync streams the actor's weights in buckets of about this size, bounding the extra memory
    the sync holds (a module larger than the bucket travels alone)."""
    val_override: ValSamplingConfig = field(default_factory=lambda: ValSamplingConfig())
    """Sampling used for validation instead of the training settings above."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn rollouts with tools."""


@dataclass
class WorkerConfig(Section):
    actor: ActorConfig = field(default_factory=ActorConfig)
    ref: RefConfig = field(default_factory=RefConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)


# ----------------------------------------------------------------------------- algorithm


@dataclass
class AlgorithmConfig(Section):
    adv_estimator: str = choice("grpo", "grpo", "rloo", "reinforce_plus_plus")
    """How advantages are computed from rewards."""
    norm_adv_by_std: bool = True
    """GRPO: divide group-centred rewards by the group's std (Dr. GRPO sets this false)."""
    use_kl_loss: bool = True
    """Add a KL(actor || reference) term to the loss (GRPO style) instead of to the reward."""
    kl_penalty: str = choice("low_var_kl", "low_var_kl", "kl", "abs", "mse")
    """KL estimator: kl (k1), abs, mse (k2) or low_var_kl (k3)."""
    tis_cap: float = bounded(0.0, low=0.0)
    """trainer.rollout_mode=one_step_off: 0 takes the PPO ratio against the engine's sampling log-probs (the
    behaviour policy); > 0 takes it against the actor's log-probs at its current weights and weighs each
    token's loss by min(exp(actor - engine log-prob), tis_cap) (truncated importance sampling)."""
    max_staleness: int = bounded(2, low=0)
    """trainer.rollout_mode=async: the most weight versions between a token's sampling and the update that
    trains it. New prompts start while fewer than max_staleness - 1 step batches (at least one) are queued and
    running; a batch whose first tokens would train older is generated to its end in one call (through its tool
    turns); a queued group past it is dropped (rollout/stale_dropped)."""
    kl_coef: float = bounded(1e-2, low=0.0)
    """Weight of the KL term (initial value when kl_type=adaptive)."""
    kl_type: str = choice("fixed", "fixed", "adaptive")
    """fixed keeps kl_coef; adaptive steers it toward kl_target."""
    kl_target: float = bounded(0.1, low=0.0, low_open=True)
    """Adaptive KL: the KL the controller aims for."""
    kl_horizon: int = bounded(10000, low=1)
    """Adaptive KL: steps over which the coefficient adapts."""
    dynamic_sampling: bool = False
    """DAPO: drop prompts whose responses all scored the same and refill the batch with new prompts."""
    max_sampling_retries: int = bounded(3, low=0)
    """Dynamic sampling: extra generation rounds to refill a batch before training on what there is."""


# ----------------------------------------------------------------------------- reward


@dataclass
class RewardConfig(Section):
    function: str = "answer"
    """A registered reward (answer, math, format) or a user function as path/to/file.py:name or package.module:name."""
    format_weight: float = bounded(0.0, low=0.0, high=1.0)
    """Share of the format reward in `overall`: (1 - w) * accuracy + w * format."""
    num_workers: int = bounded(2, low=1)
    """Ray actors scoring a rollout's responses in parallel with each other."""
    timeout_s: float = bounded(600.0, low=0.0, low_open=True)
    """Seconds a reward worker may take for its share of a rollout; past it the worker is killed and replaced
    and its responses score 0, counted in reward/error_rate (a function that hangs must not hang the run)."""


# ----------------------------------------------------------------------------- trainer


@dataclass
class TrainerConfig(Section):
    task: str = choice("rl", "rl", "sft")
    """rl (GRPO and relatives) or sft."""
    device: str = choice("cpu", "cpu", "cuda")
    """Device workers compute on."""
    nnodes: int = bounded(1, low=1)
    """Nodes of the Ray cluster the run uses."""
    workers_per_node: int = bounded(2, low=1)
    """Worker processes per node: GPUs per node on cuda, CPU workers on cpu."""
    colocate: bool = True
    """One process per device hosts actor, reference and rollout (fused workers; the phases take the device in
    turn, in-process weight sync); false gives each role its own pool of processes and devices."""
    rollout_mode: str = choice("sync", "sync", "one_step_off", "async")
    """sync: each step generates, then trains on what it generated. one_step_off (separate pools,
    trainer.colocate=false): while the actor trains on batch t the engine generates batch t+1 with the weights of
    step t-1; the update's PPO ratio is taken against the engine's sampling log-probs. async (separate pools):
    partial rollouts: the engine generates in calls of trainer.async_call_tokens while the actor trains, a
    response unfinished at a weight sync goes on under the new weights, finished groups wait in a queue bounded by
    trainer.async_queue_gb; each token's ratio is taken against the log-prob of the weights that sampled it."""
    async_call_tokens: int = bounded(0, low=0)
    """trainer.rollout_mode=async: tokens an engine call adds to each running response before the weights may
    sync; 0 = half of data.max_response_length."""
    async_queue_gb: float = -1.0
    """trainer.rollout_mode=async: host GB the queue of finished samples may hold (token ids, log-probs, each
    prompt's pixels once); when full, no new prompts start (rollout/queue_full_s). -1 = what the node holds beside
    every process's planned peak, with the planner's margin (easytrain plan shows it)."""
    threads_per_worker: int = bounded(0, low=0)
    """torch threads of each role worker; 0 = its share of the node's CPUs (node CPUs / workers_per_node when
    colocated, also divided by the roles otherwise; Ray nodes started on one machine split its cores). Ray would
    give a worker with a fractional CPU one thread."""
    total_epochs: int = bounded(1, low=1)
    """Passes over the training data."""
    max_steps: int = bounded(-1, low=-1)
    """Stop after this many steps; -1 = run total_epochs."""
    val_freq: int = bounded(-1, low=-1)
    """Validate every N steps; -1 = only at the end."""
    val_before_train: bool = False
    """Validate once before the first step."""
    val_only: bool = False
    """Validate and exit without training."""
    log_samples: int = bounded(4, low=0)
    """Validation generations written to samples.jsonl at each validation."""
    save_freq: int = bounded(-1, low=-1)
    """Checkpoint every N steps (and at the end); -1 = only at the end; 0 = never, not even on SIGTERM."""
    save_limit: int = bounded(-1, low=-1)
    """Keep the newest N checkpoints; -1 = keep all."""
    checkpoint_host_buffer_gb: float = -1.0
    """Host RAM a checkpoint save may hold per process beyond the step's own: the state streams from the device
    to disk in pieces of half this size, and written pages leave the page cache before another half accumulates;
    -1 = 1/64 of the node's RAM (or its container's limit) / workers_per_node, clamped to 0.25-2 GiB (see
    docs/training.md). FSDP only; DeepSpeed's own files are not bounded."""
    malloc_mmap_threshold_kb: Optional[int] = bounded(None, low=0)
    """Fix glibc's mmap threshold in every worker process (``mallopt(M_MMAP_THRESHOLD)``): host blocks at least
    this large get their own mapping and go back to the OS when freed, so a phase's host peak follows its live
    tensors, at a cost in speed (every such block is mapped, zeroed by the kernel and unmapped again). Measured
    at 128 against null on CPU (bench/results/cpu_allocator.json, alternated twice): the update's peak 23% lower
    and the update 14% slower on the ~184M model over 2 ranks, the peak 7% lower and the update 46% slower with
    448 px images, the peak 1% lower and the update 18% slower on the default run. null (or 0) = glibc's dynamic
    default: it raises the threshold to the largest block freed (up to 32 MiB) and keeps freed blocks below it in
    its heap until the call ends (the worker trims the heap before and after every call); the plan prices either
    setting (docs/memory.md)."""
    checkpoint_async: bool = False
    """Save checkpoints in the background: the step loop waits only while the state is staged (the blocked time
    is logged per checkpoint), and the next save or the end of the run waits for the write to finish."""
    resume: str = "auto"
    """auto (latest complete checkpoint in output_dir, if any), off, or a checkpoint folder
    (global_step_<N>, or a run folder meaning its latest)."""
    max_failures: int = bounded(0, low=0)
    """Worker deaths (process killed, node lost) the run recovers from by recreating the worker groups and
    resuming from the latest checkpoint; 0 = stop with the command to resume."""
    export_final: bool = False
    """Export the final checkpoint as a Hugging Face folder to <output_dir>/hf (easytrain export)."""
    export_merge: bool = False
    """With LoRA, export_final writes the merged full model instead of the adapter."""
    loggers: list[str] = field(default_factory=lambda: ["console", "jsonl", "tensorboard"])
    """Where metrics go: console, jsonl (metrics.jsonl), tensorboard (<output_dir>/tensorboard), wandb (offline
    into the run folder unless WANDB_MODE or WANDB_API_KEY say otherwise), mlflow (a file store in
    <output_dir>/mlruns unless MLFLOW_TRACKING_URI is set). wandb and mlflow need their packages."""
    seed: int = 1
    """Seed for data order, sampling and initialisation."""
    output_dir: str = "${hydra:runtime.output_dir}"
    """Run folder: metrics.jsonl, checkpoints/, plots. Defaults to Hydra's run folder (hydra.run.dir)."""
    project_name: str = "easytrain"
    """Project name for loggers."""
    experiment_name: str = "tiny"
    """Run name for loggers."""
    memory_check: str = choice("auto", "auto", "error", "warn", "off")
    """Before any worker starts, check the memory plan (`easytrain plan`): error stops a run that does not
    fit, warn logs it, off skips it; auto = error on cuda, warn on cpu."""
    gpu_memory_gb: Optional[float] = bounded(None, low=0.0, low_open=True)
    """Memory of one GPU the plan checks against (e.g. 80 for H100-80GB); null = read from this machine."""
    node_memory_gb: Optional[float] = bounded(None, low=0.0, low_open=True)
    """RAM of one node the plan checks against; null = this machine's."""


@dataclass
class Config(Section):
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
