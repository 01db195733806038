"""DeepSpeed-Ulysses sequence parallelism for transformers decoder models (the families whose adapter serves it).

A role of ``world`` ranks with ``worker.<role>.ulysses_size = P`` forms a
``(world / P) x P`` mesh: consecutive blocks of ``P`` ranks are one
sequence-parallel group and hold the same micro batch (the driver replicates
each data-parallel share to its block), while FSDP still shards the
parameters over all ranks. Each
computes the embeddings (and, for a vision-language model, the image features and the multimodal
rope positions) for the whole sequence; :func:`apply_ulysses` then makes
every decoder layer work on the rank's contiguous chunk of ``S / P`` tokens:

- a pre-hook on each decoder layer slices the hidden states (at the first
  layer) and the rotary ``(cos, sin)`` (at every layer) to the chunk;
- attention goes through transformers' attention interface as
  ``"ulysses"``: an all-to-all turns ``(B, H, S/P, D)`` query/key/value into
  ``(B, H/P, S, D)`` (every position, a share of the heads; key/value heads
  fewer than ``P`` are repeated first), attention runs over the full
  sequence sample by sample (causal within each packed sample, one SDPA call
  each: no S x S mask, :mod:`easytrain.models.segments`), and
  the inverse all-to-all brings the output back to the chunk;
- the final norm, the head and the loss stay on the chunk: per-token
  outputs are gathered (:func:`gather_sequence`) only to report them.

Gradients: each rank's loss covers its chunk's tokens, the all-to-all's
backward routes the attention gradients between ranks, so the group's
gradients summed equal the unsplit model's. With the data-parallel
averaging the strategies do over all ``dp x sp`` ranks, a loss scaled by
``world / global tokens`` (what the SFT worker already uses) gives the
global token mean.

Sequences are padding-free (one flattened sequence, batch dimension 1), its
length a multiple of ``P`` (padded with an untrained segment), run inside the
packed samples' layout (:func:`easytrain.models.segments.segments`): the hooks
and the attention read the sequence's samples from it, so a layer that
activation checkpointing recomputes in backward, under the layout its forward
ran with (:func:`~easytrain.models.segments.checkpoint_contexts`), recomputes
on its chunk too. Outside a layout (generation) the hooks pass everything
through and attention is plain sdpa.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from easytrain.models.segments import active, attend, mask_outside_layouts
from easytrain.models.varlen import Layout

ATTENTION = "ulysses"


@dataclass
class SequenceParallel:
    """One sequence-parallel group, and what was recorded for tests and logs."""

    group: Any
    size: int
    rank: int
    record: list[dict[str, Any]] = field(default_factory=list)
    """Per attention call: local and gathered shapes and the collectives run (when recording is on)."""
    recording: bool = False

    def chunk(self, length: int) -> slice:
        if length % self.size:
            raise ValueError(f"a sequence of {length} tokens does not split into {self.size} equal chunks "
                             f"(worker.<role>.ulysses_size={self.size}); pad it to a multiple")
        share = length // self.size
        return slice(self.rank * share, (self.rank + 1) * share)


class _AllToAll(torch.autograd.Function):
    """Scatter ``scatter_dim`` over the group and gather ``gather_dim``; the backward is the inverse exchange."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def _all_to_all(x: torch.Tensor, group: Any, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    size = dist.get_world_size(group)
    inputs = [t.contiguous() for t in x.chunk(size, dim=scatter_dim)]
    outputs = [torch.empty_like(inputs[0]) for _ in range(size)]
    dist.all_to_all(outputs, inputs, group=group)
    return torch.cat(outputs, dim=gather_dim)


