"""The RL run's shape for the memory plan: the model and batch dimensions every row reads (:class:`Shape`), and
the actor's and reference's micro batches as the workers lay them out (padded, prompt-shared or padding-free
packs), with FSDP's transiently gathered units."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Optional

from easytrain.config.schema import MASKED_ATTENTION, Config
from easytrain.memory.activations import MicroShape, model_dims, packed_micro, shard_units
from easytrain.memory.budget import SequenceShape, sequence_shape
from easytrain.memory.data_shape import DataCosts
from easytrain.memory.host import heap_keeps_freed
from easytrain.memory.sft import validation_prompts
from easytrain.memory.params import count_parameters, largest_module, largest_trainable, trainable_by_component
from easytrain.memory.states import DTYPE_BYTES, FP32, gathered_bytes, shard_degree


# ----------------------------------------------------------------------------- the run's shape


@dataclass(frozen=True)
class Shape:
    """What the plan needs from the config and model, computed once."""

    world: int
    per_node: int
    total_params: int
    trainable: dict[str, int]
    largest_trainable: int
    """Elements of the largest trainable parameter."""
    largest_module: int
    """Elements of the model's largest module (a weight-sync bucket never splits one)."""
    seq_tokens: int
    response: int
    images: int
    image_tokens: int
    hidden: int
    dtype_bytes: int
    with_ref: bool
    """A reference model of its own (a KL term without LoRA)."""
    ref_by_actor: bool
    """A KL term with LoRA: the actor, adapters disabled, computes the reference log-probs."""
    old_log_probs: bool
    on_gpu: bool
    values_per_token: int
    """fp32 ``pixel_values`` values behind one image token (:attr:`ModelDims.values_per_token`)."""
    batch_vision: int
    """Vision tokens of a step batch's prompts together (their pixel values travel once per prompt): on the data,
    its costliest prompts' (:meth:`DataCosts.batch_vision`); on the limits, every prompt at the longest row's."""
    rank_vision: int
    """The same for one rank's share of the batch (its ceil(prompts / world) prompts): the costliest prompts may
    all land on one rank."""
    val: Optional["Shape"] = None
    """The validation prompts' shape (set by :func:`shape_of`)."""

    @property
    def validation(self) -> "Shape":
        return self.val or self

    @property
    def ranked(self) -> "Shape":
        """This shape with the batch priced as its ranks' shares: every rank's share as costly as the costliest
        one (what a worker process's share of a batch is priced at, :func:`batch_bytes` over the world)."""
        val = self.val.ranked if self.val is not None else None
        return replace(self, batch_vision=self.rank_vision * self.world, val=val)


