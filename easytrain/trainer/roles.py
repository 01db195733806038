"""Placing the roles on the cluster: one resource pool (colocated) or one per role, and their worker groups."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from easytrain.config.schema import Config
from easytrain.config.validate import needs_reference
from easytrain.distributed.group import WorkerGroup
from easytrain.distributed.resources import ResourcePool
from easytrain.workers.actor import ActorWorker
from easytrain.workers.reference import ReferenceWorker
from easytrain.workers.reward_pool import RewardPool
from easytrain.workers.rollout.worker import RolloutWorker
from easytrain.workers.weight_sync import BucketedTransport, WeightTransport

logger = logging.getLogger(__name__)


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
    """The engine frees its device memory after each rollout (vLLM sleep mode on colocated GPUs)."""

    @property
    def reference(self) -> Optional[WorkerGroup]:
        """Whichever group answers compute_ref_log_probs, if any."""
        if self.ref is not None:
            return self.ref
        return self.actor if self.lora_reference else None

    def groups(self) -> list[WorkerGroup]:
        """The worker groups of this run (actor, reference if separate, rollout)."""
        return [g for g in (self.actor, self.ref, self.rollout) if g is not None]

    def dead_workers(self) -> list[str]:
        """Role, rank and node of every training or rollout worker Ray reports dead."""
        return [f"{group.role} rank {rank} on node {ip}" for group in (self.actor, self.ref, self.rollout)
                if group is not None for rank, ip in group.dead_ranks()] + (self.rewards.dead() if self.rewards else [])

    def shutdown(self) -> None:
        for group in (self.actor, self.ref, self.rollout):
            if group is not None:
                group.shutdown()
        if self.rewards is not None:
            self.rewards.shutdown()
        for pool in self.pools:
            pool.release()


def build_sft_roles(config: Config, total_optimizer_steps: int) -> Roles:
    """The one role of an SFT run: the actor on every worker of the pool (its own process group)."""
    from easytrain.workers.sft import SFTWorker

    t = config.trainer
    pool = ResourcePool("sft", t.nnodes, t.workers_per_node, t.device)
    actor = WorkerGroup(SFTWorker, "actor", pool, num_cpus=1.0, num_gpus=1.0 if t.device == "cuda" else 0.0,
                        init_args=(config,), env={"TOKENIZERS_PARALLELISM": "false"},
                        block_size=config.worker.actor.ulysses_size)
    actor.init_process_group()
    sizes = actor.call("setup", total_optimizer_steps)
    logger.info("actor: %s parameters (%s trainable) on %d rank(s), strategy %s", sizes[0]["total"],
                sizes[0]["trainable"], actor.world_size, config.worker.actor.strategy)
    return Roles(actor, None, None, None, None, [pool])


def build_roles(config: Config, total_optimizer_steps: int) -> Roles:
    """Create pools and groups, start process groups, load models (in parallel across roles)."""
    t = config.trainer
    with_ref = needs_reference(config)
    names = ["actor", "rollout"] + (["ref"] if with_ref else [])
    gpu = 1.0 if t.device == "cuda" else 0.0
    if t.colocate:
        pool = ResourcePool("colocated", t.nnodes, t.workers_per_node, t.device)
        pools = {name: pool for name in names}
        share = round(1.0 / len(names), 4)  # roles time-slice each device
        cpus, gpus = share, gpu * share
    else:
        pools = {name: ResourcePool(name, t.nnodes, t.workers_per_node, t.device) for name in names}
        cpus, gpus = 1.0, gpu
    env = {"TOKENIZERS_PARALLELISM": "false"}
    actor = WorkerGroup(ActorWorker, "actor", pools["actor"], num_cpus=cpus, num_gpus=gpus, init_args=(config,),
                        env=env, block_size=config.worker.actor.ulysses_size)
    tp = config.worker.rollout.tensor_parallel_size
    rollout = WorkerGroup(RolloutWorker, "rollout", pools["rollout"], num_cpus=cpus, num_gpus=gpus,
                          init_args=(config,), env=env, block_size=tp)
    if tp > 1:
        rollout.init_blocks()
    ref = (WorkerGroup(ReferenceWorker, "ref", pools["ref"], num_cpus=cpus, num_gpus=gpus, init_args=(config,),
                       env=env, block_size=config.worker.ref.ulysses_size) if with_ref else None)
    training = [g for g in (actor, ref) if g is not None]
    for group in training:
        group.init_process_group()
    pending = [actor.submit("setup", total_optimizer_steps), rollout.submit("setup")]
    if ref is not None:
        pending.append(ref.submit("setup"))
    sizes = [group.collect(p) for group, p in zip([actor, rollout] + ([ref] if ref else []), pending)]
    logger.info("actor: %s parameters (%s trainable) on %d rank(s); rollout engine %s; reference %s",
                sizes[0][0]["total"], sizes[0][0]["trainable"], actor.world_size, sizes[1][0]["engine"],
                "on" if ref else "off")
    transport = BucketedTransport(config.worker.rollout.sync_bucket_mb)
    return Roles(actor, ref, rollout, RewardPool(config.reward), transport,
                 list({id(p): p for p in pools.values()}.values()),
                 lora_reference=config.model.lora.rank > 0 and config.algorithm.kl_coef > 0,
                 rollout_sleeps=bool(sizes[1][0]["can_sleep"]))
