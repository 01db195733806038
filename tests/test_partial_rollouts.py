"""Partial rollouts (issue 51): a response left unfinished by one engine call is continued by the next, under the
weights a sync brought in between; every token records the version that sampled it and the log-prob the PPO
ratio will use, which must be the sampling weights' own, as a teacher-forced forward computes it."""

from __future__ import annotations

import copy
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
import torch

from easytrain.distributed.batch import Batch
from easytrain.models.families import family_of
from easytrain.workers.forward import response_log_probs
from easytrain.workers.rollout.engine import RolloutEngine, SamplingParams, pad_responses
from easytrain.workers.rollout.hf_engine import HFEngine
from easytrain.workers.rollout.partial import PartialRollouts
from easytrain.workers.sequences import assemble, join_assembled

from test_decode import CPU, setup

FIRST = 4
"""Tokens of the first call, under version 0; the rest come under version 1."""


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "internvl", "gemma3", "qwen2"])
def test_a_response_continued_across_a_weight_sync_keeps_each_tokens_version_and_log_prob(family: str,
                                                                                       tmp_path: Path) -> None:
    model, prompts, tokenizer, stops = setup(tmp_path, family)
    before = copy.deepcopy(model)  # the weights of version 0, for the independent forward
    engine = HFEngine(model, stops, tokenizer.pad_token_id, CPU)
    params = SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=10, seed=3)
    rollouts = PartialRollouts(prompts, params, tokenizer.pad_token_id, stops)
    rollouts.advance(engine, FIRST, version=0)
    unfinished = rollouts.running
    assert unfinished  # some responses wait for the next call

    generator = torch.Generator().manual_seed(1)  # the sync: other weights, streamed in as a sync streams them
    new = {name: p + 0.5 * p.std() * torch.randn(p.shape, generator=generator) if p.dim() == 2 else p.clone()
           for name, p in model.state_dict().items()}
    engine.begin_weight_update()
    engine.load_weights(new.items())
    engine.finish_weight_update()
    while rollouts.running:
        rollouts.advance(engine, 3, version=1)

    out = rollouts.output(range(len(rollouts.samples)))
    mask = out["response_mask"].bool()
    lengths = mask.sum(-1)
    versions = out["token_versions"]
    for row, length in enumerate(lengths.tolist()):
        expected = [0] * min(FIRST, length) + [1] * max(0, length - FIRST)
        assert versions[row, :length].tolist() == expected
        assert (versions[row, length:] == -1).all()
    assert (versions[mask] == 1).any() and (versions[mask] == 0).any()

    batch = assemble(prompts, out, params.n, family_of(model))
    old, _ = response_log_probs(before.eval(), batch, params.temperature, CPU)
    now, _ = response_log_probs(model.eval(), batch, params.temperature, CPU)
    expected = torch.where(versions == 0, old, now)
    torch.testing.assert_close(out["rollout_log_probs"][mask], expected[mask], rtol=1e-4, atol=1e-4)
    later = mask & (versions == 1)
    assert (old[later] - now[later]).abs().max() > 1e-2  # the sync changed what the continued tokens are worth


def prompt_side(batch: Batch, row: int) -> dict[str, torch.Tensor]:
    """What sample ``row`` of an assembled batch gives the model besides its response: its prompt tokens, their
    token types and position ids (the columns its attention mask keeps before the responses), its images' grids
    and patch rows."""
    width = batch["input_ids"].shape[1] - batch["responses"].shape[1]
    keep = batch["attention_mask"][row, :width].bool()
    positions = batch["position_ids"]
    one = batch.select([row])
    out = {"ids": batch["input_ids"][row, :width][keep], "types": batch["mm_token_type_ids"][row, :width][keep],
           "positions": (positions[:, row] if positions.dim() == 3 else positions[row])[..., :width][..., keep],
           "grids": one["image_grid_thw"], "pixels": one["pixel_values"]}
    if "visual_seconds" in one:
        out["seconds"] = one["visual_seconds"]
    return out


