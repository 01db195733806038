"""Prompt-shared forward passes: a prompt's samples run as one row, the prompt (and its images) once.

GRPO scores n responses to every prompt, so a micro batch usually holds a
prompt n times over. Instead of n rows of ``prompt + response_i`` this lays
each distinct prompt out once, followed by all of its responses::

    [ prompt | response_1 | response_2 | ... | response_k ]

with an attention mask under which a response token sees the prompt and the
earlier tokens of its own response only, and position ids under which every
response continues from the end of the prompt (multimodal rope rows
included). Every response token then sees exactly what it sees in its own
row, so log-probs, entropy and gradients are those of the plain forward, up
to float rounding, while the prompt's tokens and its images' vision-tower
work are paid once instead of k times.

Padding-free micro batches put every prompt with its responses back to back
in one row (exactly the micro batch's tokens, each prompt once: what the
driver's prompt-aware plan counted). Padded ones get a row per prompt,
right-padded to the longest, and only when that is cheaper than the plain
rows (:func:`rows_pay_off`: a row of many long responses costs attention in
the square of its length).

Used when ``worker.actor.share_prompt`` is on, the attention is ``sdpa`` or
``eager`` (they take an explicit mask; flash-attention's kernels do not) and
there is no sequence parallelism. On GPU (``sdpa``) no mask is built: the
prompt and each response are attended one call each
(:mod:`easytrain.models.segments`); :func:`prompt_groups` finds the repeats
(equal prompt tokens and equal image pixels), in any order within the micro
batch.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Optional

import torch
from torch import nn

from easytrain.algorithms.losses import entropy_from_logits, gather_log_probs, sampling_logits
from easytrain.config.schema import MASKED_ATTENTION
from easytrain.distributed.batch import Batch
from easytrain.models.segments import ATTENTION as SEGMENTS
from easytrain.models.segments import segments, shared_blocks, uses_segments
from easytrain.models.families import Family, family_of



def text_config(model: nn.Module) -> Any:
    config = model.config
    return getattr(config, "text_config", None) or config


def supports_shared_prompt(model: nn.Module) -> bool:
    """Whether the model's family serves prompt sharing and its attention takes an explicit 4-D mask (and no sliding
    window, which this mask would not express)."""
    return (family_of(model).unsupported("shared_prompt") is None
            and getattr(text_config(model), "_attn_implementation", None) in (*MASKED_ATTENTION, SEGMENTS)
            and not getattr(text_config(model), "use_sliding_window", False))


def prompt_groups(batch: Batch) -> list[list[int]]:
    """Samples with the same prompt (tokens and image pixels), grouped in order of first appearance. A sample
    whose response holds images (a multi-turn tool turn's) is a group of its own: a shared row carries only its
    lead's images."""
    mask = batch["attention_mask"].bool()
    prompt_width = mask.shape[1] - batch["responses"].shape[1]
    ids = batch["input_ids"][:, :prompt_width]
    alone = (batch["mm_token_type_ids"][:, prompt_width:] != 0).any(-1) if "mm_token_type_ids" in batch else None
    groups: list[list[int]] = []
    pixel_keys = batch.pixel_keys()  # prompts with equal text and different images differ here without comparing
    shown = batch.shown_blocks()  # samples showing the same stored blocks need no comparison either
    equal: dict[tuple[tuple[int, ...], tuple[int, ...]], bool] = {}  # stored blocks compared, value by value
    by_prompt: dict[tuple[Any, ...], list[int]] = {}  # prompt tokens and pixel keys -> indices into groups
    for row in range(len(batch)):
        if alone is not None and bool(alone[row]):
            groups.append([row])
            continue
        key = (tuple(ids[row][mask[row, :prompt_width]].tolist()), pixel_keys[row])
        for g in by_prompt.setdefault(key, []):
            lead = groups[g][0]
            pair = (shown[lead], shown[row])
            if pair not in equal:
                equal[pair] = pair[0] == pair[1] or batch.same_pixels(lead, row)
            if equal[pair]:
                groups[g].append(row)
                break
        else:
            by_prompt[key].append(len(groups))
            groups.append([row])
    return groups


def worth_sharing(groups: list[list[int]]) -> bool:
    return any(len(g) > 1 for g in groups)


def prompt_and_response_tokens(batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    mask = batch["attention_mask"]
    prompt_width = mask.shape[1] - batch["responses"].shape[1]
    return mask[:, :prompt_width].sum(-1), mask[:, prompt_width:].sum(-1)


def rows_pay_off(batch: Batch, groups: list[list[int]], hidden: int) -> bool:
    """Whether one row per prompt (padded to the longest) costs less than the padded plain pass: per layer a token
    costs ~``6 x hidden`` pairs' worth of linear work and a row of L tokens L^2 attention pairs; a long row of
    many responses can cost more than the plain rows it replaces (attention grows with its square), and its mask
    must not outgrow twice the plain pass's."""
    prompt, response = prompt_and_response_tokens(batch)
    longest = max(int(prompt[g[0]] + response[g].sum()) for g in groups)
    plain_rows, width, per_token = len(batch), batch["attention_mask"].shape[1], 6 * hidden
    plain = plain_rows * (width * per_token + width ** 2)
    shared = len(groups) * (longest * per_token + longest ** 2)
    return shared < plain and len(groups) * longest ** 2 <= 2 * plain_rows * width ** 2


def _attention_mask(segments: torch.Tensor, units: torch.Tensor, prompt: torch.Tensor, dtype: torch.dtype,
                    eager: bool) -> torch.Tensor:
    """(rows, 1, L, L) mask from each position's segment and unit (-1: padding): causal within a unit (a prompt
    and its responses), a response sees its unit's prompt and itself; a padding position sees only itself."""
    length = segments.shape[1]
    allowed = (segments[:, :, None] == segments[:, None, :]) | prompt[:, None, :]
    allowed &= units[:, :, None] == units[:, None, :]
    allowed &= torch.ones(length, length, dtype=torch.bool).tril()
    allowed &= (units >= 0)[:, :, None]
    allowed |= torch.eye(length, dtype=torch.bool)
    allowed = allowed[:, None]
    if not eager:
        return allowed
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)


def _append(parts: dict[str, list[torch.Tensor]], segment: int, unit: int, is_prompt: bool, ids: torch.Tensor,
            positions: torch.Tensor, types: Optional[torch.Tensor]) -> int:
    """Add one segment (a prompt or a response) to a row's parts; returns the next segment id."""
    count = ids.shape[0]
    parts["ids"].append(ids)
    parts["pos"].append(positions)
    parts["seg"].append(torch.full((count,), segment, dtype=torch.long))
    parts["unit"].append(torch.full((count,), unit, dtype=torch.long))
    parts["prompt"].append(torch.full((count,), int(is_prompt), dtype=torch.long))
    if types is not None:
        parts["types"].append(types)
    return segment + 1


def shared_inputs(batch: Batch, groups: list[list[int]], family: Family, dtype: torch.dtype, eager: bool,
                  one_row: bool = False, blocks: bool = False) -> tuple[dict[str, Any], torch.Tensor, torch.Tensor]:
    """Model inputs of ``groups`` laid out prompt-once (a row per prompt, or all of them back to back in one row:
    ``one_row``, the padding-free form), the (row, column) that predicts each kept response token, and that
    token's (sample, response column). The attention is an (rows, 1, L, L) mask, or with ``blocks`` the layout
    of :mod:`easytrain.models.segments` under ``"layout"`` (no mask).

    Kept tokens are those with ``response_mask`` (and ``attention_mask``) set, as in the plain passes."""
    vision = family.rope_rows
    mask = batch["attention_mask"].bool()
    length = batch["responses"].shape[1]
    prompt_width = mask.shape[1] - length
    valid = batch["response_mask"].bool() & mask[:, prompt_width:]
    positions = batch["position_ids"]
    if positions.dim() == 2:  # text positions; a VL model still takes its three rope rows
        positions = positions[None].expand(3 if vision else 1, -1, -1)
    has_types = "mm_token_type_ids" in batch
    rows: list[dict[str, list[torch.Tensor]]] = []
    sources, targets = [], []
    segment = 0  # segment ids are unique within a row: a prompt and each response get their own
    for g, members in enumerate(groups):
        if not rows or not one_row:
            rows.append({"ids": [], "pos": [], "seg": [], "unit": [], "prompt": [], "types": []})
            segment = 0
        parts = rows[-1]
        start = sum(t.shape[0] for t in parts["ids"])  # where this prompt starts in its row
        lead = members[0]
        keep = mask[lead, :prompt_width]
        prompt_len = int(keep.sum())
        segment = _append(parts, segment, g, True, batch["input_ids"][lead, :prompt_width][keep],
                          positions[:, lead, :prompt_width][:, keep],
                          batch["mm_token_type_ids"][lead, :prompt_width][keep] if has_types else None)
        # the members' responses back to back after the prompt, each its own segment (all members at once: a
        # boolean index flattens row by row, so member i's present tokens follow member i-1's)
        index = torch.tensor(members)
        present = mask[index, prompt_width:]
        counts = present.sum(1)
        member_start = torch.repeat_interleave(counts.cumsum(0) - counts, counts)  # token offset of its member
        parts["ids"].append(batch["input_ids"][index, prompt_width:][present])
        parts["pos"].append(positions[:, index, prompt_width:][:, present])
        parts["seg"].append(torch.repeat_interleave(torch.arange(segment, segment + len(members)), counts))
        parts["unit"].append(torch.full((int(counts.sum()),), g, dtype=torch.long))
        parts["prompt"].append(torch.zeros(int(counts.sum()), dtype=torch.long))
        if has_types:
            parts["types"].append(batch["mm_token_type_ids"][index, prompt_width:][present])
        segment += len(members)
        # a member's j-th present response token sits at column end + j (end: where the member's tokens start);
        # its logits come from the column before, which for j = 0 is the prompt's last token
        rank = torch.arange(member_start.shape[0]) - member_start
        column = start + prompt_len + member_start + rank
        prev = torch.where(rank == 0, torch.full_like(rank, start + prompt_len - 1), column - 1)
        kept = valid[index][present]
        sources.append(torch.stack([torch.full_like(rank, len(rows) - 1), prev], -1)[kept])
        targets.append(torch.stack([torch.repeat_interleave(index, counts),
                                    torch.arange(length).expand(len(members), length)[present]], -1)[kept])
    flat = [{key: torch.cat(value, dim=-1) for key, value in parts.items() if value} for parts in rows]
    width = max(r["ids"].shape[0] for r in flat)

    def stack(key: str, fill: int) -> torch.Tensor:
        return torch.stack([nn.functional.pad(r[key], (0, width - r[key].shape[-1]), value=fill) for r in flat])

    units = stack("unit", -1)
    inputs: dict[str, Any] = {"input_ids": stack("ids", 0)}
    if blocks:
        inputs["layout"] = shared_blocks(stack("seg", -1), units, stack("prompt", 0).bool())
    else:
        inputs["attention_mask"] = _attention_mask(stack("seg", -1), units, stack("prompt", 0).bool(), dtype, eager)
    pos = torch.stack([nn.functional.pad(r["pos"], (0, width - r["pos"].shape[-1])) for r in flat], dim=1)
    inputs["position_ids"] = pos if vision else pos[0]
    if has_types and family.takes_token_types():
        inputs["mm_token_type_ids"] = stack("types", 0)
    if batch.image_counts is not None and "pixel_values" in batch:
        leads = batch.select([m[0] for m in groups])
        inputs.update(family.visual_kwargs(leads.expanded_tensors()))
    return inputs, torch.cat(sources), torch.cat(targets)


def shared_response_log_probs(model: nn.Module, batch: Batch, groups: list[list[int]], temperature: float,
                              device: torch.device, suppressed: list[int], with_entropy: bool = False,
                              one_row: bool = False) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Response log-probs (and entropy) of ``batch`` from one prompt-shared forward, (B, R) like the plain passes';
    0 where ``response_mask`` is 0. ``one_row``: every prompt with its responses back to back in a single row
    (padding-free: exactly the batch's tokens with each prompt once)."""
    family = family_of(model)
    eager = model.config._attn_implementation == "eager"
    dtype = next(model.parameters()).dtype
    segmented = uses_segments(model)
    inputs, sources, targets = shared_inputs(batch, groups, family, dtype, eager, one_row, blocks=segmented)
    columns = torch.unique(sources[:, 1])  # sorted; logits only where some response token is predicted
    layout = inputs.pop("layout", None)
    layer_mask = inputs.pop("attention_mask", None)
    model_inputs = {k: v.to(device) for k, v in inputs.items()}
    if layer_mask is not None:
        layer_mask = layer_mask.to(device)
        # a prepared 4-D mask skips transformers' own mask building (which would add padding/causality)
        model_inputs["attention_mask"] = layer_mask
    with segments(layout) if layout is not None else nullcontext():  # a prompt and each response: no L x L mask
        logits = model(**model_inputs, logits_to_keep=columns.to(device), use_cache=False).logits
    where = torch.searchsorted(columns, sources[:, 1].contiguous())
    picked = logits[sources[:, 0].to(device), where.to(device)]  # (N, V), one row per kept response token
    scaled = sampling_logits(picked, temperature, suppressed)
    tokens = batch["responses"][targets[:, 0], targets[:, 1]].to(device)
    rows, length = batch["responses"].shape

    def to_rows(values: torch.Tensor) -> torch.Tensor:
        return values.new_zeros(rows, length).index_put((targets[:, 0].to(device), targets[:, 1].to(device)), values)

    log_probs = to_rows(gather_log_probs(scaled, tokens))
    entropy = to_rows(entropy_from_logits(scaled)) if with_entropy else None
    return log_probs, entropy
