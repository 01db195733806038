"""easytrain's own decoding loop for the HF engine: finished rows leave the batch.

transformers' ``generate`` keeps every row in every forward until the longest
response ends, feeding pad tokens to rows that already stopped. This loop
prefills (each prompt once when its ``n`` samples share it), then after every
step drops the rows that just produced a stop token from the batch, the KV
cache and the positions, so a decode forward costs only the rows still
running. It also skips ``generate``'s per-step bookkeeping.

Token choice follows ``generate``'s with the same settings: the vision
placeholders suppressed, then temperature, top-k and top-p, then
``torch.multinomial`` over the softmax (or argmax when greedy). Greedy
decoding gives ``generate``'s tokens; sampling gives the same draws as long
as no row has finished (the random stream is consumed the same way) and the
same distribution after (fewer rows draw). Nothing else shapes the choice:
``generate`` would also apply extras from the model folder's
``generation_config`` (a repetition penalty, for instance), which the
recorded log-probs, taken from the raw logits of each step, never included;
this loop samples exactly the distribution whose log-probs it records.

On CUDA the engine decodes with :mod:`easytrain.workers.rollout.static_decode` instead (fixed shapes, so each
step replays as a CUDA graph); it starts from this module's :func:`prefill` and chooses tokens with
:func:`choose`.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import nn

from easytrain.algorithms.losses import gather_log_probs, sampling_logits
from easytrain.models.families import family_of
from easytrain.workers.rollout.engine import SamplingParams


def choose(logits: torch.Tensor, params: SamplingParams, suppressed: list[int]) -> torch.Tensor:
    """Next token per row from raw logits (A, V), as ``generate`` chooses it."""
    scores = logits.clone()
    if suppressed:
        scores[:, suppressed] = float("-inf")
    if params.temperature <= 0:
        return scores.argmax(-1)
    scores = scores / params.temperature
    if params.top_k > 0:
        k = min(params.top_k, scores.shape[-1])
        scores = scores.masked_fill(scores < torch.topk(scores, k)[0][..., -1, None], float("-inf"))
    if params.top_p < 1.0:
        ordered, order = torch.sort(scores, descending=False)
        drop = ordered.softmax(-1).cumsum(-1) <= 1 - params.top_p
        drop[..., -1:] = False  # the most likely token always stays
        scores = scores.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    return torch.multinomial(nn.functional.softmax(scores, dim=-1), num_samples=1).squeeze(1)


def generate_positions(mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding (generate's rule; padding gets 1)."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 1)


@torch.no_grad()
def prefill(model: Any, once: dict[str, torch.Tensor]) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """The prompts' forward into a fresh ``DynamicCache``: the cache, each row's next-token logits (float) and
    the position its first response token takes (multimodal rope: the text position plus the row's rope offset from its
    images). Both decode paths start here, so their first tokens come from the same numbers."""
    from transformers import DynamicCache

    family = family_of(model)
    mask = once["attention_mask"]
    inputs = dict(once)
    family.begin_prefill(model)  # nothing of the last batch's rope offsets is kept
    given = once.get("position_ids")  # a continuation's (the engine placed them)
    if given is None and "image_grid_thw" not in once and "video_grid_thw" not in once:  # text, every rope axis
        inputs["position_ids"] = family.decode_positions(generate_positions(mask))
    cache = DynamicCache(config=model.config)
    logits = model(**inputs, past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1].float()
    if given is not None:
        return cache, logits, given.reshape(-1, *mask.shape).amax(dim=(0, 2)) + 1
    offsets = family.prefill_offsets(model, mask.shape[0], mask.device)
    return cache, logits, mask.long().sum(-1) + offsets


@torch.no_grad()
def decode(model: Any, once: dict[str, torch.Tensor], n: int, params: SamplingParams, stop_ids: list[int],
           pad_id: int, suppressed: list[int],
           check: Optional[Callable[[], None]] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``n`` responses for each row of ``once`` (prompt tensors, left-padded); returns responses (B*n, T)
    with pad after each stop token, and the raw per-token log-probs of the sampling distribution (B*n, T).
    T is the number of steps run (at most ``params.max_new_tokens``). ``check`` is called before every token
    (the engine's pressure check: raising there ends the loop)."""
    family = family_of(model)
    mask = once["attention_mask"]
    cache, logits, next_position = prefill(model, once)
    if n > 1:
        cache.batch_repeat_interleave(n)
        logits, mask, next_position = (t.repeat_interleave(n, dim=0) for t in (logits, mask, next_position))
    rows = logits.shape[0]
    live = torch.arange(rows, device=logits.device)
    stops = torch.tensor(stop_ids, dtype=torch.long, device=logits.device)
    responses = torch.full((rows, params.max_new_tokens), pad_id, dtype=torch.long, device=logits.device)
    log_probs = torch.zeros(rows, params.max_new_tokens, device=logits.device)
    torch.manual_seed(params.seed)
    steps = 0
    for step in range(params.max_new_tokens):
        if check is not None:
            check()
        token = choose(logits, params, suppressed)
        responses[live, step] = token
        log_probs[live, step] = gather_log_probs(sampling_logits(logits, params.temperature, suppressed), token)
        steps = step + 1
        running = ~torch.isin(token, stops)
        if step + 1 == params.max_new_tokens or not running.any():
            break
        if not running.all():  # finished rows leave the batch, the cache and the positions
            keep = running.nonzero().squeeze(-1)
            cache.batch_select_indices(keep)
            live, token, mask, next_position = live[keep], token[keep], mask[keep], next_position[keep]
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
        position = next_position[:, None]
        out = model(input_ids=token[:, None], attention_mask=mask, past_key_values=cache, use_cache=True,
                    position_ids=family.decode_positions(position))
        logits = out.logits[:, -1].float()
        next_position = next_position + 1
    return responses[:, :steps], log_probs[:, :steps]