def wider(prompts: Batch, columns: int) -> Batch:
    """``prompts`` with ``columns`` more columns of left padding (a batch whose longest prompt was longer)."""
    tensors = dict(prompts.tensors)
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        tensors[key] = torch.nn.functional.pad(tensors[key], (columns, 0))
    return Batch(tensors, prompts.meta, prompts.image_counts, prompts.pixels)


def test_a_sample_trains_on_the_same_images_and_prompt_in_both_modes(tmp_path: Path) -> None:
    """trainer.rollout_mode=async assembles each finished group on its own and joins groups of other widths; a
    sample must still carry what a sync rollout of the same prompt carries: its image's patch rows and grid, its
    prompt's tokens, types and multimodal positions."""
    model, prompts, tokenizer, stops = setup(tmp_path, "qwen2_5_vl")
    engine = HFEngine(model, stops, tokenizer.pad_token_id, CPU)
    params = SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=10, seed=3)
    family = family_of(model)
    sync = assemble(prompts, engine.generate(prompts, params), params.n, family)
    half = len(prompts) // 2
    batches = [prompts.select(range(half)), wider(prompts.select(range(half, len(prompts))), 3)]
    groups = []
    for batch in batches:  # two loader batches, of other prompt widths
        rollouts = PartialRollouts(batch, params, tokenizer.pad_token_id, stops)
        for version in range(5):
            rollouts.advance(engine, 3, version)
            groups += rollouts.finished_groups(family)
        assert not rollouts.running
    partial = join_assembled(groups[::-1])  # finished in another order than the prompts'
    assert partial.image_counts is not None and int(partial.image_counts.sum()) == int(sync.image_counts.sum())
    assert_same_samples(partial, sync, prompt_side)


def sample_inputs(batch: Batch, row: int) -> dict[str, torch.Tensor]:
    """Everything sample ``row`` of an assembled batch gives the model and the loss, without its padding: the tokens
    it attends to, their types and positions, which are trained, and its visuals (grids, seconds, patch rows)."""
    keep = batch["attention_mask"][row].bool()
    positions = batch["position_ids"]
    width = batch["responses"].shape[1]
    one = batch.select([row])
    out = {"ids": batch["input_ids"][row][keep], "types": batch["mm_token_type_ids"][row][keep],
           "positions": (positions[:, row] if positions.dim() == 3 else positions[row])[..., keep],
           "trained": batch["response_mask"][row][keep[-width:]], "grids": one["image_grid_thw"],
           "pixels": one["pixel_values"]}
    if "visual_seconds" in one:
        out["seconds"] = one["visual_seconds"]
    return out


def assert_same_samples(partial: Batch, sync: Batch, inputs: Callable[[Batch, int], dict[str, torch.Tensor]]) -> None:
    """Each sample of ``partial`` carries the ``inputs`` the sync sample of its prompt does (a prompt's samples in
    order)."""
    seen: dict[str, int] = {}
    for row, uid in enumerate(partial.meta["uids"]):
        twin = [r for r, u in enumerate(sync.meta["uids"]) if u == uid][seen.get(uid, 0)]
        seen[uid] = seen.get(uid, 0) + 1
        mine, theirs = inputs(partial, row), inputs(sync, twin)
        assert mine.keys() == theirs.keys() and len(mine["pixels"]) > 0
        for key in mine:
            assert torch.equal(mine[key], theirs[key]), (uid, key)


def test_a_video_prompt_continued_over_calls_keeps_its_clips_seconds(tmp_path: Path) -> None:
    """Video rows (Qwen2.5-VL: temporal positions step by the clip's seconds per patch; at 0.05 fps they reach past
    the text after the clip) generated 1 token per call: each continuation carries the clips' seconds, so every
    token's sampling log-prob is the training forward's over the assembled rows, and each sample carries the
    inputs a sync rollout of its prompt does."""
    from test_video import actor_model, prompts_with_both, video_config

    config = video_config(tmp_path, "qwen2_5_vl", "data.video_fps=0.05")
    prompts = prompts_with_both(config)
    model = actor_model(config)
    family = family_of(model)
    engine = HFEngine(model, [-1], 0, CPU)  # no stop: 4 tokens each
    params = SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=4, seed=5)
    rollouts = PartialRollouts(prompts, params, 0, [-1])
    groups = []
    for version in range(4):
        rollouts.advance(engine, 1, version)
        groups += rollouts.finished_groups(family)
    assert not rollouts.running
    partial = join_assembled(groups)
    lp, _ = response_log_probs(model.eval(), partial, 1.0, CPU)
    torch.testing.assert_close(lp, partial["rollout_log_probs"], rtol=1e-4, atol=1e-4)
    assert partial["token_versions"].tolist() == [[0, 1, 2, 3]] * len(partial)
    sync = assemble(prompts, engine.generate(prompts, params), params.n, family)
    assert "visual_seconds" in partial and (partial["visual_seconds"] > 0).any()
    assert_same_samples(partial, sync, prompt_side)


