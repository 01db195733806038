"""Validation of a composed config, before any worker starts.

Every rule raises :class:`ConfigError`, whose message is one line naming the
dotted key, its value, what is wrong and how to fix it. Per-field rules come
from the schema's field metadata (:func:`check_fields`); rules that span
fields are in :func:`validate`. Rules that need the model's shape (attention
heads for sequence parallelism, text-only models) run when a
:class:`ModelShape` is given. This module only validates: the error is
:mod:`easytrain.config.errors`'s, and what validation shares with the runtime
lives beside it (:mod:`~easytrain.config.derived`, :mod:`~easytrain.config.data_spec`,
:mod:`~easytrain.config.presets`, :mod:`~easytrain.config.k8s_names`).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import os
from dataclasses import dataclass
from typing import Any, Optional

from easytrain.config.derived import ray_kill_threshold, world_size
from easytrain.config.errors import NO_VALUE, ConfigError
from easytrain.config.k8s_names import (DNS_LABEL, DNS_SUBDOMAIN, ENV_NAME, RAYJOB_NAME_MAX, SECRET_KEY,
                                        looks_secret)
from easytrain.config.presets import RANDOM_PREFIX, random_hf_config
from easytrain.config.schema import CHOICES, HIGH, LOW, LOW_OPEN, Config

logger = logging.getLogger(__name__)

LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
LOGGER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}
"""Loggers that need a package beyond easytrain's own: logger -> module (also the pip name)."""
ESTIMATORS_NEEDING_GROUPS = ("grpo", "rloo")


@dataclass(frozen=True)
class ModelShape:
    """What validation and planning need to know about a model's architecture."""

    family: str
    """The HF ``model_type`` (its family adapter: easytrain/models/families)."""
    num_attention_heads: int
    num_key_value_heads: int
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    max_position_embeddings: int
    is_vision: bool
    """Whether the model has a vision tower (accepts images)."""


# ----------------------------------------------------------------------------- per field


def check_fields(obj: Any, prefix: str = "") -> None:
    """Check every field against the choices/bounds declared in the schema."""
    for f in dataclasses.fields(obj):
        key = f"{prefix}{f.name}"
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            check_fields(value, key + ".")
            continue
        options = f.metadata.get(CHOICES)
        if options is not None and value not in options:
            raise ConfigError(key, value, "not a valid choice", f"use one of {', '.join(options)}")
        if LOW in f.metadata and value is not None:
            _check_bounds(key, value, f.metadata[LOW], f.metadata[HIGH], f.metadata[LOW_OPEN])


def _check_bounds(key: str, value: Any, low: Optional[float], high: Optional[float],
                  low_open: bool) -> None:
    if low is not None and (value < low or (low_open and value == low)):
        side = f"> {low}" if low_open else f">= {low}"
        raise ConfigError(key, value, f"must be {side}", _range_fix(low, high, low_open))
    if high is not None and value > high:
        raise ConfigError(key, value, f"must be <= {high}", _range_fix(low, high, low_open))


def _range_fix(low: Optional[float], high: Optional[float], low_open: bool) -> str:
    if low is not None and high is not None:
        return f"use a value in {'(' if low_open else '['}{low}, {high}]"
    return ""  # one bound: the problem ("must be >= 1") says it


# ----------------------------------------------------------------------------- cross field


def validate(cfg: Config, shape: Optional[ModelShape] = None) -> None:
    """Raise :class:`ConfigError` for the first impossible combination in ``cfg``."""
    check_fields(cfg)
    resolve_attention(cfg)
    _check_data(cfg)
    _check_batches(cfg)
    _check_parallelism(cfg)
    if cfg.trainer.task == "rl":
        _check_rollout(cfg)
    _check_rollout_mode(cfg)
    _check_multi_turn(cfg)
    _check_strategy(cfg)
    _check_model(cfg)
    _check_trainer(cfg)
    _check_watchdog(cfg)
    _check_launch(cfg)
    _check_reward(cfg)
    if shape is not None:
        _check_against_shape(cfg, shape)


