"""Where the RL roles run and what the rollout engine holds in each phase of a step.

With ``trainer.colocate=true`` the workers are fused: one process per
device hosts the actor, the reference (or, with LoRA, the actor with its
adapters disabled) and the rollout engine, so a GPU carries one CUDA context
and a node one framework overhead per device, and the phases take the device
in the order :data:`easytrain.memory.phases.STEP` defines (the plan reads it
from there, never restates it). With ``colocate=false`` every role has its own
pool: one process per role per device, as many devices per role.

What the engine holds on the device during a phase follows the phase's
``engine`` state:

- ``awake``: weights and KV cache (vLLM on GPU: ``gpu_memory_utilization`` x
  the GPU; the HF engine: weights plus the generation's KV cache, logits and
  prefill while it generates);
- ``weights``: woken for the sync, weights only (its tensor-parallel share
  in ``model.dtype``), no KV cache;
- ``asleep``: what its sleep level keeps: level 2 nothing; level 1 nothing
  on the device, its weights in host RAM until they wake; level 0, and
  engines that cannot sleep (vLLM on CPU, the HF engine on CPU at level 1,
  any engine without colocated roles), everything stays.

The weight sync on fused workers gathers FSDP2's shards bucket by bucket
into full tensors on the device, in the engine's dtype, and loads them into
the engine in the same process: one gathered bucket on the device, nothing
on the host. Without colocated roles the buckets cross processes through
Ray's object store (host RAM). At load one process per node reads the
checkpoint (one whole fp32 copy in host RAM) and the others receive their
shards; engines read their own weights straight onto the device.
"""

from __future__ import annotations

from typing import Iterator

from easytrain.config.schema import Config
from easytrain.memory.phases import STEP, Phase

AWAKE, WEIGHTS, ASLEEP = "awake", "weights", "asleep"
VALIDATION = Phase("validation", "rollout", AWAKE, "validation")
"""Validation is no part of a training step: the engine generates, awake, as in ``generate``."""


def fused(config: Config) -> bool:
    """Whether one process per device hosts every role (``trainer.colocate``)."""
    return config.trainer.colocate


def role_names(with_ref: bool) -> list[str]:
    """The roles with a process of their own without colocation (with LoRA the actor serves the reference)."""
    return ["actor", "rollout"] + (["ref"] if with_ref else [])


def processes_per_device(config: Config, with_ref: bool) -> int:
    """Worker processes on one device: one fused process, or one per role."""
    return 1 if fused(config) else len(role_names(with_ref))


def sleep_level(config: Config, on_gpu: bool) -> int:
    """The sleep level the engine really uses: only fused workers sleep; vLLM on GPU only, the HF engine on GPU
    at either level and on CPU at level 2 (level 1 would move its weights to where they already are)."""
    r = config.worker.rollout
    if not config.trainer.colocate:
        return 0
    if r.engine == "vllm":
        return r.sleep_level if on_gpu else 0
    return r.sleep_level if on_gpu or r.sleep_level == 2 else 0


def engine_weights(config: Config, total_params: int, dtype_bytes: int) -> int:
    """The engine's weights on one device: its tensor-parallel share in ``model.dtype``."""
    return -(-total_params // config.worker.rollout.tensor_parallel_size) * dtype_bytes


def engine_held(config: Config, state: str, awake: dict[str, int], resident: dict[str, int], weights: int,
                on_gpu: bool) -> tuple[dict[str, int], dict[str, int]]:
    """(device, host) bytes one engine process holds in engine ``state``: ``awake`` is what it holds while
    generating, ``resident`` what an engine that never sleeps keeps between rollouts, ``weights`` its weights
    on one device."""
    level = sleep_level(config, on_gpu)
    if state == AWAKE:
        return dict(awake), {}
    if level == 0:  # it never sleeps: everything stays
        return dict(resident), {}
    if state == WEIGHTS:
        return {"rollout weights (woken)": weights}, {}
    return {}, ({"rollout weights (asleep, level 1)": weights} if level == 1 else {})


def step_phases(planned: set[str]) -> Iterator[Phase]:
    """The step's phases that have a plan row, in the order they run (:data:`STEP`), then validation."""
    for p in STEP:
        if p.planned and p.planned in planned:
            yield p
    if VALIDATION.planned in planned:
        yield VALIDATION


def running_order(planned: set[str], sleeps: bool) -> list[str]:
    """The names of the step's phases this run has, in :data:`STEP`'s order: the planned ones it computes and,
    where the engine sleeps, its own transitions (sleep, wake_weights, wake_kv)."""
    return [p.name for p in STEP if (p.planned in planned if p.planned else sleeps)]


def sync_bucket(config: Config, largest_module: int, total_params: int, dtype_bytes: int) -> int:
    """One bucket of full tensors in the engine's dtype: ``sync_bucket_mb``, or the largest module when it is
    larger (a module never splits), and never more than the whole model."""
    bucket = max(int(config.worker.rollout.sync_bucket_mb * 2**20), largest_module * dtype_bytes)
    return min(bucket, total_params * dtype_bytes)


def sync_parts(config: Config, bucket: int, per_node: int) -> tuple[dict[str, int], dict[str, int]]:
    """(device, host per node) of the sync's transport: fused, the gathered bucket on the device and nothing on
    the host; across processes, each actor rank's share of a bucket on its way out and, in host RAM one being
    assembled per rollout process (the object store's pages are each process's own line from the first sync
    on: :func:`easytrain.memory.planner.object_store_pages`)."""
    if fused(config):
        return {"gathered bucket (engine dtype)": bucket}, {}
    return {"sync bucket": bucket}, {"sync bucket (assembly)": per_node * bucket}


def layout_note(config: Config, with_ref: bool, ref_by_actor: bool, on_gpu: bool, planned: set[str]) -> str:
    """The process layout and the step's phase order, in words."""
    device = "GPU" if on_gpu else "CPU worker"
    level = sleep_level(config, on_gpu)
    order = " -> ".join(running_order(planned, level > 0))
    if fused(config):
        ref = ("the reference (the actor with its LoRA adapters off)" if ref_by_actor
               else "the reference" if with_ref else "no reference")
        sleeps = (f"the engine sleeps (level {level}) from sleep to wake_weights, then holds its weights alone for "
                  "the sync" if level else "the engine keeps its memory between rollouts (no sleep here)")
        return (f"layout: fused workers, one process per {device} hosting the actor, {ref} and the rollout engine "
                f"(one {'CUDA context' if on_gpu else 'framework overhead'} per {device}); step order: {order}; "
                f"{sleeps}; validation generates with the engine awake")
    roles = ", ".join(role_names(with_ref))
    return (f"layout: a device pool per role ({roles}), each role its own process on each of its {device}s; "
            f"step order: {order}; weights reach the engine through the object store")
