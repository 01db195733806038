"""Multi-turn rollouts with tools (``worker.rollout.multi_turn``).

A response is a conversation the model continues until it stops calling tools:

    prompt | model turn (ends in a tool call) | tool turn | model turn | ... | model turn (ends in EOS)

Each model turn is one engine call over the rows still talking; a turn that ends in a complete tool call (the
model family's format, :mod:`easytrain.tools.calls`) is cut right after the call, the tool runs in the tool
runner (a process of its own, with a timeout: :class:`easytrain.tools.runner.ToolRunner`), and its result goes
back as a tool turn rendered by the model's own chat template. The response keeps every token in order; only
the model's own are trained (``response_mask``), the tool turns are context (``response_attention_mask``) with
log-prob 0. The whole response, tool turns included, stays within ``data.max_response_length`` tokens: a turn
that reaches it ends the response there.

A turn samples with the step's seed moved by the turn, so a resumed run draws what the uninterrupted one did.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from easytrain.config.schema import MultiTurnConfig
from easytrain.distributed.batch import Batch
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

    def add(self, ids: list[int], log_probs: list[float], trained: bool) -> None:
        self.ids += ids
        self.log_probs += log_probs
        self.trained += [trained] * len(ids)


def tool_turn_text(tokenizer: Any, content: str) -> str:
    """What follows a model turn that ended in a tool call, up to the next model turn: the end of the model's
    turn, the tool turn holding ``content`` and the start of the model's next turn, as the chat template renders
    them (Qwen: ``<|im_end|>\\n<|im_start|>user\\n<tool_response>...``; the template decides)."""
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

    def __init__(self, cfg: MultiTurnConfig, tokenizer: Any, max_length: int, tools: Optional[dict[str, Tool]] = None
                 ) -> None:
        self.cfg, self.tokenizer, self.max_length = cfg, tokenizer, max_length
        self.tools = tools if tools is not None else load_tools(cfg.tools)
        self.runner = ToolRunner(self.tools, cfg.tool_timeout_s, cfg.max_tool_output_chars)
        tool_turn_text(tokenizer, "")  # a template that cannot render tool turns fails at setup, not mid-run

    def close(self) -> None:
        self.runner.close()

    def generate(self, engine: RolloutEngine, prompts: Batch, params: SamplingParams) -> Batch:
        """``params.n`` multi-turn responses per prompt, rows grouped by prompt like a single-turn generation,
        with ``response_attention_mask`` (every token) beside ``response_mask`` (the model's tokens) and the
        per-row counts ``tool_calls`` and ``tool_errors``."""
        rows = prompts.repeat_interleave(params.n)
        episodes = [Episode() for _ in range(len(rows))]
        last = self.cfg.max_turns - 1
        self._take(episodes, list(range(len(rows))), engine.generate(prompts, params), can_call=last > 0)
        for turn in range(1, self.cfg.max_turns):
            due = [i for i, e in enumerate(episodes) if e.call is not None]
            for i in due:
                self._tool_turn(episodes[i])
            active = [i for i in due if len(episodes[i].ids) < self.max_length]  # room left for a model turn
            if not active:
                break
            budget = self.max_length - min(len(episodes[i].ids) for i in active)
            seed = (params.seed + turn * TURN_SEED_STRIDE) % 2**31
            turn_params = SamplingParams(1, params.temperature, params.top_p, params.top_k, budget, seed)
            self._take(episodes, active, engine.generate(self._continuation(rows, episodes, active), turn_params),
                       can_call=turn < last)
        return self._output(episodes)

    def _take(self, episodes: list[Episode], indices: list[int], out: Batch, can_call: bool) -> None:
        """Append one model turn per row of ``out`` to ``episodes[indices]``, cut to the room left and, when a
        tool turn may follow (``can_call``), right after its tool call: the last allowed turn is kept whole, as a
        single-turn response would be."""
        for j, i in enumerate(indices):
            e = episodes[i]
            valid = out["response_mask"][j].bool()
            ids = out["responses"][j][valid].tolist()[:self.max_length - len(e.ids)]
            log_probs = out["rollout_log_probs"][j][valid].tolist()[:len(ids)]
            end = self._call_end(ids) if can_call else None
            e.call = None
            if end is not None:
                ids, log_probs = ids[:end], log_probs[:end]
                e.call = self.tokenizer.decode(ids, skip_special_tokens=False)
            e.add(ids, log_probs, trained=True)

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

    def _tool_turn(self, e: Episode) -> None:
        """Run the call ``e`` ended with and append its result as a tool turn (untrained), cut to the room left."""
        assert e.call is not None
        result = self.runner.run(parse_tool_call(e.call))
        e.calls += 1
        if not result.ok:
            e.errors += 1
            logger.debug("tool call failed: %s", result.error)
        ids = self.tokenizer(tool_turn_text(self.tokenizer, result.text), add_special_tokens=False)["input_ids"]
        ids = list(ids)[:self.max_length - len(e.ids)]
        e.add(ids, [0.0] * len(ids), trained=False)
        e.call = None

    def _continuation(self, rows: Batch, episodes: list[Episode], active: list[int]) -> Batch:
        """The prompts of the next model turn: each active row's prompt and its response so far, left-padded."""
        sub = rows.select(active)
        pad = self.tokenizer.pad_token_id
        sequences, types = [], []
        for j, i in enumerate(active):
            present = sub["attention_mask"][j].bool()
            so_far = torch.tensor(episodes[i].ids, dtype=sub["input_ids"].dtype)
            sequences.append(torch.cat([sub["input_ids"][j][present], so_far]))
            if "mm_token_type_ids" in sub:
                prompt_types = sub["mm_token_type_ids"][j][present]
                types.append(torch.cat([prompt_types, torch.zeros(len(so_far), dtype=prompt_types.dtype)]))
        width = max(len(s) for s in sequences)

        def left(values: list[torch.Tensor], fill: int) -> torch.Tensor:
            return torch.stack([torch.nn.functional.pad(v, (width - len(v), 0), value=fill) for v in values])

        tensors = {k: v for k, v in sub.tensors.items() if k not in PROMPT_KEYS}
        tensors["input_ids"] = left(sequences, pad)
        tensors["attention_mask"] = left([torch.ones(len(s), dtype=sub["attention_mask"].dtype) for s in sequences], 0)
        if types:
            tensors["mm_token_type_ids"] = left(types, 0)
        return Batch(tensors, sub.meta, sub.image_counts)

    def _output(self, episodes: list[Episode]) -> Batch:
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
        return Batch({"responses": responses, "response_mask": trained, "response_attention_mask": present,
                      "rollout_log_probs": log_probs * trained,
                      "tool_calls": torch.tensor([float(e.calls) for e in episodes]),
                      "tool_errors": torch.tensor([float(e.errors) for e in episodes])})