def _divisors(n: int) -> str:
    found = [d for d in range(1, n + 1) if n % d == 0]
    if len(found) > 8:
        found = found[:4] + found[-3:]
        return ", ".join(map(str, found[:4])) + ", ..., " + ", ".join(map(str, found[4:]))
    return ", ".join(map(str, found))


def _file_list(key: str, value: Any, required: bool) -> list[str]:
    if value is None:
        if required:
            raise ConfigError(key, value, "no data given", "set it to a file, folder, repo@split or synthetic:<task>")
        return []
    files = [value] if isinstance(value, str) else value
    if not isinstance(files, (list, tuple)) or not all(isinstance(v, str) and v for v in files):
        raise ConfigError(key, value, "must be a path string or a list of path strings",
                          f"write {key}=train.parquet or {key}=[a.parquet,b.jsonl]")
    if required and not files:
        raise ConfigError(key, value, "the list is empty", "give at least one file")
    return list(files)


def _check_data(cfg: Config) -> None:
    d = cfg.data
    _file_list("data.train_files", d.train_files, required=not cfg.trainer.val_only)
    val = _file_list("data.val_files", d.val_files, required=False)
    if not val and (cfg.trainer.val_only or cfg.trainer.val_before_train):
        flag = "trainer.val_only" if cfg.trainer.val_only else "trainer.val_before_train"
        raise ConfigError("data.val_files", d.val_files, f"{flag}=true needs validation data",
                          f"set data.val_files or {flag}=false")
    if d.max_pixels < d.min_pixels:
        raise ConfigError("data.max_pixels", d.max_pixels,
                          f"is smaller than data.min_pixels={d.min_pixels}",
                          "raise data.max_pixels or lower data.min_pixels")
    if d.image_key and d.limit_images < 1 and not d.video_key:
        raise ConfigError("data.limit_images", d.limit_images,
                          f"must be >= 1 when images are read (data.image_key={d.image_key!r})",
                          "set data.limit_images>=1, or data.image_key=null for text-only data")
    if d.val_batch_size == 0:
        raise ConfigError("data.val_batch_size", 0, "must be >= 1, or -1 for the whole validation set")
    if d.video_key and not d.image_key:
        raise ConfigError("data.video_key", d.video_key, "videos go through the vision pipeline, which "
                          "data.image_key=null turns off", "set data.image_key (any column name; rows without "
                          "images are fine) or data.video_key=null")
    if d.video_key and cfg.trainer.task == "rl" and cfg.worker.rollout.engine == "vllm":
        raise ConfigError("data.video_key", d.video_key, "video rows are generated by the hf engine only (easytrain "
                          "does not hand videos to vLLM yet)", "set worker.rollout.engine=hf, or data.video_key=null")
    if d.video_key and cfg.trainer.task == "rl" and cfg.worker.rollout.multi_turn.enable:
        raise ConfigError("data.video_key", d.video_key, "multi-turn tool rollouts take image prompts only",
                          "set worker.rollout.multi_turn.enable=false, or data.video_key=null")


def _check_batches(cfg: Config) -> None:
    actor, d = cfg.worker.actor, cfg.data
    rl = cfg.trainer.task == "rl"
    n = cfg.worker.rollout.n if rl else 1
    if rl and cfg.algorithm.adv_estimator in ESTIMATORS_NEEDING_GROUPS and n < 2:
        raise ConfigError("worker.rollout.n", n,
                          f"algorithm.adv_estimator={cfg.algorithm.adv_estimator} compares responses "
                          "within a prompt's group and needs at least 2",
                          "set worker.rollout.n>=2 (4-16 is usual)")
    if rl and d.rollout_batch_size % actor.global_batch_size:
        raise ConfigError("worker.actor.global_batch_size", actor.global_batch_size,
                          f"must divide data.rollout_batch_size={d.rollout_batch_size} "
                          "(each rollout batch is split into optimizer steps)",
                          f"use one of {_divisors(d.rollout_batch_size)}")
    world = world_size(cfg)
    if world % actor.ulysses_size:
        return  # reported by _check_parallelism with a better message
    dp = world // actor.ulysses_size
    sequences = actor.global_batch_size * n
    what = (f"worker.actor.global_batch_size={actor.global_batch_size} x worker.rollout.n={n}"
            if rl else f"worker.actor.global_batch_size={actor.global_batch_size}")
    if sequences % dp:
        raise ConfigError("worker.actor.global_batch_size", actor.global_batch_size,
                          f"{what} = {sequences} sequences per optimizer step do not split evenly "
                          f"over {dp} data-parallel ranks",
                          f"make the sequence count a multiple of {dp}")
    per_rank = sequences // dp
    micro = actor.micro_batch_size_per_device_for_update
    if per_rank % micro and not actor.padding_free:
        raise ConfigError("worker.actor.micro_batch_size_per_device_for_update", micro,
                          f"must divide the {per_rank} sequences each of {dp} data-parallel ranks "
                          f"updates on per optimizer step ({what})",
                          f"use one of {_divisors(per_rank)}")


