"""Partial rollouts (issue 51, ``trainer.rollout_mode=async``; this module is its engine side): a generation
left unfinished is kept and continued by a later call, under whatever weights the engine holds by then, and
every token records the weight version it was sampled under.

A call (:meth:`PartialRollouts.advance`) generates at most ``tokens`` more for each sample still running. A
sample that produced a stop token or reached ``max_new_tokens`` is finished; the others wait with their tokens,
the sampling log-probs of those tokens and their versions. The next call continues them: each one's prompt
and response so far are prefilled under the engine's current weights (their keys and values are computed
again with those weights; nothing of the old weights' cache is kept), and the response goes on. A token keeps
the log-prob of the weights that sampled it, so a PPO ratio against the engine's log-probs (as
``one_step_off`` takes it, :mod:`easytrain.trainer.ahead`) is taken against each token's own behaviour
policy.

Images stay whole: a continuation carries its prompt's images and videos as the prompt did (the same pixel
rows, grids and seconds per temporal patch), built as a multi-turn continuation is
(:func:`easytrain.workers.rollout.multi_turn.continuation`).

Multi-turn episodes (``worker.rollout.multi_turn``) continue the same way: a model turn may span calls, and
the tool call that ends it is looked for in the whole turn so far, so one begun in a call and closed in the
next ends the turn where the synchronous loop would. The tool runs as soon as the call that closed it
returns, its turn (and its images) joins the response untrained (version -1), and the next call goes on with
the model's next turn.

A call samples with the seed moved by the number of calls before it, so the same calls under the same weights
draw the same tokens.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Optional, Sequence

import torch

from easytrain.distributed.batch import Batch
from easytrain.models.families import Family
from easytrain.workers.rollout.engine import RolloutEngine, SamplingParams
from easytrain.workers.rollout.multi_turn import Episode, MultiTurn, continuation
from easytrain.workers.sequences import assemble

CALL_SEED_STRIDE = 7_919
"""A prime the seed moves by from one call to the next."""


def text_types(ids: torch.Tensor) -> torch.Tensor:
    """``mm_token_type_ids`` of sampled tokens: text (the engine never samples a vision placeholder)."""
    return torch.zeros_like(ids)


class PartialRollouts:
    """The ``params.n`` samples of each prompt of a batch, generated over as many engine calls as they take."""

    def __init__(self, prompts: Batch, params: SamplingParams, pad_id: int, stop_ids: Sequence[int],
                 turns: Optional[MultiTurn] = None) -> None:
        self.prompts, self.turns = prompts, turns
        self.rows = prompts.repeat_interleave(params.n)
        self.params, self.pad_id, self.stop_ids = params, pad_id, set(stop_ids)
        self.samples = [Episode() for _ in range(len(self.rows))]
        self.done = [False] * len(self.rows)
        self.calls = 0
        self.first_version: Optional[int] = None
        """The weight version of the first call (the oldest tokens' version)."""
        self.taken: set[int] = set()
        """The prompts whose finished groups :meth:`finished_groups` returned."""

    @property
    def running(self) -> list[int]:
        """The samples not finished yet, in row order."""
        return [i for i, done in enumerate(self.done) if not done]

    def advance(self, engine: RolloutEngine, tokens: int, version: int) -> list[int]:
        """Generate up to ``tokens`` more for every running sample with the engine's weights, ``version``;
        returns the samples this call finished."""
        active = self.running
        if not active or tokens < 1:
            return []
        if self.first_version is None:
            self.first_version = version
        p = self.params
        room = [p.max_new_tokens - len(self.samples[i].ids) for i in active]
        seed = (p.seed + self.calls * CALL_SEED_STRIDE) % 2**31
        call = SamplingParams(1, p.temperature, p.top_p, p.top_k, min(tokens, max(room)), seed)
        types = self.turns.types if self.turns is not None else text_types
        prompts = continuation(self.rows, self.samples, active, self.pad_id, types)
        if self.turns is None:  # text so far: placed where the decode that sampled it placed it
            prompts.tensors["continued"] = torch.tensor([len(self.samples[i].ids) for i in active])
        out = engine.generate(prompts, call)
        self.calls += 1
        finished = []
        for j, i in enumerate(active):
            e, valid = self.samples[i], out["response_mask"][j].bool()
            ids = out["responses"][j][valid].tolist()[:room[j]]  # a row with less room stops at its own budget
            log_probs = out["rollout_log_probs"][j][valid].tolist()[:len(ids)]
            if self.turns is not None:
                ids, log_probs = self.turns.cut(e, ids, log_probs, self.turns.can_call(e))
            e.add(ids, log_probs, True, version)
            stopped = bool(ids) and ids[-1] in self.stop_ids
            if e.call is not None:  # the turn ended in a tool call: its result joins the response now
                assert self.turns is not None
                self.turns.tool_turn(e, self.rows.meta["images"][i] if "images" in self.rows.meta else [])
                stopped = False
            if stopped or len(e.ids) >= p.max_new_tokens:
                self.done[i] = True
                finished.append(i)
        return finished

    def finish(self, engine: RolloutEngine, version: int) -> None:
        """Generate every running sample to its end with the weights of ``version`` (algorithm.max_staleness): one
        call, or one per model turn of a multi-turn episode (a tool turn runs between them)."""
        while self.running:
            self.advance(engine, self.params.max_new_tokens, version)

    def state(self) -> dict[str, Any]:
        """What continues these rollouts exactly after a restart (:meth:`restored`): the prompts, each sample's
        tokens, log-probs, versions and (multi-turn) tool turns so far, which finished, the calls made (the seeds'
        part); the tool turns' images under ``tensors``."""
        tensors = {f"tool/{i}/{k}/{name}": t for i, e in enumerate(self.samples)
                   for k, pair in enumerate(zip(e.pixel_values, e.grids))
                   for name, t in zip(("pixel_values", "grid"), pair)}
        return {"prompts": self.prompts, "params": asdict(self.params), "pad_id": self.pad_id,
                "stop_ids": sorted(self.stop_ids), "done": list(self.done), "calls": self.calls,
                "first_version": self.first_version, "taken": sorted(self.taken), "tensors": tensors,
                "samples": [[e.ids, e.log_probs, e.versions, e.trained, e.calls, e.errors, e.turn_start,
                             len(e.grids)] for e in self.samples]}

    @staticmethod
    def restored(state: dict[str, Any], turns: Optional[MultiTurn] = None) -> "PartialRollouts":
        out = PartialRollouts(state["prompts"], SamplingParams(**state["params"]), state["pad_id"], state["stop_ids"],
                              turns)
        out.done, out.calls, out.first_version = list(state["done"]), state["calls"], state["first_version"]
        out.taken = set(state["taken"])
        tensors = state.get("tensors", {})
        for i, (e, sample) in enumerate(zip(out.samples, state["samples"])):
            ids, log_probs, versions, *rest = sample  # before tool turns were kept: the three lists alone
            trained, e.calls, e.errors, e.turn_start, images = rest or [[True] * len(ids), 0, 0, 0, 0]
            e.ids, e.log_probs, e.versions, e.trained = list(ids), list(log_probs), list(versions), list(trained)
            e.pixel_values = [tensors[f"tool/{i}/{k}/pixel_values"] for k in range(images)]
            e.grids = [tensors[f"tool/{i}/{k}/grid"] for k in range(images)]
        return out

    def finished_groups(self, family: Optional[Family]) -> list[Batch]:
        """Each prompt whose ``n`` samples have all finished since the last call, assembled with its prompt
        (:func:`~easytrain.workers.sequences.assemble`) at its own widths: a group trains whole (its advantages
        are relative to each other)."""
        n, groups = self.params.n, []
        for prompt in range(len(self.prompts)):
            if prompt not in self.taken and all(self.done[prompt * n:(prompt + 1) * n]):
                self.taken.add(prompt)
                out = self.output(range(prompt * n, (prompt + 1) * n))
                group = assemble(self.prompts.select([prompt]), out, n, family)
                meta = {k: v for k, v in group.meta.items() if k != "images"}  # PIL, for the engine and tools only
                groups.append(Batch(group.tensors, meta, group.image_counts, group.pixels))
        return groups

    def output(self, indices: Sequence[int]) -> Batch:
        """Samples ``indices`` as an engine returns responses: ``responses`` (pad after each), ``response_mask``,
        ``rollout_log_probs`` and ``token_versions`` (the weight version per token, -1 off the mask); multi-turn
        ones as :meth:`MultiTurn.generate` returns them (tool turns and their images too)."""
        chosen = [self.samples[i] for i in indices]
        if self.turns is not None:
            out = self.turns.output(self.rows.select(list(indices)), chosen)
            versions = torch.full(out["responses"].shape, -1, dtype=torch.long)
            for row, e in enumerate(chosen):
                versions[row, :len(e.ids)] = torch.tensor(e.versions, dtype=torch.long)
            out.tensors["token_versions"] = versions
            return out
        width = max(1, max(len(e.ids) for e in chosen))
        responses = torch.full((len(chosen), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(chosen), width), dtype=torch.float32)
        log_probs = torch.zeros((len(chosen), width), dtype=torch.float32)
        versions = torch.full((len(chosen), width), -1, dtype=torch.long)
        for row, e in enumerate(chosen):
            k = len(e.ids)
            responses[row, :k] = torch.tensor(e.ids, dtype=torch.long)
            mask[row, :k] = 1.0
            log_probs[row, :k] = torch.tensor(e.log_probs, dtype=torch.float32)
            versions[row, :k] = torch.tensor(e.versions, dtype=torch.long)
        return Batch({"responses": responses, "response_mask": mask, "rollout_log_probs": log_probs,
                      "token_versions": versions})
