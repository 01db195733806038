"""What to change when the plan does not fit: ranked single changes, and a search for a setting that fits.

Every suggestion is re-planned: its effect is the difference between the two
plans, never an estimate of its own. ``fit`` searches the knobs that change
speed but not the training result (micro batch sizes, offload per role,
gradient checkpointing, vLLM's memory fraction) in this cost order, most
valued first:

1. a larger update micro batch (fewer, larger backward passes),
2. the actor not offloaded (offload copies states over PCIe every step),
3. no recomputation (gradient checkpointing costs ~30% of the update),
4. a larger experience micro batch (log-prob passes),
5. the reference not offloaded,
6. a higher ``gpu_memory_utilization`` (more sequences decoded at once).

With ``worker.actor.padding_free`` the micro batches of the update and of
the log-prob passes are token budgets: ``max_token_len_per_device`` (halved,
never below one longest sample, ``data.max_prompt_length +
data.max_response_length``) takes the place of both micro batch sizes, and
without it packing is suggested (a budget of one longest sample).

The first setting in that order that fits is the answer. Changes that alter
what is trained (fewer image pixels, a frozen vision tower, LoRA) are
suggested but never chosen by the search.

An SFT run (``trainer.task=sft``) has no rollout engine, reference or
reward workers, so only the actor's knobs are proposed and searched, most
valued first: a larger update micro batch (or, padding-free, a larger token
budget per pack), parameters not offloaded (FSDP's ``offload.params``,
ZeRO-3's ``offload_params``), the optimizer not offloaded (DeepSpeed: the
step would run on the CPU), no recomputation, and last the lowest ZeRO stage
(a higher one only adds communication).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from easytrain.config import with_overrides
from easytrain.config.schema import Config
from easytrain.data.profile import pixel_values
from easytrain.memory.data_shape import DataCosts
from easytrain.memory.planner import GB, Capacity, Plan, plan

TIGHT = 0.10


@dataclass(frozen=True)
class Suggestion:
    overrides: dict[str, Any]
    device_delta: int
    """Change of the device peak (bytes per GPU, or per worker process on CPU); negative = less."""
    host_delta: int
    """Change of the host peak (bytes per node)."""
    fits: bool
    """Whether the plan fits after this change alone."""
    why: str
    phase_deltas: dict[str, int]
    """Change of each phase that is over (or within 10% of) capacity on the device, where it moved."""

    def describe(self, on_gpu: bool) -> str:
        keys = " ".join(f"{k}={override_value(v)}" for k, v in self.overrides.items())
        unit = "per GPU" if on_gpu else "per worker"
        effect = f"peak {self.device_delta / GB:+.1f} GB {unit}, {self.host_delta / GB:+.1f} GB host per node"
        phases = ", ".join(f"{phase} {delta / GB:+.1f} GB" for phase, delta in self.phase_deltas.items())
        return f"{keys}: {effect}{'; ' + phases if phases else ''}{' (fits)' if self.fits else ''} - {self.why}"


def override_value(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def get(config: Config, key: str) -> Any:
    obj: Any = config
    for part in key.split("."):
        obj = getattr(obj, part)
    return obj


def _needs(p: Plan) -> tuple[bool, bool]:
    """(device, host): which side is over capacity or within TIGHT of it, in a step or a once-only phase."""
    once_device, once_host = p.once_headroom()
    device = any(h is not None and h < TIGHT for h in (p.device_headroom, once_device))
    return device, min(p.host_headroom, once_host) < TIGHT


def candidates(config: Config, p: Plan) -> Iterator[tuple[dict[str, Any], str]]:
    """Single changes worth pricing, cheapest first, with what each costs."""
    if config.trainer.task == "sft":
        yield from sft_candidates(config, p)
        return
    a, r, m, d = config.worker.actor, config.worker.rollout, config.model, config.data
    on_gpu, vllm_gpu = p.on_gpu, p.on_gpu and r.engine == "vllm"
    device, host = _needs(p)
    if device or not on_gpu:
        if vllm_gpu and p.row("generation").device == p.device_peak and r.gpu_memory_utilization > 0.3:
            yield ({"worker.rollout.gpu_memory_utilization": round(r.gpu_memory_utilization - 0.1, 2)},
                   "fewer sequences decoded at once")
        yield from micro_batch_candidates(config)
        if not m.gradient_checkpointing:
            yield {"model.gradient_checkpointing": True}, "recomputes activations: ~30% slower update"
        if vllm_gpu and r.sleep_level == 0 and config.trainer.colocate:
            yield {"worker.rollout.sleep_level": 2}, "the engine reloads its weights at each sync"
        if on_gpu and not config.worker.ref.offload.params:
            yield {"worker.ref.offload.params": True}, "reference weights copied in for each pass"
        if on_gpu and not a.offload.params:
            yield {"worker.actor.offload.params": True}, "actor states stream over PCIe every step: slower update"
        yield from pixel_candidates(config, p)
        if not m.freeze_vision_tower:
            yield {"model.freeze_vision_tower": True}, "changes training: the vision tower stops learning"
    if host:
        if on_gpu and a.offload.params:
            yield {"worker.actor.offload.params": False}, "actor states move back to the GPUs"
        if on_gpu and config.worker.ref.offload.params:
            yield {"worker.ref.offload.params": False}, "reference weights move back to the GPUs"
        yield from pixel_candidates(config, p)
        if d.num_workers > 0:
            yield {"data.num_workers": d.num_workers // 2}, "fewer loader processes: slower image preparation"
        if r.sync_bucket_mb > 16:
            yield {"worker.rollout.sync_bucket_mb": r.sync_bucket_mb / 4}, "more, smaller weight-sync transfers"


def pixel_candidates(config: Config, p: Plan) -> Iterator[tuple[dict[str, Any], str]]:
    """Smaller ``data.max_pixels``: with a data profile, the values its table compares (the largest first), each
    with the share of training rows it keeps at full size; without one, a quarter of the pixels."""
    d = config.data
    if not d.image_key:
        return
    profiles = p.data.profiles if p.data is not None else ()
    if not profiles:
        if d.max_pixels // 4 >= d.min_pixels:
            yield {"data.max_pixels": d.max_pixels // 4}, "changes the data: images downscaled to 1/4 of the pixels"
        return
    train = profiles[0]
    smaller = [row for row in train.pixel_candidates(pixel_values(train)) if row["max_pixels"] < d.max_pixels]
    for row in sorted(smaller, key=lambda r: -r["max_pixels"]):
        yield ({"data.max_pixels": row["max_pixels"]},
               f"changes the data: {100 * row['unscaled_share']:.0f}% of the {train.split} rows keep their images' "
               f"full size (vision tokens p99 {row['vision_tokens_p99']} per row)")


def micro_batch_candidates(config: Config) -> Iterator[tuple[dict[str, Any], str]]:
    """Smaller micro batches: padding-free, half the token budget (not below one longest sample); padded, half the
    micro batch sizes (RL: the log-prob passes' too), or packing up to one longest sample's tokens."""
    a, d, rl = config.worker.actor, config.data, config.trainer.task == "rl"
    longest = d.max_prompt_length + d.max_response_length
    if a.padding_free:
        if a.max_token_len_per_device // 2 >= longest:
            yield ({"worker.actor.max_token_len_per_device": a.max_token_len_per_device // 2},
                   "smaller packs: more, shorter update and log-prob passes" if rl
                   else "smaller packs: more micro batches per optimizer step")
        return
    if rl and a.micro_batch_size_per_device_for_experience > 1:
        yield ({"worker.actor.micro_batch_size_per_device_for_experience":
                a.micro_batch_size_per_device_for_experience // 2}, "more, smaller log-prob passes")
    if a.micro_batch_size_per_device_for_update > 1:
        yield ({"worker.actor.micro_batch_size_per_device_for_update":
                a.micro_batch_size_per_device_for_update // 2}, "more gradient accumulation steps")
    if a.micro_batch_size_per_device_for_update > 1 or (rl and a.micro_batch_size_per_device_for_experience > 1):
        yield ({"worker.actor.padding_free": True, "worker.actor.max_token_len_per_device": longest},
               "packs of at most one longest sample's tokens: short samples share a micro batch, no padding")


def _changed(config: Config, overrides: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in overrides.items() if v != get(config, k)}


def _to_deepspeed(config: Config) -> dict[str, Any]:
    """FSDP to DeepSpeed ZeRO-3 with the optimizer in host RAM (FSDP2 offloads only parameters and optimizer
    together); FSDP's own offload keys must be off under DeepSpeed."""
    return _changed(config, {"worker.actor.strategy": "deepspeed", "worker.actor.deepspeed.zero_stage": 3,
                             "worker.actor.deepspeed.offload_optimizer": True, "worker.actor.offload.params": False,
                             "worker.actor.offload.optimizer": False})


def _data_and_training(config: Config, device: bool) -> Iterator[tuple[dict[str, Any], str]]:
    """SFT changes that alter the data or what is trained (suggested, never searched)."""
    m, d = config.model, config.data
    if d.image_key and d.max_pixels // 4 >= d.min_pixels:
        yield {"data.max_pixels": d.max_pixels // 4}, "changes the data: images downscaled to 1/4 of the pixels"
    if device and not m.freeze_vision_tower:
        yield {"model.freeze_vision_tower": True}, "changes training: the vision tower stops learning"
    if device and m.lora.rank == 0 and not m.freeze_llm:
        yield {"model.lora.rank": 16}, "changes training: only LoRA adapters on the language model learn"


def sft_candidates(config: Config, p: Plan) -> Iterator[tuple[dict[str, Any], str]]:
    """The SFT actor's single changes, cheapest first: nothing of a rollout engine, reference or reward."""
    a, m, d = config.worker.actor, config.model, config.data
    ds, z = a.strategy == "deepspeed", a.deepspeed
    device, host = _needs(p)
    if device or not p.on_gpu:
        yield from micro_batch_candidates(config)
        if not m.gradient_checkpointing:
            yield {"model.gradient_checkpointing": True}, "recomputes activations: ~30% slower forward/backward"
        if p.on_gpu and ds and p.has("setup") and p.row("setup").device > (1 - TIGHT) * (p.capacity.gpu_bytes or 0):
            yield {"worker.actor.strategy": "fsdp"}, "FSDP2 shards the model as it loads (no whole copy per GPU)"
        if p.on_gpu and ds:
            if z.zero_stage < 3:
                yield {"worker.actor.deepspeed.zero_stage": 3}, "parameters sharded too, gathered for each pass"
            if not z.offload_optimizer:
                yield {"worker.actor.deepspeed.offload_optimizer": True}, "the optimizer steps on the CPU: slower step"
            if z.zero_stage == 3 and not z.offload_params:
                yield ({"worker.actor.deepspeed.offload_params": True},
                       "parameters stream from host RAM for every pass: slower")
        if p.on_gpu and not ds:
            if a.fsdp.shard_size != -1:
                yield {"worker.actor.fsdp.shard_size": -1}, "shard over every rank: more traffic between nodes"
            if not a.fsdp.full_shard:
                yield {"worker.actor.fsdp.full_shard": True}, "parameters gathered again for backward"
            yield _to_deepspeed(config), "DeepSpeed ZeRO-3, the optimizer in host RAM: it steps on the CPU"
            if not a.offload.params:
                yield {"worker.actor.offload.params": True}, "actor states stream over PCIe every step: slower"
        yield from _data_and_training(config, device=True)
    if host:
        if p.on_gpu and ds and z.offload_params:
            yield {"worker.actor.deepspeed.offload_params": False}, "parameters move back to the GPUs"
        if p.on_gpu and ds and z.offload_optimizer:
            yield {"worker.actor.deepspeed.offload_optimizer": False}, "optimizer states move back to the GPUs"
        if p.on_gpu and not ds and a.offload.params:
            yield {"worker.actor.offload.params": False}, "actor states move back to the GPUs"
        yield from _data_and_training(config, device=False)
        if d.num_workers > 0:
            yield {"data.num_workers": d.num_workers // 2}, "fewer loader processes: slower image preparation"


def _loads(p: Plan) -> bool:
    """Whether the once-only phases (the model build) fit."""
    return all(h is None or h >= 0 for h in p.once_headroom())


def suggestions(config: Config, p: Plan, hf_config: dict[str, Any]) -> list[Suggestion]:
    """Single changes that reduce the peak that is over (or within 10% of) capacity, or a phase that is,
    each re-planned; those that make the plan fit first, then in cost order."""
    device, host = _needs(p)
    if not (device or host):
        return []
    limit = p.capacity.gpu_bytes if p.on_gpu and p.capacity.gpu_bytes else None
    crowded = [r.phase for r in p.once + p.rows if limit and r.device > (1 - TIGHT) * limit]
    out, seen = [], []
    for overrides, why in candidates(config, p):
        if overrides in seen:
            continue
        seen.append(overrides)
        q = plan(with_overrides(config, overrides), hf_config, p.capacity, p.data)
        moved = {phase: q.row(phase).device - p.row(phase).device for phase in crowded
                 if q.has(phase) and q.row(phase).device != p.row(phase).device}
        s = Suggestion(overrides, q.device_peak - p.device_peak, q.host_peak - p.host_peak, q.fits, why, moved)
        helps = ((device and (s.device_delta < 0 or any(v < 0 for v in moved.values())))
                 or (host and s.host_delta < 0) or (not p.on_gpu and s.host_delta < 0))
        helps = helps and (_loads(q) or not _loads(p))  # not by a model that could no longer be loaded
        if helps:
            out.append(s)
    return sorted(out, key=lambda s: not s.fits)  # stable: cost order within each group


def _roomy(p: Plan) -> bool:
    """Fits with at least TIGHT headroom: the plan is an estimate, so --fit keeps a margin."""
    device, host = _needs(p)
    return p.fits and not device and not host


def _halvings(value: int) -> list[int]:
    out = [value]
    while out[-1] > 1:
        out.append(out[-1] // 2)
    return out


def update_knob(config: Config) -> tuple[str, list[Any]]:
    """The update's micro batch, largest first: padding-free the token budget's halvings down to one longest
    sample (which also sizes the log-prob passes), else the micro batch size's."""
    a, d = config.worker.actor, config.data
    if not a.padding_free:
        return ("worker.actor.micro_batch_size_per_device_for_update",
                _halvings(a.micro_batch_size_per_device_for_update))
    longest = d.max_prompt_length + d.max_response_length
    return ("worker.actor.max_token_len_per_device",
            [v for v in _halvings(a.max_token_len_per_device) if v >= longest] or [a.max_token_len_per_device])


def _sft_knobs(config: Config) -> list[tuple[str, list[Any]]]:
    """The SFT actor's search space, most valued first."""
    a, z = config.worker.actor, config.worker.actor.deepspeed
    on_gpu = config.trainer.device == "cuda"
    knobs = [update_knob(config)]
    checkpointing = ("model.gradient_checkpointing", sorted({config.model.gradient_checkpointing, False, True}))
    both = [False, True] if on_gpu else [False]
    if a.strategy == "deepspeed":
        stages = list(range(z.zero_stage, 4)) if on_gpu else [z.zero_stage]
        return knobs + [("worker.actor.deepspeed.offload_params", sorted({z.offload_params, *both})),
                        ("worker.actor.deepspeed.offload_optimizer", sorted({z.offload_optimizer, *both})),
                        checkpointing, ("worker.actor.deepspeed.zero_stage", stages)]
    return knobs + [("worker.actor.offload.params", sorted({a.offload.params, *both})), checkpointing]


def _valid(overrides: dict[str, Any], config: Config) -> bool:
    """Whether a searched combination is one the config validation accepts (ZeRO offloads parameters at
    stage 3 only)."""
    stage = overrides.get("worker.actor.deepspeed.zero_stage", config.worker.actor.deepspeed.zero_stage)
    params = overrides.get("worker.actor.deepspeed.offload_params", config.worker.actor.deepspeed.offload_params)
    return not (config.worker.actor.strategy == "deepspeed" and params and stage != 3)


def fit(config: Config, hf_config: dict[str, Any], capacity: Optional[Capacity] = None,
        data: Optional[DataCosts] = None) -> Optional[dict[str, Any]]:
    """The overrides of the first setting, in the documented cost order, whose plan (priced on ``data`` where
    given) fits with 10% headroom (empty if the config does as it is); None when no setting of these knobs fits."""
    if config.trainer.task == "sft":
        return _search(config, hf_config, capacity, _sft_knobs(config))
    a, r = config.worker.actor, config.worker.rollout
    on_gpu = config.trainer.device == "cuda"
    offload = [False, True] if on_gpu else [False]
    utils = ([round(r.gpu_memory_utilization - 0.1 * i, 2) for i in range(4) if r.gpu_memory_utilization - 0.1 * i >= 0.3]
             if on_gpu and r.engine == "vllm" else [r.gpu_memory_utilization])
    experience = ([] if a.padding_free else  # padding-free, the token budget sizes the log-prob passes too
                  [("worker.actor.micro_batch_size_per_device_for_experience",
                    _halvings(a.micro_batch_size_per_device_for_experience))])
    knobs = [update_knob(config),
             ("worker.actor.offload.params", sorted({a.offload.params, *offload})),
             ("model.gradient_checkpointing", sorted({config.model.gradient_checkpointing, False, True})),
             *experience,
             ("worker.ref.offload.params", sorted({config.worker.ref.offload.params, *offload})),
             ("worker.rollout.gpu_memory_utilization", utils)]
    return _search(config, hf_config, capacity, knobs, data)


def _search(config: Config, hf_config: dict[str, Any], capacity: Optional[Capacity],
            knobs: list[tuple[str, list[Any]]], data: Optional[DataCosts] = None) -> Optional[dict[str, Any]]:
    """The first combination of ``knobs`` (the first knob varies slowest) whose plan is roomy."""
    names = [k for k, _ in knobs]
    for values in itertools.product(*(v for _, v in knobs)):
        overrides = {k: v for k, v in zip(names, values) if v != get(config, k)}
        if _valid(overrides, config) and _roomy(plan(with_overrides(config, overrides), hf_config, capacity, data)):
            return overrides
    return None