def _roles(cfg: Config) -> list[tuple[str, Any]]:
    """The roles that run a training model, with their FSDP, offload and Ulysses settings."""
    w = cfg.worker
    return [("actor", w.actor), ("ref", w.ref)]


def _check_parallelism(cfg: Config) -> None:
    world = world_size(cfg)
    where = (f"{world} workers (trainer.nnodes={cfg.trainer.nnodes} x "
             f"trainer.workers_per_node={cfg.trainer.workers_per_node})")
    for name, role in _roles(cfg):
        if world % role.ulysses_size:
            raise ConfigError(f"worker.{name}.ulysses_size", role.ulysses_size,
                              f"must divide the {where}", f"use one of {_divisors(world)}")
        shard = role.fsdp.shard_size
        if shard == 0 or (shard > 0 and world % shard):
            raise ConfigError(f"worker.{name}.fsdp.shard_size", shard,
                              f"must be -1 (all ranks) or divide the {where}",
                              f"use -1 or one of {_divisors(world)}")
    if cfg.worker.ref.offload.optimizer:
        raise ConfigError("worker.ref.offload.optimizer", True, "the ref role holds no optimizer",
                          "set worker.ref.offload.optimizer=false (offload.params is the one that applies)")


def _check_strategy(cfg: Config) -> None:
    """The actor's distribution strategy and padding-free packing."""
    a, sft = cfg.worker.actor, cfg.trainer.task == "sft"
    if a.strategy == "deepspeed" and not sft:
        raise ConfigError("worker.actor.strategy", a.strategy, "the RL actor streams FSDP2 shards to the rollout "
                          "engine and serves LoRA reference log-probs from them; DeepSpeed runs the SFT trainer only",
                          "use worker.actor.strategy=fsdp for trainer.task=rl")
    ds = a.deepspeed
    if a.strategy == "deepspeed" and ds.offload_params and ds.zero_stage != 3:
        raise ConfigError("worker.actor.deepspeed.offload_params", True,
                          f"parameter offload needs ZeRO stage 3 (worker.actor.deepspeed.zero_stage={ds.zero_stage})",
                          "set worker.actor.deepspeed.zero_stage=3 or offload_params=false")
    if a.strategy == "deepspeed" and cfg.model.dtype == "float16":
        raise ConfigError("model.dtype", "float16", "DeepSpeed's float16 needs its loss scaler, which easytrain's "
                          "caller-scaled losses do not use", "use model.dtype=bfloat16 (or float32)")
    if a.strategy == "deepspeed" and (a.offload.params or a.offload.optimizer):
        raise ConfigError("worker.actor.offload.params" if a.offload.params else "worker.actor.offload.optimizer",
                          True, "worker.actor.offload.* are FSDP settings; DeepSpeed offloads through its own",
                          "use worker.actor.deepspeed.offload_params / offload_optimizer")
    for name in ("actor",) if sft else ("actor", "ref"):
        u = getattr(cfg.worker, name).ulysses_size
        if u > 1 and not a.padding_free:
            raise ConfigError(f"worker.{name}.ulysses_size", u, "Ulysses sequence parallelism splits padding-free "
                              "(flattened) sequences", "set worker.actor.padding_free=true")
        if u > 1 and name == "actor" and a.strategy == "deepspeed":
            raise ConfigError("worker.actor.ulysses_size", u, "sequence parallelism is built and tested with "
                              "FSDP2, not with DeepSpeed", "use worker.actor.strategy=fsdp or ulysses_size=1")
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    if a.padding_free and a.max_token_len_per_device < longest:
        raise ConfigError("worker.actor.max_token_len_per_device", a.max_token_len_per_device,
                          f"a sample may hold data.max_prompt_length + data.max_response_length = {longest} "
                          "tokens, more than one packed micro batch", f"set it to at least {longest}")


