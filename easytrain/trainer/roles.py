"""Placing the roles on the cluster, and their worker groups.

With ``trainer.colocate=true`` (the default) each device gets one fused worker process hosting the actor, the
reference and the rollout engine (:mod:`easytrain.workers.fused`); the driver's per-role groups are views of
that one group, so they address the same processes. With ``colocate=false`` each role gets its own pool: its
own processes on its own devices. Either way a pool is one placement-group bundle per device and rank i of a
group runs on bundle i (:mod:`easytrain.distributed.resources`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional

from easytrain.config.schema import Config
from easytrain.config.derived import needs_reference
from easytrain.distributed.group import WorkerGroup
from easytrain.distributed.resources import ResourcePool
from easytrain.workers.actor import ActorWorker
from easytrain.workers.fused import FusedWorker
from easytrain.workers.reference import ReferenceWorker
from easytrain.workers.reward_pool import RewardPool
from easytrain.workers.rollout.worker import RolloutWorker
from easytrain.workers.weight_sync import BucketedTransport, InProcessTransport, WeightTransport

logger = logging.getLogger(__name__)

ROLE_CLASSES: dict[str, type] = {"actor": ActorWorker, "rollout": RolloutWorker, "ref": ReferenceWorker}
ENV = {"TOKENIZERS_PARALLELISM": "false"}


@dataclass
class Roles:
    actor: WorkerGroup
    ref: Optional[WorkerGroup]
    """The reference group; None when there is no KL term or when the actor serves it (LoRA)."""
    rollout: Optional[WorkerGroup]
    """None in SFT runs (generation samples come from the actor)."""
    rewards: Optional[RewardPool]
    transport: Optional[WeightTransport]
    pools: list[ResourcePool]
    lora_reference: bool = False
    rollout_sleeps: bool = False
    """The engine frees its device memory after each rollout (fused workers whose engine can sleep)."""
    drops_weights: bool = False
    """Its sleep drops the weights (level 2): they come back only through a sync."""
    engine_asleep: set[str] = field(default_factory=set)
    """What the engine's last sleep freed that no wake has brought back (``weights``, ``kv_cache``)."""
    engine_stale: bool = False
    """A sleep dropped the engine's weights and no sync has refilled them."""
    fused: Optional[WorkerGroup] = None
    """The fused workers' own group (one process per device) when the role groups are views of it."""
    actor_model: dict[str, int] = field(default_factory=dict)
    """Rank 0's answer to the actor's ``setup``: parameter counts and what the micro-batch plan needs to know
    of the model (``shares_prompt``, ``hidden_size``)."""

    @property
    def reference(self) -> Optional[WorkerGroup]:
        """Whichever group answers compute_ref_log_probs, if any."""
        if self.ref is not None:
            return self.ref
        return self.actor if self.lora_reference else None

    # ------------------------------------------------------------------ the engine's device hand-offs

    def sleep_engine(self) -> int:
        """Hand the device to the training roles: the engine frees its weights and KV cache (where it can
        sleep, and its weights are awake); bytes freed."""
        if not self.rollout_sleeps or "weights" in self.engine_asleep:
            return 0
        freed = int(sum(self.rollout.call("sleep")))
        self.engine_asleep, self.engine_stale = {"weights", "kv_cache"}, self.drops_weights
        return freed

    def wake_engine(self, generate: bool) -> None:
        """Before a sync (``generate=False``) the engine takes back its weights' room; before generating also its
        KV cache, and weights a sleep dropped are refilled from the actor first (a sync: only after a sleep
        between steps, the watchdog's relief)."""
        if "weights" in self.engine_asleep:
            self.rollout.call("wake", ["weights"])
            self.engine_asleep.discard("weights")
        if generate and self.engine_stale:
            self.sync()
        if generate and "kv_cache" in self.engine_asleep:
            self.rollout.call("wake", ["kv_cache"])
            self.engine_asleep.discard("kv_cache")

    def sync(self) -> dict[str, float]:
        """The actor's weights into the engine (its weights woken first); the sync's metrics."""
        assert self.transport is not None and self.rollout is not None
        self.wake_engine(generate=False)
        synced = self.transport.sync(self.actor, self.rollout)
        self.engine_stale = False
        return synced

    # ------------------------------------------------------------------ processes

    def processes(self) -> dict[str, WorkerGroup]:
        """The run's worker processes by group name, each process once: ``worker`` (fused), or one group per role."""
        if self.fused is not None:
            return {"worker": self.fused}
        return {name: g for name, g in (("actor", self.actor), ("ref", self.ref), ("rollout", self.rollout))
                if g is not None}

    def groups(self) -> list[WorkerGroup]:
        """The worker groups whose processes make up the run (for process-wide calls: memory, caches)."""
        return list(self.processes().values())

    def dead_workers(self) -> list[str]:
        """Role, rank and node of every training or rollout worker Ray reports dead."""
        return [f"{group.role} rank {rank} on node {ip}" for group in self.groups()
                for rank, ip in group.dead_ranks()] + (self.rewards.dead() if self.rewards else [])

    def shutdown(self) -> None:
        for group in self.groups():
            group.shutdown()
        if self.rewards is not None:
            self.rewards.shutdown()
        for pool in self.pools:
            pool.release()