def all_to_all(x: torch.Tensor, sp: SequenceParallel, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    return _AllToAll.apply(x, sp.group, scatter_dim, gather_dim)


class _Gather(torch.autograd.Function):
    """All-gather along ``dim``; the backward keeps this rank's chunk of the gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        rank = dist.get_rank(ctx.group)
        return grad.chunk(dist.get_world_size(ctx.group), dim=ctx.dim)[rank].contiguous(), None, None


def gather_sequence(x: torch.Tensor, sp: SequenceParallel, dim: int = 1) -> torch.Tensor:
    """Per-token outputs of the chunks (log-probs, entropy) back to the full sequence on every rank."""
    return _Gather.apply(x, sp.group, dim)


def ulysses_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any, dropout: float = 0.0, scaling: Optional[float] = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Attention over the full sequence with ``H / P`` heads per rank; takes and returns the chunk."""
    sp: SequenceParallel = module.ulysses  # type: ignore[assignment]
    layout = active()
    if layout is None:  # not a packed training forward (generation): ordinary attention on every rank
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    heads, kv_heads = query.shape[1], key.shape[1]
    if heads % sp.size:
        raise ValueError(f"{heads} attention heads do not split over ulysses_size={sp.size}")
    if kv_heads % sp.size:  # fewer KV heads than ranks (e.g. 4 for 28 query heads): repeat them
        repeat = sp.size // kv_heads if sp.size % kv_heads == 0 else heads // kv_heads
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    q, k, v = (all_to_all(t, sp, scatter_dim=1, gather_dim=2) for t in (query, key, value))
    out = attend(q, k, v, layout, scaling)  # sample by sample: no S x S mask of the whole sequence
    if sp.recording:
        sp.record.append({"local_query": tuple(query.shape), "attention_query": tuple(q.shape),
                          "attention_key": tuple(k.shape), "collectives": ["all_to_all"] * 4})
    out = all_to_all(out, sp, scatter_dim=2, gather_dim=1)  # (B, H, S/P, D)
    return out.transpose(1, 2).contiguous(), None


def register_attention() -> None:
    """``"ulysses"`` in transformers' attention interface; inside a layout the model builds no mask (Ulysses
    attention follows the packed samples' blocks), outside it sdpa's."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, ulysses_attention)
    AttentionMaskInterface.register(ATTENTION, mask_outside_layouts)


def length(layout: Layout) -> int:
    """The columns a packed sequence's layout covers (one row, its blocks in order)."""
    last = layout[0][-1]
    return max([last.prefix[1], *(end for _, end in last.parts)])


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a transformers causal LM (or of a vision-language model's language model)."""
    inner: Any = getattr(model, "model", model)
    language = getattr(inner, "language_model", inner)
    layers = getattr(language, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no decoder layers found for sequence parallelism")
    return list(layers)


def apply_ulysses(model: nn.Module, sp: SequenceParallel) -> nn.Module:
    """Make ``model``'s decoder layers run on this rank's chunk with Ulysses attention (in place)."""
    register_attention()

    def slice_inputs(layer: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
        layout = active()
        if layout is None:  # no layout: generation, the whole sequence on every rank
            return None
        full = length(layout)
        part = sp.chunk(full)
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.shape[1] == full:  # the first layer: the embeddings (and image features) of every position
            hidden = hidden[:, part]
        cos, sin = kwargs["position_embeddings"]
        if cos.shape[-2] == full:
            kwargs["position_embeddings"] = (cos[..., part, :], sin[..., part, :])
        kwargs.pop("attention_mask", None)  # none is built inside a layout; Ulysses attention needs none
        if args:
            return (hidden, *args[1:]), kwargs
        kwargs["hidden_states"] = hidden
        return args, kwargs

    for layer in decoder_layers(model):
        layer.register_forward_pre_hook(slice_inputs, with_kwargs=True)
        attention = getattr(layer, "self_attn")
        attention.ulysses = sp  # type: ignore[assignment]
    config = getattr(model, "config")
    text = getattr(config, "text_config", None) or config  # the vision tower keeps its own attention
    text._attn_implementation = ATTENTION  # noqa: SLF001 - transformers' own switch
    return model


def sequence_parallel_group(world_size: int, size: int, rank: int) -> SequenceParallel:
    """This rank's group among consecutive blocks of ``size`` ranks (every rank must call this: creating a
    process group is collective)."""
    if world_size % size:
        raise ValueError(f"ulysses_size={size} does not divide the role's {world_size} ranks")
    mine = None
    for start in range(0, world_size, size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = group
    return SequenceParallel(group=mine, size=size, rank=rank % size)