def _check_rollout_mode(cfg: Config) -> None:
    """trainer.rollout_mode=one_step_off (and async) overlaps generation with training: separate pools, batches
    generated ahead, and engine log-probs that are the sampling distribution's."""
    t, a, r = cfg.trainer, cfg.algorithm, cfg.worker.rollout
    if t.rollout_mode == "sync":
        if a.tis_cap > 0:
            raise ConfigError("algorithm.tis_cap", a.tis_cap, "truncated importance weights correct a one step off "
                              "rollout, and trainer.rollout_mode=sync trains on the weights that generated",
                              "set algorithm.tis_cap=0 or trainer.rollout_mode=one_step_off (or async)")
        return
    if t.task != "rl":
        raise ConfigError("trainer.rollout_mode", t.rollout_mode, "SFT generates no rollouts",
                          "set trainer.rollout_mode=sync")
    if t.colocate:
        raise ConfigError("trainer.rollout_mode", t.rollout_mode,
                          f"{t.rollout_mode} overlaps generation with training on separate devices, and "
                          "trainer.colocate=true puts every role on the same ones",
                          "set trainer.colocate=false (a pool per role)")
    if a.dynamic_sampling:
        raise ConfigError("algorithm.dynamic_sampling", True, "dynamic sampling refills a batch by generating "
                          "again, which a batch generated ahead of its step cannot wait for",
                          "set algorithm.dynamic_sampling=false or trainer.rollout_mode=sync")
    if t.rollout_mode == "async":
        _check_async(cfg)
    if (r.top_p < 1 or r.top_k > 0) and a.tis_cap == 0:
        raise ConfigError("trainer.rollout_mode", t.rollout_mode,
                          f"{t.rollout_mode} takes the PPO ratio against the engine's log-probs, which with "
                          "worker.rollout.top_p/top_k are of the truncated distribution",
                          "set algorithm.tis_cap (the ratio then uses the actor's) or top_p=1 and top_k=0")


def _check_async(cfg: Config) -> None:
    """What partial rollouts cannot continue yet: vLLM with images (a continued prompt hands vLLM its images
    again, and a tool turn's images are kept only as the PIL objects vLLM takes, which a checkpoint does not
    hold; neither has run, as vLLM's vision code does not run on the CPU machines easytrain is tested on)."""
    t, r = cfg.trainer, cfg.worker.rollout
    tool_images = r.multi_turn.enable and r.multi_turn.max_tool_images > 0
    if r.engine == "vllm" and (cfg.data.image_key or tool_images):
        raise ConfigError("trainer.rollout_mode", t.rollout_mode, "partial rollouts with vLLM and images (the "
                          "prompts' or multi-turn tools') are not built yet", "set worker.rollout.engine=hf or "
                          "trainer.rollout_mode=one_step_off" + (", or (text prompts) worker.rollout.multi_turn."
                                                                 "max_tool_images=0" if tool_images and not cfg.data.image_key else ""))
    if cfg.algorithm.max_staleness < 1:
        raise ConfigError("algorithm.max_staleness", cfg.algorithm.max_staleness, "an async step trains on tokens "
                          "the weights before its last sync sampled (1 version old) at the least",
                          "set algorithm.max_staleness to 1 or more")


