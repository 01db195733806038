"""A two-turn rollout on a given engine, for the vLLM tests (text: test_vllm_engine.py, images: test_vllm_images.py).
Pickled by value into the engine's Ray actor (``ray.cloudpickle.register_pickle_by_value``): that process cannot
import the tests folder."""

from __future__ import annotations

from typing import Any, Optional

from easytrain.distributed.batch import Batch
from easytrain.workers.rollout.engine import SamplingParams, pad_responses


class FirstTurnGiven:
    """An engine whose first generation is ``call`` for every row (a random model writes no tool call); later
    ones are ``engine``'s."""

    def __init__(self, engine: Any, tokens: list[int], spec: Any) -> None:
        self.engine, self.tokens, self.spec, self.calls = engine, tokens, spec, 0

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        self.calls += 1
        if self.calls > 1:
            return self.engine.generate(prompts, params)
        rows = [list(self.tokens)] * (len(prompts) * params.n)
        return pad_responses(rows, [[0.0] * len(self.tokens)] * len(rows), self.spec.pad_id, self.spec.stop_ids)


def two_turns(engines: list[Any], spec: Any, tokenizer: Any, prompts: Batch, params: SamplingParams,
              call: list[int], tools: list[str], length: int, images: Optional[Any] = None) -> list[Batch]:
    """The same rollout on each of ``engines``: the first model turn is ``call``, the tool runs (``images``: how
    its images become model inputs, :class:`easytrain.workers.rollout.multi_turn.ToolImages`), and the second
    turn continues the conversation."""
    from easytrain.config.schema import MultiTurnConfig
    from easytrain.workers.rollout.multi_turn import MultiTurn

    outs = []
    for engine in engines:
        turns = MultiTurn(MultiTurnConfig(enable=True, max_turns=2, tools=tools, max_tool_images=2), tokenizer,
                          length, images=images)
        try:
            outs.append(turns.generate(FirstTurnGiven(engine, call, spec), prompts, params))
        finally:
            turns.close()
    return outs