class ChatScript(RolloutEngine):
    """Writes a fixed conversation's model turns as a model would, from the rows it is given: the turn is the
    number of assistant turns begun after the prompt's, the place in it the tokens since the last one began. A turn
    written over several calls is the same turn (log-prob -0.5 a token)."""

    def __init__(self, turns: list[list[int]], begin: list[int], stop_ids: list[int], pad_id: int) -> None:
        self.turns, self.begin, self.stop_ids, self.pad_id = turns, begin, stop_ids, pad_id

    @classmethod
    def build(cls, config: Any, spec: Any) -> "ChatScript":
        raise NotImplementedError

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        rows = []
        for r in range(len(prompts)):
            seq = prompts["input_ids"][r][prompts["attention_mask"][r].bool()].tolist()
            k = len(self.begin)
            starts = [i + k for i in range(len(seq) - k + 1) if seq[i:i + k] == self.begin]
            turn, written = len(starts) - 1, len(seq) - starts[-1]
            rows += [self.turns[turn][written:written + params.max_new_tokens]] * params.n
        return pad_responses(rows, [[-0.5] * len(row) for row in rows], self.pad_id, self.stop_ids)

    def load_weights(self, weights: Any) -> int:
        return 0


def through_a_checkpoint(rollouts: PartialRollouts, turns: Any) -> PartialRollouts:
    """``rollouts`` after the trip a driver's checkpoint makes: prompts packed (their PIL images as pixels), every
    tensor through a safetensors file, the rest through JSON."""
    import json

    from safetensors.torch import load_file, save_file

    from easytrain.trainer.ahead import pack, unpack

    state = rollouts.state()
    tensors, meta = pack(state.pop("prompts"), "prompts/")
    tensors.update({f"tools/{k}": v.contiguous() for k, v in state.pop("tensors").items()})
    with tempfile.TemporaryDirectory() as folder:
        save_file(tensors, f"{folder}/state.safetensors")
        tensors = load_file(f"{folder}/state.safetensors")
    state = json.loads(json.dumps(state))
    state["prompts"] = unpack(tensors, meta, "prompts/")
    for before, after in zip(rollouts.prompts.meta["images"], state["prompts"].meta["images"]):
        assert [(im.mode, im.tobytes()) for im in before] == [(im.mode, im.tobytes()) for im in after]
    state["tensors"] = {k[len("tools/"):]: v for k, v in tensors.items() if k.startswith("tools/")}
    return PartialRollouts.restored(state, turns)


@dataclass
class Conversation:
    """A scripted conversation on the tiny Qwen2.5-VL with image prompts: a tool call that returns an image, one
    that reads the sample's own image, an answer."""

    config: Any
    prompts: Batch
    tokenizer: Any
    end: int
    engine: ChatScript
    turns: Any
    params: SamplingParams
    family: Any