def _check_rollout(cfg: Config) -> None:
    r = cfg.worker.rollout
    tp = r.tensor_parallel_size
    if tp > 1 and r.engine != "vllm":
        raise ConfigError("worker.rollout.tensor_parallel_size", tp,
                          f"tensor parallelism is a vLLM feature and worker.rollout.engine={r.engine!r}",
                          "set worker.rollout.engine=vllm or tensor_parallel_size=1")
    if cfg.trainer.workers_per_node % tp:
        unit = "GPUs" if cfg.trainer.device == "cuda" else "workers"
        raise ConfigError("worker.rollout.tensor_parallel_size", tp,
                          f"one engine must fit on a node, and {tp} does not divide the "
                          f"{cfg.trainer.workers_per_node} {unit} per node (trainer.workers_per_node)",
                          f"use one of {_divisors(cfg.trainer.workers_per_node)}")
    if r.engine == "vllm" and cfg.trainer.device == "cpu" and cfg.model.dtype != "float32":
        raise ConfigError("model.dtype", cfg.model.dtype, "vLLM on CPU runs only in float32",
                          "set model.dtype=float32 or worker.rollout.engine=hf")
    for key, sampling in (("worker.rollout", r), ("worker.rollout.val_override", r.val_override)):
        if sampling.temperature == 0 and sampling.n > 1:
            raise ConfigError(f"{key}.n", sampling.n,
                              f"{key}.temperature=0 is greedy: every one of the n responses would be the same",
                              f"set {key}.n=1 or a temperature > 0")
    truncated = r.top_p < 1 or r.top_k > 0
    a = cfg.algorithm
    if (r.engine == "vllm" and truncated and not a.use_kl_loss and a.kl_coef > 0
            and cfg.worker.actor.reuse_log_probs_on_policy):
        raise ConfigError("worker.actor.reuse_log_probs_on_policy", True,
                          "with top_p/top_k vLLM reports log-probs of the truncated distribution, and the KL in "
                          "the reward (algorithm.use_kl_loss=false) needs the actor's",
                          "set worker.actor.reuse_log_probs_on_policy=false (the actor recomputes them)")
    needed = cfg.data.max_prompt_length + cfg.data.max_response_length
    if r.max_model_len is not None and r.max_model_len < needed:
        raise ConfigError("worker.rollout.max_model_len", r.max_model_len,
                          f"shorter than data.max_prompt_length + data.max_response_length = {needed}",
                          f"set it to at least {needed} or null")
    if r.engine == "vllm" and cfg.data.video_key:
        raise ConfigError("data.video_key", cfg.data.video_key, "easytrain's vLLM engine is given a prompt's images, "
                          "not yet its videos' frames", "set worker.rollout.engine=hf for video data (docs/data.md)")
    if r.engine == "vllm" and importlib.util.find_spec("vllm") is None:
        raise ConfigError("worker.rollout.engine", "vllm", "vLLM is not installed in this environment",
                          "bash scripts/install.sh cpu (or gpu), i.e. pip install -e .[cpu] / .[gpu]; "
                          "or set worker.rollout.engine=hf")


def _check_multi_turn(cfg: Config) -> None:
    m = cfg.worker.rollout.multi_turn
    if not m.enable:
        return
    if not m.tools:
        raise ConfigError("worker.rollout.multi_turn.tools", m.tools, "multi-turn rollouts continue after tool "
                          "calls, and no tool is given", "list tools as path/to/file.py:name or module:name")


