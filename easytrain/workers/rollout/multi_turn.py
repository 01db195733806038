"""Multi-turn rollouts with tools (``worker.rollout.multi_turn``).

A response is a conversation the model continues until it stops calling tools:

    prompt | model turn (ends in a tool call) | tool turn | model turn | ... | model turn (ends in EOS)

Each model turn is one engine call over the rows still talking; a turn that ends in a complete tool call (the
model family's format, :mod:`easytrain.tools.calls`) is cut right after the call, the tool runs in the tool
runner (a process of its own, with a timeout: :class:`easytrain.tools.runner.ToolRunner`), and its result goes
back as a tool turn rendered by the model's own chat template. Images a tool returns go into its turn as a
prompt's images do (fitted to ``data.min_pixels``/``max_pixels``, one image pad per vision token) and travel
with the row's images, after the prompt's. The response keeps every token in order; only the model's own are
trained (``response_mask``), the tool turns are context (``response_attention_mask``) with log-prob 0. The whole response, tool turns included, stays within ``data.max_response_length`` tokens: a turn
that reaches it ends the response there.

A turn samples with the step's seed moved by the turn, so a resumed run draws what the uninterrupted one did.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from easytrain.config.schema import MultiTurnConfig
from easytrain.data.images import BadSample, fit_image
from easytrain.data.vision import MM_IMAGE, VISUAL_KEYS, mm_token_type_ids
from easytrain.distributed.batch import Batch, Pixels
from easytrain.tools.calls import call_end, parse_tool_call
from easytrain.tools.registry import Tool, load_tools
from easytrain.tools.runner import ToolRunner
from easytrain.workers.rollout.engine import RolloutEngine, SamplingParams

logger = logging.getLogger(__name__)

PROMPT_KEYS = ("input_ids", "attention_mask", "mm_token_type_ids")
"""Prompt tensors a continuation rebuilds (the images and their grids are the prompt's, unchanged)."""
TURN_SEED_STRIDE = 1_000_003
"""A prime the seed moves by from one turn to the next (the engine adds the row offset to it)."""


@dataclass
class Episode:
    """One response being built: its tokens so far, which are the model's (trained), their sampling log-probs."""

    ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    trained: list[bool] = field(default_factory=list)
    call: Optional[str] = None
    """The text of the last model turn when it ended in a complete tool call (a tool turn is due)."""
    calls: int = 0
    errors: int = 0
    pixel_values: list[torch.Tensor] = field(default_factory=list)
    grids: list[torch.Tensor] = field(default_factory=list)
    """The tool turns' images (processed), in order."""
    images: list[Any] = field(default_factory=list)
    """The same images as sized for the model (PIL), for an engine that takes images (vLLM)."""
    versions: list[int] = field(default_factory=list)
    """Per token, the weight version that sampled it, -1 for a tool turn's (partial rollouts:
    :mod:`easytrain.workers.rollout.partial`)."""
    turn_start: int = 0
    """Where the model turn being written began in :attr:`ids` (after the last tool turn)."""

    def add(self, ids: list[int], log_probs: list[float], trained: bool, version: int = 0) -> None:
        self.ids += ids
        self.log_probs += log_probs
        self.trained += [trained] * len(ids)
        self.versions += [version if trained else -1] * len(ids)


@dataclass
class ToolImages:
    """How a tool's images become model inputs: the family's adapter with its image processor and placeholder
    ids (:class:`easytrain.models.families.Bound`), and the pixel bounds the prompts' images were sized by."""

    visuals: Any
    min_pixels: int
    max_pixels: int

    def process(self, images: list[Any]) -> tuple[list[int], torch.Tensor, torch.Tensor, list[Any]]:
        """Vision tokens per image, ``pixel_values``, ``image_grid_thw`` and the images as sized (BadSample: an
        image too small)."""
        layout = self.visuals.layout
        fitted = [fit_image(im, self.min_pixels, self.max_pixels, layout.factor) for im in images]
        stream = self.visuals.stream([fitted], [[]], [[MM_IMAGE] * len(fitted)])
        counts = [layout.image_tokens(im.height, im.width) for im in fitted]
        return counts, stream["pixel_values"], stream["image_grid_thw"], fitted


def tool_turn_text(tokenizer: Any, content: Any) -> str:
    """What follows a model turn that ended in a tool call, up to the next model turn: the end of the model's
    turn, the tool turn holding ``content`` and the start of the model's next turn, as the chat template renders
    them (ChatML: ``<|im_end|>\\n<|im_start|>user\\n<tool_response>...``; the template decides). ``content``: a text, or
    a list of message parts (an image: ``{"type": "image"}``)."""
    marker = "\u2063EASYTRAIN_TURN\u2063"
    user = {"role": "user", "content": "q"}
    before = tokenizer.apply_chat_template([user, {"role": "assistant", "content": marker}], tokenize=False)
    after = tokenizer.apply_chat_template([user, {"role": "assistant", "content": marker},
                                           {"role": "tool", "content": content}], tokenize=False,
                                          add_generation_prompt=True)
    cut = before.index(marker) + len(marker)
    if not after.startswith(before[:cut]):
        raise ValueError("the chat template renders a tool turn by changing the turn before it; multi-turn "
                         "rollouts need a template that appends (worker.rollout.multi_turn)")
    return after[cut:]


class MultiTurn:
    """The multi-turn loop of one rollout worker: an engine call per model turn, a tool call per tool turn."""

    def __init__(self, cfg: MultiTurnConfig, tokenizer: Any, max_length: int, tools: Optional[dict[str, Tool]] = None,
                 images: Optional[ToolImages] = None) -> None:
        self.cfg, self.tokenizer, self.max_length, self.images = cfg, tokenizer, max_length, images
        self.tools = tools if tools is not None else load_tools(cfg.tools)
        self.runner = ToolRunner(self.tools, cfg.tool_timeout_s, cfg.max_tool_output_chars)
        tool_turn_text(tokenizer, "")  # a template that cannot render tool turns fails at setup, not mid-run

    def close(self) -> None:
        self.runner.close()

    def generate(self, engine: RolloutEngine, prompts: Batch, params: SamplingParams) -> Batch:
        """``params.n`` multi-turn responses per prompt, rows grouped by prompt like a single-turn generation,
        with ``response_attention_mask`` (every token) beside ``response_mask`` (the model's tokens) and the
        per-row counts ``tool_calls`` and ``tool_errors``; when a tool returned images, every row's images
        (the prompt's, then its tool turns') and ``response_mm_token_type_ids``."""
        rows = prompts.repeat_interleave(params.n)
        episodes = [Episode() for _ in range(len(rows))]
        last = self.cfg.max_turns - 1
        self._take(episodes, list(range(len(rows))), engine.generate(prompts, params), can_call=last > 0)
        for turn in range(1, self.cfg.max_turns):
            due = [i for i, e in enumerate(episodes) if e.call is not None]
            for i in due:
                self.tool_turn(episodes[i], rows.meta["images"][i] if "images" in rows.meta else [])
            active = [i for i in due if len(episodes[i].ids) < self.max_length]  # room left for a model turn
            if not active:
                break
            budget = self.max_length - min(len(episodes[i].ids) for i in active)
            seed = (params.seed + turn * TURN_SEED_STRIDE) % 2**31
            turn_params = SamplingParams(1, params.temperature, params.top_p, params.top_k, budget, seed)
            self._take(episodes, active, engine.generate(self._continuation(rows, episodes, active), turn_params),
                       can_call=turn < last)
        return self.output(rows, episodes)

    def _take(self, episodes: list[Episode], indices: list[int], out: Batch, can_call: bool) -> None:
        """Append one model turn per row of ``out`` to ``episodes[indices]``, cut to the room left and, when a
        tool turn may follow (``can_call``), right after its tool call: the last allowed turn is kept whole, as a
        single-turn response would be."""
        for j, i in enumerate(indices):
            e = episodes[i]
            valid = out["response_mask"][j].bool()
            ids = out["responses"][j][valid].tolist()[:self.max_length - len(e.ids)]
            e.add(*self.cut(e, ids, out["rollout_log_probs"][j][valid].tolist()[:len(ids)], can_call), trained=True)

    def cut(self, e: Episode, ids: list[int], log_probs: list[float], can_call: bool) -> tuple[list[int], list[float]]:
        """What to keep of ``ids``, the next tokens of ``e``'s model turn: when a tool turn may follow
        (``can_call``), up to the end of the turn's first complete tool call, whose text goes to ``e.call`` (the
        call may have begun in the turn's tokens before these: a partial rollout writes a turn over several
        engine calls); else all of them."""
        e.call = None
        before = e.ids[e.turn_start:]
        end = self._call_end(before + ids) if can_call else None
        if end is None:
            return ids, log_probs
        keep = end - len(before)  # >= 1: the turn's earlier tokens held no complete call, or it would have ended
        e.call = self.tokenizer.decode(before + ids[:keep], skip_special_tokens=False)
        return ids[:keep], log_probs[:keep]

    def can_call(self, e: Episode) -> bool:
        """A tool turn may follow ``e``'s model turn: it is not the last of worker.rollout.multi_turn.max_turns."""
        return e.calls < self.cfg.max_turns - 1

    def _call_end(self, ids: list[int]) -> Optional[int]:
        """The fewest leading tokens of ``ids`` whose text holds a complete tool call (None: no call)."""
        if call_end(self.tokenizer.decode(ids, skip_special_tokens=False)) is None:
            return None
        low, high = 1, len(ids)  # holding a call is monotone in the prefix length: bisect
        while low < high:
            mid = (low + high) // 2
            if call_end(self.tokenizer.decode(ids[:mid], skip_special_tokens=False)) is None:
                low = mid + 1
            else:
                high = mid
        return low

    def tool_turn(self, e: Episode, images: list[Any]) -> None:
        """Run the call ``e`` ended with (a tool that takes ``images`` gets the sample's, PIL) and append its
        result as a tool turn (untrained), its images with it; a text turn is cut to the room left, a turn with
        images that does not fit is an error turn. The next model turn begins after it."""
        assert e.call is not None
        self._run_tool(e, images)
        e.turn_start = len(e.ids)

    def _run_tool(self, e: Episode, images: list[Any]) -> None:
        result = self.runner.run(parse_tool_call(e.call), {"images": list(images)})
        e.calls += 1
        e.call = None
        room = self.max_length - len(e.ids)
        failed = None if result.ok else result.error
        text = result.text
        if result.ok and result.images:
            turn = self._image_turn(result.text, result.images, room, sum(int(g.shape[0]) for g in e.grids))
            if not isinstance(turn, str):
                ids, pixel_values, grid, fitted = turn
                e.add(ids, [0.0] * len(ids), trained=False)
                e.pixel_values.append(pixel_values)
                e.grids.append(grid)
                e.images += fitted
                return
            failed, text = turn, f"error: {turn}"
        if failed is not None:
            e.errors += 1
            logger.debug("tool call failed: %s", failed)
        ids = list(self.tokenizer(tool_turn_text(self.tokenizer, text), add_special_tokens=False)["input_ids"])
        ids = ids[:room]
        e.add(ids, [0.0] * len(ids), trained=False)

    def _image_turn(self, text: str, images: list[Any], room: int, held: int) -> Any:
        """The token ids, ``pixel_values``, ``image_grid_thw`` and sized images of a tool turn with ``images``, or
        why it cannot be one (a text-only model, more images than the response may hold beside the ``held`` ones, an image
        too small, more tokens than the room left)."""
        if self.images is None:
            return "the tool returned images, and this model reads none"
        if held + len(images) > self.cfg.max_tool_images:
            return (f"the tool returned {len(images)} image(s) and {self.cfg.max_tool_images - held} more fit in "
                    "this response (worker.rollout.multi_turn.max_tool_images)")
        try:
            counts, pixel_values, grid, fitted = self.images.process(images)
        except BadSample as err:
            return f"the tool returned an image the model cannot take: {err}"
        content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
        rendered = self.images.visuals.layout.expand(tool_turn_text(self.tokenizer, content), counts)
        ids = list(self.tokenizer(rendered, add_special_tokens=False)["input_ids"])
        if len(ids) > room:
            return (f"the tool's turn with its {len(images)} image(s) takes {len(ids)} tokens and {room} are left "
                    "of data.max_response_length")
        return ids, pixel_values, grid, fitted

    def _continuation(self, rows: Batch, episodes: list[Episode], active: list[int]) -> Batch:
        return continuation(rows, episodes, active, self.tokenizer.pad_token_id, self.types)

    def types(self, ids: torch.Tensor) -> torch.Tensor:
        """``mm_token_type_ids`` of response tokens: the image pads of tool turns are image tokens."""
        return mm_token_type_ids(ids, self.images.visuals.image_token_id if self.images is not None else -1)

    def output(self, rows: Batch, episodes: list[Episode]) -> Batch:
        """The responses of ``episodes`` (one per row of ``rows``) as :meth:`generate` returns them."""
        width = max(1, max(len(e.ids) for e in episodes))
        pad = self.tokenizer.pad_token_id
        responses = torch.full((len(episodes), width), pad, dtype=torch.long)
        trained = torch.zeros((len(episodes), width), dtype=torch.float32)
        present = torch.zeros((len(episodes), width), dtype=torch.float32)
        log_probs = torch.zeros((len(episodes), width), dtype=torch.float32)
        for i, e in enumerate(episodes):
            k = len(e.ids)
            responses[i, :k] = torch.tensor(e.ids, dtype=torch.long)
            trained[i, :k] = torch.tensor(e.trained, dtype=torch.float32)
            present[i, :k] = 1.0
            log_probs[i, :k] = torch.tensor(e.log_probs, dtype=torch.float32)
        tensors = {"responses": responses, "response_mask": trained, "response_attention_mask": present,
                   "rollout_log_probs": log_probs * trained,
                   "tool_calls": torch.tensor([float(e.calls) for e in episodes]),
                   "tool_errors": torch.tensor([float(e.errors) for e in episodes])}
        if not any(e.grids for e in episodes):
            return Batch(tensors)
        tensors["response_mm_token_type_ids"] = self.types(responses) * present.long()
        counts, pixels = with_images(tensors, rows, episodes, list(range(len(episodes))))
        return Batch(tensors, image_counts=counts, pixels=pixels)



def with_images(tensors: dict[str, torch.Tensor], rows: Batch, episodes: list[Episode],
                indices: list[int]) -> tuple[Optional[torch.Tensor], Optional[Pixels]]:
    """The visuals of rows ``indices``, each row's prompt images (or videos) then its tool turns': their grids
    and, where the prompts carry them, ``visual_seconds`` (0 for a tool's still image) into ``tensors``, their
    counts per row and their patch rows (a prompt's stored once, as ``rows`` holds them)."""
    prompts = rows.select(indices) if rows.image_counts is not None and "image_grid_thw" in rows else None
    from_prompt = [0] * len(indices) if prompts is None else prompts.image_counts.tolist()  # type: ignore[union-attr]
    from_tools = [sum(int(g.shape[0]) for g in episodes[i].grids) for i in indices]
    tool_grids = [g for i in indices for g in episodes[i].grids]
    if prompts is None and not tool_grids:
        return None, None
    grids = [prompts["image_grid_thw"]] if prompts is not None else []
    parts = [prompts.pixels] if prompts is not None and prompts.pixels is not None else []
    if tool_grids:
        grids.append(torch.cat(tool_grids))
        tool_rows = torch.cat([p for i in indices for p in episodes[i].pixel_values])
        parts.append(Pixels.of(tool_rows, grids[-1].prod(-1)))
    order, prompt_next, tool_next = [], 0, sum(from_prompt)  # row by row: its prompt's visuals, its tools'
    for own, tools in zip(from_prompt, from_tools):
        order += [*range(prompt_next, prompt_next + own), *range(tool_next, tool_next + tools)]
        prompt_next, tool_next = prompt_next + own, tool_next + tools
    index = torch.tensor(order, dtype=torch.long)
    tensors["image_grid_thw"] = torch.cat(grids)[index]
    if prompts is not None and "visual_seconds" in prompts:  # a video's temporal positions step by it
        still = torch.zeros(sum(from_tools), dtype=prompts["visual_seconds"].dtype)
        tensors["visual_seconds"] = torch.cat([prompts["visual_seconds"], still])[index]
    return torch.tensor([p + t for p, t in zip(from_prompt, from_tools)]), Pixels.concat(parts).take(index)


def continuation(rows: Batch, episodes: list[Episode], active: list[int], pad: int,
                 types: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
    """The prompts that continue ``active`` rows: each one's prompt and its response so far (``episodes``),
    left-padded, with its visuals (the prompt's, then its tool turns'); ``types`` gives the response tokens'
    ``mm_token_type_ids``. A multi-turn rollout's next model turn, a partial rollout's next call."""
    sub = rows.select(active)
    sequences, kinds = [], []
    for j, i in enumerate(active):
        present = sub["attention_mask"][j].bool()
        so_far = torch.tensor(episodes[i].ids, dtype=sub["input_ids"].dtype)
        sequences.append(torch.cat([sub["input_ids"][j][present], so_far]))
        if "mm_token_type_ids" in sub:
            prompt_types = sub["mm_token_type_ids"][j][present]
            kinds.append(torch.cat([prompt_types, types(so_far).to(prompt_types.dtype)]))
    width = max(len(s) for s in sequences)

    def left(values: list[torch.Tensor], fill: int) -> torch.Tensor:
        return torch.stack([torch.nn.functional.pad(v, (width - len(v), 0), value=fill) for v in values])

    tensors = {k: v for k, v in sub.tensors.items() if k not in PROMPT_KEYS + VISUAL_KEYS}
    tensors["input_ids"] = left(sequences, pad)
    tensors["attention_mask"] = left([torch.ones(len(s), dtype=sub["attention_mask"].dtype) for s in sequences], 0)
    if kinds:
        tensors["mm_token_type_ids"] = left(kinds, 0)
    meta = dict(sub.meta)
    if "images" in meta:  # an engine that takes images (vLLM): the prompt's, then the tool turns', sized
        meta["images"] = [list(meta["images"][j]) + episodes[i].images for j, i in enumerate(active)]
    return Batch(tensors, meta, *with_images(tensors, rows, episodes, active))