def shape_of(config: Config, hf_config: dict[str, Any], data: Optional[DataCosts] = None) -> Shape:
    """``data``: sequences as long as the data's longest rows under the config's limits (where the profile can
    tell; else, and without it, as long as the limits allow): a step's on the train split's rows, a validation's
    on the validation split's (on the limits where the data has not read that split)."""
    t, a, d = config.trainer, config.worker.actor, config.data
    seq = (data and data.shape(config, hf_config, "train")) or sequence_shape(config, hf_config)
    val_seq = ((data and "val" in data.splits() and data.shape(config, hf_config, "val"))
               or (sequence_shape(config, hf_config) if data and d.val_files else seq))
    world = t.nnodes * t.workers_per_node
    on_policy = a.ppo_epochs == 1 and d.rollout_batch_size == a.global_batch_size
    kl = config.algorithm.kl_coef > 0
    dims = model_dims(hf_config)
    shape = Shape(world=world, per_node=t.workers_per_node,
                  total_params=count_parameters(hf_config).total,
                  trainable=trainable_by_component(hf_config, config.model),
                  largest_trainable=largest_trainable(hf_config, config.model),
                  largest_module=largest_module(hf_config),
                  seq_tokens=seq.total, response=seq.response, images=seq.images, image_tokens=seq.image_tokens,
                  hidden=dims.hidden, dtype_bytes=DTYPE_BYTES[config.model.dtype],
                  with_ref=kl and config.model.lora.rank == 0, ref_by_actor=kl and config.model.lora.rank > 0,
                  old_log_probs=not (on_policy and a.reuse_log_probs_on_policy), on_gpu=t.device == "cuda",
                  values_per_token=dims.values_per_token,
                  batch_vision=batch_vision(config, data, seq, "train", d.rollout_batch_size),
                  rank_vision=batch_vision(config, data, seq, "train", -(-d.rollout_batch_size // world)))
    prompts = validation_prompts(config, d.rollout_batch_size)
    return replace(shape, val=replace(shape, seq_tokens=val_seq.total, response=val_seq.response,
                                      images=val_seq.images, image_tokens=val_seq.image_tokens,
                                      batch_vision=batch_vision(config, data, val_seq, "val", prompts),
                                      rank_vision=batch_vision(config, data, val_seq, "val", -(-prompts // world))))


def batch_vision(config: Config, data: Optional[DataCosts], seq: SequenceShape, split: str, prompts: int) -> int:
    """Vision tokens of ``prompts`` prompts of ``split`` together: the data's costliest rows where it can say (not
    with multi-turn tool images, which the limits price), else each at ``seq``'s longest row."""
    turns = config.worker.rollout.multi_turn
    known = data.batch_vision(config, split, prompts) if data and not turns.enable else None
    return known if known is not None else prompts * seq.images * seq.image_tokens


def per_rank(config: Config, s: Shape, role: str, prompts: int) -> int:
    """Sequences of ``prompts`` x n one data-parallel member of ``role`` works on: the world over its
    ``ulysses_size`` ranks, each group sharing its members' sequences."""
    return max(1, prompts * config.worker.rollout.n // max(1, s.world // getattr(config.worker, role).ulysses_size))


# ----------------------------------------------------------------------------- micro batches


def shares_prompts(config: Config) -> bool:
    """Whether the run's log-prob and update passes may run each prompt once with its responses: the one rule
    the planner and the driver's micro-batch plan (:class:`easytrain.trainer.micro_batches.Forward`, which
    adds what the loaded model says) both follow. ``worker.actor.share_prompt``, an attention that takes a
    mask, and no sequence parallelism in the actor or the reference."""
    w = config.worker
    return (w.actor.share_prompt and config.model.attn_implementation in MASKED_ATTENTION
            and w.actor.ulysses_size == 1 and w.ref.ulysses_size == 1)


def shared_rows(size: int, n: int, sequences: int) -> tuple[int, int]:
    """(rows, responses of the longest row) of a padded micro batch of ``size`` consecutive sequences laid out
    prompt-once, ``n`` per prompt, from a rank's ``sequences``: whole groups when micro batches and the rank's
    share align with the prompts, else one more row where it straddles two."""
    k = min(size, n)
    aligned = sequences % n == 0 and (size % n == 0 or n % size == 0)
    rows = -(-size // n) if aligned else min(size, -(-(size - 1) // n) + 1)
    return rows, k


def shared_pays_off(rows: int, width: int, size: int, plain_width: int, hidden: int) -> bool:
    """The workers' rule (:func:`easytrain.workers.shared_prompt.rows_pay_off`) on the planned shapes: a row per
    prompt when its linear and attention cost is below the plain rows' and its mask no more than twice theirs."""
    per_token = 6 * hidden
    plain = size * (plain_width * per_token + plain_width ** 2)
    shared = rows * (width * per_token + width ** 2)
    return shared < plain and rows * width ** 2 <= 2 * size * plain_width ** 2


def packed_group(config: Config, s: Shape, prompts: int, role: str) -> Optional[int]:
    """Tokens of one prompt with its n responses when the driver packs whole prompts (prompt once) into
    ``role``'s padding-free micro batches: it does when it plans by prompt, one prompt's group fits the budget
    and the batch has a prompt for every member (:func:`easytrain.trainer.micro_batches.plan_indices`); None otherwise."""
    a, n = config.worker.actor, config.worker.rollout.n
    group = s.seq_tokens - s.response + n * s.response
    members = s.world // getattr(config.worker, role).ulysses_size
    if not shares_prompts(config) or group > a.max_token_len_per_device or prompts < members:
        return None
    return group


def shared_micro(config: Config, s: Shape, size: int, sequences: int, role: str) -> Optional[MicroShape]:
    """A padded micro batch as a prompt-shared pass lays it out (a row per prompt of its responses:
    :func:`shared_rows`) when that pays off by the workers' rule, or None where the pass runs plain rows."""
    if not shares_prompts(config) or config.worker.actor.padding_free:
        return None
    size = min(size, sequences)
    rows, k = shared_rows(size, config.worker.rollout.n, sequences)
    width = s.seq_tokens - s.response + k * s.response
    if rows == size or not shared_pays_off(rows, width, size, s.seq_tokens, s.hidden):
        return None
    return MicroShape(rows, width, k * s.response, s.images, s.image_tokens)


def rank_tokens(config: Config, s: Shape, sequences: int, prompts: int, role: str) -> int:
    """Tokens of a rank's ``sequences`` as the padding-free passes lay them out (whole prompts once each with
    their responses where :func:`packed_group` applies)."""
    group = packed_group(config, s, prompts, role)
    n = config.worker.rollout.n
    return -(-sequences // n) * group if group is not None else sequences * s.seq_tokens


def _micro(config: Config, s: Shape, size: int, sequences: int, prompts: int, role: str) -> MicroShape:
    """A rank's micro batch among ``sequences`` (of a batch of ``prompts`` prompts): ``size`` padded ones (a row
    per prompt where ``role`` shares prompts and it pays off), or padding-free one flattened sequence of
    ``max_token_len_per_device`` tokens (no more than the rank's sequences hold) holding full-length samples,
    or whole prompts with their n responses where the driver packs by prompt."""
    a = config.worker.actor
    if a.padding_free:
        budget = min(a.max_token_len_per_device, rank_tokens(config, s, sequences, prompts, role))
        group = packed_group(config, s, prompts, role)
        if group is not None:
            n = config.worker.rollout.n
            return packed_micro(budget, group, n * s.response, s.images, s.image_tokens)
        return packed_micro(budget, s.seq_tokens, s.response, s.images, s.image_tokens)
    shared = shared_micro(config, s, size, sequences, role)
    if shared is not None:
        return shared
    return MicroShape(min(size, sequences), s.seq_tokens, s.response, s.images, s.image_tokens)


def experience_micro(config: Config, s: Shape, role: str) -> MicroShape:
    """One log-prob pass's micro batch on a rank of ``role`` (actor or ref)."""
    prompts = config.data.rollout_batch_size
    sequences = per_rank(config, s, role, prompts)
    return _micro(config, s, config.worker.actor.micro_batch_size_per_device_for_experience, sequences, prompts,
                  role)


def update_micro(config: Config, s: Shape) -> tuple[MicroShape, bool]:
    """The update's micro batch on an actor rank, and whether the rank accumulates gradients over several."""
    a = config.worker.actor
    sequences = per_rank(config, s, "actor", a.global_batch_size)
    micro = _micro(config, s, a.micro_batch_size_per_device_for_update, sequences, a.global_batch_size, "actor")
    if a.padding_free:
        return micro, rank_tokens(config, s, sequences, a.global_batch_size, "actor") > a.max_token_len_per_device
    return micro, sequences > a.micro_batch_size_per_device_for_update


def gathered_units(config: Config, s: Shape, hf_config: dict[str, Any], role: str, grad: bool) -> int:
    """FSDP's transient unsharded parameters (:func:`gathered_bytes`); nothing when FSDP is not applied
    (1 rank, fp32)."""
    role_cfg = getattr(config.worker, role)
    degree = shard_degree(role_cfg.fsdp.shard_size, s.world)
    if degree == 1 and s.dtype_bytes == FP32:
        return 0
    root, block = shard_units(hf_config)
    return gathered_bytes(s.total_params, root, block, s.dtype_bytes, grad=grad, reshard=role_cfg.fsdp.full_shard,
                          kept=heap_keeps_freed(config, s.on_gpu))