@pytest.fixture
def conversation(tmp_path: Path) -> Iterator[Conversation]:
    from easytrain.models.hf import load_model, model_folder
    from easytrain.trainer.data import RLData
    from easytrain.workers.rollout.multi_turn import MultiTurn, ToolImages
    from rl_batches import rl_config

    tools = Path(__file__).resolve().parent / "assets" / "turn_tools.py"
    config = rl_config(tmp_path, "worker.rollout.multi_turn.enable=true", "worker.rollout.multi_turn.max_turns=3",
                       f"worker.rollout.multi_turn.tools=[{tools}:paint,{tools}:size]", "data.max_response_length=256")
    data = RLData(config)
    tok, d = data.tokenizer, config.data
    end = tok.convert_tokens_to_ids("<|im_end|>")

    def text(value: str) -> list[int]:
        return list(tok(value, add_special_tokens=False)["input_ids"])

    script = [text('<tool_call>\n{"name": "paint", "arguments": {"colour": "red"}}\n</tool_call> and then') + [end],
              text('<tool_call>\n{"name": "size", "arguments": {}}\n</tool_call>') + [end], text("3") + [end]]
    turns = MultiTurn(config.worker.rollout.multi_turn, tok, d.max_response_length,
                      images=ToolImages(data.visuals(), d.min_pixels, d.max_pixels))
    try:
        yield Conversation(config, next(data.train_batches()).select([0, 1]), tok, end,
                           ChatScript(script, text("<|im_start|>assistant\n"), [end], tok.pad_token_id), turns,
                           SamplingParams(n=2, temperature=1.0, top_p=1.0, top_k=0,
                                          max_new_tokens=d.max_response_length, seed=0),
                           family_of(load_model(config.model, model_folder(config.model))))
    finally:
        turns.close()


def test_a_multi_turn_episode_with_tool_images_continues_over_calls_and_trains_as_the_sync_one(
        conversation: Conversation) -> None:
    """The conversation written by the sync loop in one call per turn and by partial rollouts 5 tokens a call, the
    state taken through a checkpoint after every call: each sample carries the same tokens, trained mask,
    positions, prompt and tool images; tool tokens have no version, the model's the call's that wrote them; a
    group stays within the bound the queue reserves for it."""
    from easytrain.trainer.asynchronous import group_bound, host_bytes, tool_image_bytes

    c = conversation
    sync = assemble(c.prompts, c.turns.generate(c.engine, c.prompts, c.params), c.params.n, c.family)
    rollouts, groups = PartialRollouts(c.prompts, c.params, c.tokenizer.pad_token_id, [c.end], c.turns), []
    for version in range(40):
        rollouts.advance(c.engine, 5, version)
        groups += rollouts.finished_groups(c.family)
        if not rollouts.running:
            break
        rollouts = through_a_checkpoint(rollouts, c.turns)
    assert not rollouts.running and version > 3
    partial = join_assembled(groups)
    assert_same_samples(partial, sync, sample_inputs)
    assert partial["tool_calls"].tolist() == sync["tool_calls"].tolist() == [2.0] * 4
    image = c.prompts.meta["images"][0][0]
    first = c.tokenizer.decode(partial["responses"][0][partial["response_attention_mask"][0].bool()])
    assert f"{image.width}x{image.height}" in first  # the size tool saw the prompt's image after every trip
    versions, trained = partial["token_versions"], partial["response_mask"].bool()
    present = partial["response_attention_mask"].bool()
    assert (versions[present & ~trained] == -1).all() and (versions[trained] >= 0).all()
    assert versions[trained].unique().numel() > 3  # the model's turns were written over many calls
    n, length = c.params.n, c.config.data.max_response_length
    for group in groups:
        row = c.prompts.select([c.prompts.meta["uids"].index(group.meta["uids"][0])])
        assert host_bytes(group) <= group_bound(row, n, length, tool_image_bytes(c.config))


def test_max_staleness_finishes_a_multi_turn_episode_under_one_version(conversation: Conversation) -> None:
    """algorithm.max_staleness's forced finish (:meth:`PartialRollouts.finish`) goes on through the tool turns: the
    episodes end under the version they began with, as the sync loop writes them."""
    c = conversation
    sync = assemble(c.prompts, c.turns.generate(c.engine, c.prompts, c.params), c.params.n, c.family)
    rollouts = PartialRollouts(c.prompts, c.params, c.tokenizer.pad_token_id, [c.end], c.turns)
    rollouts.advance(c.engine, 5, version=0)
    rollouts.finish(c.engine, version=0)
    assert not rollouts.running
    partial = join_assembled(rollouts.finished_groups(c.family))
    assert_same_samples(partial, sync, sample_inputs)
    trained = partial["response_mask"].bool()
    assert (partial["token_versions"][trained] == 0).all() and partial["tool_calls"].tolist() == [2.0] * 4