def torchvision_error() -> str:
    """Why ``import torchvision`` fails in this environment, in one line ('' when it imports). PyPI's torchvision
    beside the CPU torch imports only once ``scripts/torchvision_guard.py`` has run (docs/rollout.md)."""
    try:
        import torchvision  # noqa: F401
    except Exception as err:  # noqa: BLE001 - an unguarded torchvision raises RuntimeError from torch.library
        lines = str(err).strip().splitlines()
        return f"{type(err).__name__}: {lines[-1] if lines else ''}"
    return ""


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def resolve_attention(cfg: Config) -> None:
    """``model.attn_implementation=auto`` becomes ``flash_attention_2`` on a GPU run where flash-attn is
    installed, else ``sdpa`` (what the presets ask for); ``flash_attention_2`` itself needs both."""
    m, cuda = cfg.model, cfg.trainer.device == "cuda"
    if m.attn_implementation == "auto":
        m.attn_implementation = "flash_attention_2" if cuda and flash_attn_installed() else "sdpa"
        logger.info("model.attn_implementation=auto: %s", m.attn_implementation)
    elif m.attn_implementation == "flash_attention_2" and not cuda:
        raise ConfigError("model.attn_implementation", m.attn_implementation, "flash-attention runs on CUDA GPUs only",
                          "use sdpa (or auto) with trainer.device=cpu")
    elif m.attn_implementation == "flash_attention_2" and not flash_attn_installed():
        raise ConfigError("model.attn_implementation", m.attn_implementation, "flash-attn is not installed here",
                          "pip install flash-attn --no-build-isolation (built for this torch and CUDA), "
                          "or use sdpa or auto")


def _check_model(cfg: Config) -> None:
    m = cfg.model
    if m.lora.rank > 0 and not m.lora.target_modules:
        raise ConfigError("model.lora.target_modules", m.lora.target_modules,
                          "LoRA is on (model.lora.rank>0) but adapts nothing",
                          "list module names, e.g. [q_proj,v_proj], or [all-linear]")
    if m.freeze_llm and m.freeze_vision_tower and m.freeze_aligner and m.lora.rank == 0:
        raise ConfigError("model.freeze_llm", True,
                          "with the vision tower and aligner also frozen and LoRA off, nothing is trained",
                          "unfreeze a part or set model.lora.rank>0")
    if m.dtype == "float16" and cfg.trainer.device == "cpu":
        raise ConfigError("model.dtype", m.dtype, "float16 training is not supported on CPU",
                          "use float32 or bfloat16")
    if m.path.startswith(RANDOM_PREFIX):
        random_hf_config(m.path)  # an unknown name raises the error, listing conf/model/'s names
    betas = cfg.worker.actor.optim.betas
    if len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
        raise ConfigError("worker.actor.optim.betas", betas, "AdamW needs two betas in [0, 1)",
                          "e.g. worker.actor.optim.betas=[0.9,0.999]")
    if cfg.worker.actor.clip_ratio_low >= 1.0:
        raise ConfigError("worker.actor.clip_ratio_low", cfg.worker.actor.clip_ratio_low,
                          "must be < 1 (the ratio's lower bound is 1 - clip_ratio_low)", "0.2 is usual")


def _check_trainer(cfg: Config) -> None:
    t = cfg.trainer
    for i, name in enumerate(t.loggers):
        if name not in LOGGERS:
            raise ConfigError(f"trainer.loggers[{i}]", name, "unknown logger", f"use any of {', '.join(LOGGERS)}")
        package = LOGGER_PACKAGES.get(name)
        if package is not None and importlib.util.find_spec(package) is None:
            raise ConfigError(f"trainer.loggers[{i}]", name, f"the {package} package is not installed",
                              f"pip install {package}, or leave {name} out of trainer.loggers")
    for key in ("max_steps", "val_freq", "save_limit"):
        if getattr(t, key) == 0:
            raise ConfigError(f"trainer.{key}", 0, "0 is not allowed", "use -1 to turn it off, or a positive number")
    if t.save_freq == 0 and t.export_final:
        raise ConfigError("trainer.export_final", True, "exports the final checkpoint, and trainer.save_freq=0 "
                          "saves none", "set trainer.save_freq=-1 (save at the end only) or export_final=false")
    if t.checkpoint_host_buffer_gb <= 0 and t.checkpoint_host_buffer_gb != -1:
        raise ConfigError("trainer.checkpoint_host_buffer_gb", t.checkpoint_host_buffer_gb,
                          "must be positive, or -1 to size it from the node", "e.g. 1 (GB per process)")
    if t.async_queue_gb <= 0 and t.async_queue_gb != -1:
        raise ConfigError("trainer.async_queue_gb", t.async_queue_gb, "must be positive (the async queue's host GB), "
                          "or -1 for the room the plan leaves", "e.g. 4")
    if t.checkpoint_async and cfg.worker.actor.strategy != "fsdp":
        raise ConfigError("trainer.checkpoint_async", True, f"background saves need worker.actor.strategy=fsdp, not "
                          f"{cfg.worker.actor.strategy}", "set trainer.checkpoint_async=false")