def build_sft_roles(config: Config, total_optimizer_steps: int) -> Roles:
    """The one role of an SFT run: the actor on every device of its pool (its own process group)."""
    from easytrain.workers.sft import SFTWorker

    actor, pool = start_sft_group(config, SFTWorker)
    actor.init_process_group()
    sizes = actor.call("setup", total_optimizer_steps)
    logger.info("actor: %s parameters (%s trainable) on %d rank(s), strategy %s", sizes[0]["total"],
                sizes[0]["trainable"], actor.world_size, config.worker.actor.strategy)
    return Roles(actor, None, None, None, None, [pool])


def start_sft_group(config: Config, cls: type) -> tuple[WorkerGroup, ResourcePool]:
    """The SFT actor group, started but not set up: one worker per device of its pool."""
    t = config.trainer
    pool = ResourcePool("sft", t.nnodes, t.workers_per_node, t.device)
    return WorkerGroup(cls, "actor", pool, num_cpus=1.0, num_gpus=1.0 if t.device == "cuda" else 0.0,
                       init_args=(config,), env=ENV, block_size=config.worker.actor.ulysses_size), pool


def start_groups(config: Config, fused_cls: type = FusedWorker,
                 classes: Optional[dict[str, type]] = None) -> tuple[dict[str, WorkerGroup], list[ResourcePool],
                                                                     Optional[WorkerGroup]]:
    """The RL roles' worker groups, started but not set up: (groups by role, pools, the fused group or None).
    Each worker takes one device (a CPU share on CPU) of its pool."""
    t, w = config.trainer, config.worker
    classes = classes or ROLE_CLASSES
    names = ["actor", "rollout"] + (["ref"] if needs_reference(config) else [])
    blocks = {"actor": w.actor.ulysses_size, "rollout": w.rollout.tensor_parallel_size, "ref": w.ref.ulysses_size}
    gpus = 1.0 if t.device == "cuda" else 0.0
    if t.colocate:
        pool = ResourcePool("fused", t.nnodes, t.workers_per_node, t.device)
        fused = WorkerGroup(fused_cls, "worker", pool, num_cpus=1.0, num_gpus=gpus, init_args=(config,), env=ENV)
        return {name: fused.view(name, blocks[name]) for name in names}, [pool], fused
    pools = {name: ResourcePool(name, t.nnodes, t.workers_per_node, t.device) for name in names}
    groups = {name: WorkerGroup(classes[name], name, pools[name], num_cpus=1.0, num_gpus=gpus, init_args=(config,),
                                env=ENV, block_size=blocks[name]) for name in names}
    return groups, list(pools.values()), None


def build_roles(config: Config, total_optimizer_steps: int) -> Roles:
    """Create pools and groups, start process groups, load models (in parallel across separate roles)."""
    groups, pools, fused = start_groups(config)
    actor, rollout, ref = groups["actor"], groups["rollout"], groups.get("ref")
    if fused is not None:  # one world per process: actor, reference and vLLM's external launcher share it
        fused.init_process_group()
    else:
        for group in (actor, ref):
            if group is not None:
                group.init_process_group()
        if rollout.block_size > 1:
            rollout.init_blocks()
    if fused is not None:  # every role of a process in one call
        setup = fused.call("setup", total_optimizer_steps)[0]
    else:  # the roles' processes load their models in parallel
        pending = {name: group.submit("setup", *([total_optimizer_steps] if name == "actor" else []))
                   for name, group in groups.items()}
        setup = {name: groups[name].collect(p)[0] for name, p in pending.items()}
    logger.info("actor: %s parameters (%s trainable) on %d rank(s); rollout engine %s; reference %s; %s",
                setup["actor"]["total"], setup["actor"]["trainable"], actor.world_size, setup["rollout"]["engine"],
                "on" if ref else "off",
                "one fused process per device" if fused is not None else "a pool of processes per role")
    bucket_mb = config.worker.rollout.sync_bucket_mb
    transport = InProcessTransport(fused, bucket_mb) if fused is not None else BucketedTransport(bucket_mb)
    return Roles(actor, ref, rollout, RewardPool(config.reward), transport, pools,
                 lora_reference=config.model.lora.rank > 0 and config.algorithm.kl_coef > 0,
                 rollout_sleeps=bool(setup["rollout"]["can_sleep"]),
                 drops_weights=config.worker.rollout.sleep_level == 2, fused=fused, actor_model=setup["actor"])
