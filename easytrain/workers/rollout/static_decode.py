"""The HF engine's decode loop with fixed shapes: a static KV cache, and on CUDA each step a captured CUDA graph.

easytrain's dynamic loop (:mod:`easytrain.workers.rollout.decode`) drops finished rows, so every step can have a
new batch size and a longer cache: no graph can be captured for it, and each step pays the launch of every
kernel from Python. This loop keeps the shapes still instead:

- the batch stays ``B * n`` rows to the end: a row that produced a stop token keeps decoding, its token recorded
  as pad and its log-prob as 0, and the loop ends when every row has finished or after ``max_new_tokens``;
- the KV cache is a transformers ``StaticCache`` of length ``prompt + max_new_tokens`` rounded up
  (:data:`CACHE_BUCKET`), written in place at the cache's own position counter (a tensor on the device, so a
  replayed graph writes the next slot); the attention mask spans the whole cache from the first step (the
  prompt's left padding masked, every later slot open: slots not yet written lie in the query's causal future
  and are masked by causality);
- positions are explicit: the text position past the prompt plus the multimodal rope offset from the images.

The prefill is the dynamic loop's own (:func:`~easytrain.workers.rollout.decode.prefill`, each prompt once when
its ``n`` samples share it), into a ``DynamicCache`` whose layers are then written into the static cache's rows
(each prompt's keys repeated for its ``n`` rows), one layer at a time, so the two caches never both hold the
whole prompt. The prefill is never compiled (its shapes change with every batch).

On CUDA the one-token step goes through ``torch.compile(mode="reduce-overhead")`` (inductor kernels replayed as
CUDA graphs); elsewhere it runs eagerly (tests/test_static_decode.py checks that path and the step's dynamo
graph on CPU; tests/gpu/test_static_decode_gpu.py the compiled one on CUDA).
Token choice, seeding and the per-token ``check`` are the dynamic loop's: greedy decoding gives its tokens (and
``generate``'s), sampling its draws until the first row finishes (here finished rows still draw, so the random
stream parts after that).

The cache stays allocated between generations of the same shape (its tensors keep their addresses, so the
captured graphs replay without re-recording) until :meth:`StaticDecoder.release` (the engine's sleep, soft memory
pressure). Each new (rows, cache length) pair compiles the step again; the rounding keeps prompts of nearby
lengths on one compiled step.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional

import torch

from easytrain.algorithms.losses import gather_log_probs, sampling_logits
from easytrain.models.families import family_of
from easytrain.workers.rollout.decode import choose, prefill
from easytrain.workers.rollout.engine import SamplingParams

logger = logging.getLogger(__name__)

CACHE_BUCKET = 64
"""The static cache's length is ``prompt + max_new_tokens`` rounded up to a multiple of this, or of a sixteenth
of the power of two above it when that is larger (1024 slots and up): one compiled step (and one captured graph)
serves every prompt length in a bucket, at most 16 buckets per doubling of the length (torch._dynamo compiles a
function for at most ``recompile_limit``, 8 by default, shapes before running it eagerly), and at most 1/8 of the
attended slots are masked padding (or 63, below 1024)."""

STATIC_CACHE_CHOICES = ("auto", "on", "off")

CUDA_COMPILE: dict[str, Any] = dict(mode="reduce-overhead", fullgraph=False, dynamic=False)
"""How the step is compiled on CUDA: inductor, its kernels replayed as CUDA graphs (reduce-overhead), fixed shapes.
fullgraph=False lets a future transformers graph break cost a second graph instead of failing (with the
transformers pinned here the step traces as one graph: tests/test_static_decode.py)."""


def cache_length(prompt_len: int, max_new_tokens: int, bucket: int = CACHE_BUCKET) -> int:
    """Slots of the static cache for prompts of ``prompt_len`` tokens (see :data:`CACHE_BUCKET`)."""
    need = prompt_len + max_new_tokens
    step = max(bucket, 1 << max(0, (need - 1).bit_length() - 4))
    return -(-need // step) * step


def unsupported(model: Any) -> Optional[str]:
    """Why ``model`` cannot decode with a static cache here, or None: every decoder layer must attend fully
    (a sliding-window layer's static cache is a ring buffer this loop does not address)."""
    config = model.config.get_text_config(decoder=True)
    kinds = set(getattr(config, "layer_types", None) or ["full_attention"])
    if kinds != {"full_attention"}:
        return f"its decoder has {sorted(kinds - {'full_attention'})} layers"
    return None


def wants_static(setting: str, device: torch.device) -> bool:
    """worker.rollout.static_cache for an engine on ``device``: auto = on CUDA only."""
    if setting not in STATIC_CACHE_CHOICES:
        raise ValueError(f"worker.rollout.static_cache must be one of {STATIC_CACHE_CHOICES}, got {setting!r}")
    return setting == "on" or (setting == "auto" and device.type == "cuda")


def fill(static: Any, dynamic: Any, n: int) -> None:
    """Write the prefill's ``DynamicCache`` (B rows) into the empty ``static`` cache's B*n rows, each prompt's
    keys and values repeated for its ``n`` rows; ``dynamic`` is emptied layer by layer on the way."""
    for index, layer in enumerate(dynamic.layers):
        keys, values = layer.keys, layer.values
        layer.keys = layer.values = None  # this layer's prompt copy goes as soon as the static cache holds it
        if n > 1:
            keys, values = keys.repeat_interleave(n, dim=0), values.repeat_interleave(n, dim=0)
        static.update(keys, values, index)
        del keys, values


class StaticDecoder:
    """The static-cache decode loop over one model, with its step (compiled or eager) and its cache."""

    def __init__(self, model: Any, compile_options: Optional[dict[str, Any]] = None,
                 bucket: int = CACHE_BUCKET) -> None:
        reason = unsupported(model)
        if reason is not None:
            raise ValueError(f"worker.rollout.static_cache: the static KV cache cannot serve this model ({reason}); "
                             "set worker.rollout.static_cache=off")
        self.model = model
        self.family = family_of(model)
        self.bucket = bucket
        self.compiled = compile_options is not None
        """The step is a ``torch.compile`` (on CUDA: CUDA graphs); else it runs eagerly."""
        self._step: Callable[..., torch.Tensor] = (torch.compile(self._forward, **compile_options)
                                                   if compile_options is not None else self._forward)
        self.cache: Optional[Any] = None
        self._shape: Optional[tuple[int, int]] = None

    @classmethod
    def for_device(cls, model: Any, device: torch.device) -> "StaticDecoder":
        """Compiled into CUDA graphs on CUDA (``reduce-overhead``: inductor kernels, fixed shapes), eager elsewhere."""
        return cls(model, dict(CUDA_COMPILE) if device.type == "cuda" else None)

    def release(self) -> None:
        """Drop the cache (the next generation allocates a new one, and a compiled step records its graph again)."""
        self.cache, self._shape = None, None

    def _cache_for(self, rows: int, length: int) -> Any:
        from transformers import StaticCache

        if self.cache is not None and self._shape == (rows, length):
            self.cache.reset()  # same tensors, zeroed, position counters back to 0
            return self.cache
        self.release()  # the old cache goes before the new one is allocated
        logger.debug("static KV cache: %d rows x %d slots", rows, length)
        self.cache, self._shape = StaticCache(config=self.model.config, max_cache_len=length), (rows, length)
        return self.cache

    def _forward(self, token: torch.Tensor, position: torch.Tensor, mask: torch.Tensor, cache: Any) -> torch.Tensor:
        """One decode step of every row: ``token`` (R,), ``position`` (R, 1), ``mask`` (R, cache length); the
        next-token logits (R, V) in float32. The cache writes the slot its own counter points at."""
        positions = self.family.decode_positions(position)
        out = self.model(input_ids=token[:, None], attention_mask=mask, position_ids=positions,
                         past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float()

    @torch.no_grad()
    def decode(self, once: dict[str, torch.Tensor], n: int, params: SamplingParams, stop_ids: list[int],
               pad_id: int, suppressed: list[int],
               check: Optional[Callable[[], None]] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """:func:`easytrain.workers.rollout.decode.decode`'s contract: ``n`` responses for each row of ``once``
        (prompt tensors, left-padded); responses (B*n, T) with pad after each stop token and the raw per-token
        log-probs (B*n, T), T the steps run; ``check`` called before every token."""
        mask = once["attention_mask"]
        prompt_len = mask.shape[1]
        dynamic, logits, next_position = prefill(self.model, once)
        rows = logits.shape[0] * n
        length = cache_length(prompt_len, params.max_new_tokens, self.bucket)
        cache = self._cache_for(rows, length)
        fill(cache, dynamic, n)
        del dynamic
        if n > 1:
            logits, mask, next_position = (t.repeat_interleave(n, dim=0) for t in (logits, mask, next_position))
        device = logits.device
        full_mask = torch.ones(rows, length, dtype=torch.bool, device=device)
        full_mask[:, :prompt_len] = mask.bool()  # left padding masked; later slots open (causality hides the future)
        stops = torch.tensor(stop_ids, dtype=torch.long, device=device)
        responses = torch.full((rows, params.max_new_tokens), pad_id, dtype=torch.long, device=device)
        log_probs = torch.zeros(rows, params.max_new_tokens, device=device)
        done = torch.zeros(rows, dtype=torch.bool, device=device)
        torch.manual_seed(params.seed)
        steps = 0
        for step in range(params.max_new_tokens):
            if check is not None:
                check()
            token = choose(logits, params, suppressed).masked_fill(done, pad_id)
            responses[:, step] = token
            picked = gather_log_probs(sampling_logits(logits, params.temperature, suppressed), token)
            log_probs[:, step] = picked.masked_fill(done, 0.0)
            steps = step + 1
            done = done | torch.isin(token, stops)
            if step + 1 == params.max_new_tokens or bool(done.all()):
                break
            if self.compiled:
                torch.compiler.cudagraph_mark_step_begin()  # the last step's logits are spent: its buffers may go
            logits = self._step(token, next_position[:, None], full_mask, cache)
            next_position = next_position + 1
        return responses[:, :steps], log_probs[:, :steps]