RELIEF_ACTIONS = ("free_caches", "sleep_rollout", "offload_ref", "halve_micro_batch")


def _check_watchdog(cfg: Config) -> None:
    w = cfg.watchdog
    for kind in ("ram", "vram"):
        warn, soft, hard = (getattr(w, f"{kind}_{level}") for level in ("warn", "soft", "hard"))
        if warn > soft:
            raise ConfigError(f"watchdog.{kind}_warn", warn, f"must not exceed watchdog.{kind}_soft={soft}",
                              f"lower watchdog.{kind}_warn")
        if soft >= hard:
            raise ConfigError(f"watchdog.{kind}_soft", soft,
                              f"must be below watchdog.{kind}_hard={hard} (relief comes before the stop)",
                              f"lower watchdog.{kind}_soft or raise watchdog.{kind}_hard")
    kill = ray_kill_threshold()
    if w.enabled and w.ram_limit_gb is None and w.ram_hard >= kill:
        raise ConfigError("watchdog.ram_hard", w.ram_hard,
                          f"must stay below Ray's memory kill threshold {kill} (RAY_memory_usage_threshold): Ray "
                          "would kill a worker before the watchdog could save", f"use a value below {kill}")
    if w.ram_scope == "run" and w.ram_limit_gb is None:
        raise ConfigError("watchdog.ram_scope", w.ram_scope, "judges this run's processes against a share of the "
                          "node, and no share is set", "set watchdog.ram_limit_gb (or use watchdog.ram_scope=node)")
    for action in w.actions:
        if action not in RELIEF_ACTIONS:
            raise ConfigError("watchdog.actions", action, "not a relief action",
                              f"use any of {', '.join(RELIEF_ACTIONS)}")


def _check_launch(cfg: Config) -> None:
    la = cfg.launch
    if la.name is not None and (not DNS_LABEL.fullmatch(la.name) or len(la.name) > RAYJOB_NAME_MAX):
        raise ConfigError("launch.name", la.name, f"not a valid RayJob name (lowercase letters, digits and '-', "
                          f"starting with a letter, at most {RAYJOB_NAME_MAX} characters)",
                          "e.g. launch.name=vl-grpo")
    if not DNS_LABEL.fullmatch(la.namespace) or len(la.namespace) > 63:
        raise ConfigError("launch.namespace", la.namespace, "not a valid Kubernetes namespace", "e.g. default")
    for key in ("volume_claim", "auth_secret", "service_account"):
        value = getattr(la, key)
        if value is not None and (not DNS_SUBDOMAIN.fullmatch(value) or len(value) > 253):
            raise ConfigError(f"launch.{key}", value, "not a valid Kubernetes name",
                              "use lowercase letters, digits, '-' and '.'")
    path = la.volume_mount_path
    if not path.startswith("/") or os.path.normpath(path) in ("/", "/dev/shm", "/tmp"):
        raise ConfigError("launch.volume_mount_path", path, "must be an absolute folder other than /, /tmp and "
                          "/dev/shm", "e.g. /mnt/easytrain")
    if not la.image.strip():
        raise ConfigError("launch.image", la.image, "is empty", "name the image built from docker/Dockerfile")
    for env, ref in la.secret_env.items():
        secret, _, key = str(ref).partition("/")
        if not ENV_NAME.fullmatch(env):
            raise ConfigError(f"launch.secret_env.{env}", ref, "not a valid environment variable name")
        if not (DNS_SUBDOMAIN.fullmatch(secret) and SECRET_KEY.fullmatch(key)):
            raise ConfigError(f"launch.secret_env.{env}", ref, "must be SECRET/KEY: a Kubernetes Secret's name "
                              "and the key within it", f"e.g. +launch.secret_env.{env}=my-secret/token")
    for env, value in la.env_vars.items():
        if not ENV_NAME.fullmatch(env):
            raise ConfigError(f"launch.env_vars.{env}", value, "not a valid environment variable name")
        if looks_secret(env) or env.startswith("RAY_AUTH_"):
            raise ConfigError(f"launch.env_vars.{env}", NO_VALUE, "looks like a credential; it would be stored in "
                              "plain text in the job's runtime env and the manifests",
                              f"put it in a Kubernetes Secret and name it in launch.secret_env.{env}=SECRET/KEY, or "
                              "for Ray Jobs export it on the cluster's nodes")
        if env == "RAY_memory_usage_threshold":
            raise ConfigError(f"launch.env_vars.{env}", value, "is set on the nodes, not per job: easytrain takes "
                              "Ray's kill threshold from the environment it is launched from, where the watchdog "
                              "checks watchdog.ram_hard against it", f"export {env}={value} before launching")
    t = cfg.trainer
    if la.worker_memory_gb is not None and t.node_memory_gb is not None and la.worker_memory_gb > t.node_memory_gb:
        raise ConfigError("launch.worker_memory_gb", la.worker_memory_gb,
                          f"a worker pod cannot have more memory than its node (trainer.node_memory_gb="
                          f"{t.node_memory_gb})", "lower it, or leave it null (90% of the node)")


def _check_reward(cfg: Config) -> None:
    from easytrain.rewards.registry import REGISTRY

    spec = cfg.reward.function
    if spec in REGISTRY:
        return
    if ":" not in spec:
        raise ConfigError("reward.function", spec, "not a registered reward",
                          f"use one of {', '.join(REGISTRY)}, or path/to/file.py:name, or package.module:name")


def _check_against_shape(cfg: Config, shape: ModelShape) -> None:
    heads, kv = shape.num_attention_heads, shape.num_key_value_heads
    for name, role in _roles(cfg):
        u = role.ulysses_size
        if u == 1:
            continue
        if heads % u:
            raise ConfigError(f"worker.{name}.ulysses_size", u,
                              f"must divide the model's {heads} attention heads (model.path={cfg.model.path})",
                              f"use one of {_divisors(heads)}")
        if kv % u and u % kv:
            raise ConfigError(f"worker.{name}.ulysses_size", u,
                              f"the model's {kv} key/value heads neither divide by it nor divide it "
                              "(fewer KV heads are replicated across the group only when they divide it)",
                              f"use a divisor or multiple of {kv} that divides {heads}")
    if not shape.is_vision and cfg.data.video_key:
        raise ConfigError("data.video_key", cfg.data.video_key,
                          f"model.path={cfg.model.path} is a text-only model ({shape.family}) and cannot take videos",
                          "set data.video_key=null")
    if not shape.is_vision and cfg.data.image_key:
        raise ConfigError("data.image_key", cfg.data.image_key,
                          f"model.path={cfg.model.path} is a text-only model ({shape.family}) and cannot take images",
                          "set data.image_key=null (the synthetic task then uses its text-only variant)")
    if cfg.worker.rollout.engine == "vllm" and cfg.trainer.device == "cpu" and shape.is_vision:
        broken = torchvision_error()
        if broken:
            raise ConfigError("worker.rollout.engine", "vllm",
                              f"vLLM's {shape.family} code imports torchvision, which fails here ({broken})",
                              "run `.venv/bin/python scripts/torchvision_guard.py` (bash scripts/install.sh cpu "
                              "applies it), or set worker.rollout.engine=hf")
    total = cfg.data.max_prompt_length + cfg.data.max_response_length
    if total > shape.max_position_embeddings:
        raise ConfigError("data.max_response_length", cfg.data.max_response_length,
                          f"prompt + response = {total} tokens exceeds the model's "
                          f"{shape.max_position_embeddings} positions",
                          "lower data.max_prompt_length or data.max_response_length")
