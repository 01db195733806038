"""Multi-turn rollouts with tools (issue 28): the loop of model and tool turns, and what the actor trains on.

The engine is the loop's seam: to check the bookkeeping against a hand-built conversation, a scripted engine
replays the model turns (a random tiny model does not write tool calls); the tool runs for real (its own
process, with a timeout), and the log-probs are the real tiny model's, through the padded, the packed and
the shared-prompt passes. Where the real engine can show it (one turn), the real HF engine runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from easytrain.config import Config
from easytrain.distributed.batch import Batch
from easytrain.models.hf import family, load_model, model_folder
from easytrain.trainer.data import RLData
from easytrain.workers.forward import response_log_probs, suppressed_tokens
from easytrain.workers.packed import packed_response_log_probs
from easytrain.workers.rollout.engine import RolloutEngine, SamplingParams, pad_responses
from easytrain.workers.rollout.hf_engine import HFEngine
from easytrain.workers.rollout.multi_turn import MultiTurn, tool_turn_text
from easytrain.workers.sequences import assemble
from easytrain.workers.shared_prompt import shared_response_log_probs
from rl_batches import rl_config

TOOLS = Path(__file__).resolve().parent / "assets" / "turn_tools.py"
CALL = '<tool_call>\n{"name": "count", "arguments": {"colour": "red"}}\n</tool_call>'
CPU = torch.device("cpu")


class Scripted(RolloutEngine):
    """Replays one list of token rows per call (log-prob -0.5 each) and keeps the prompts it was given."""

    def __init__(self, turns: list[list[list[int]]], stop_ids: list[int], pad_id: int) -> None:
        self.turns, self.stop_ids, self.pad_id = list(turns), stop_ids, pad_id
        self.prompts: list[Batch] = []

    @classmethod
    def build(cls, config: Any, spec: Any) -> "Scripted":
        raise NotImplementedError

    def generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        self.prompts.append(prompts)
        rows = self.turns.pop(0)
        assert len(rows) == len(prompts) * params.n
        return pad_responses(rows, [[-0.5] * len(r) for r in rows], self.pad_id, self.stop_ids)

    def load_weights(self, weights: Any) -> int:
        return 0


def multi_turn_config(tmp: Path, *extra: str) -> Config:
    return rl_config(tmp, "model.path=tiny:qwen2", "data.image_key=null", "worker.rollout.multi_turn.enable=true",
                     f"worker.rollout.multi_turn.tools=[{TOOLS}:count,{TOOLS}:hang]", "data.max_response_length=96",
                     *extra)


def ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_the_tool_turn_is_what_the_chat_template_renders(tmp_path: Path) -> None:
    data = RLData(multi_turn_config(tmp_path))
    assert tool_turn_text(data.tokenizer, "3") == "<|im_end|>\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\n"


def test_a_multi_turn_episode_trains_exactly_the_models_tokens(tmp_path: Path) -> None:
    config = multi_turn_config(tmp_path)
    data = RLData(config)
    tok = data.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    prompts = next(data.train_batches()).select([0])
    call, after = ids(tok, "Let me count. " + CALL), ids(tok, " and more words")
    answer = ids(tok, "There are 3.") + [end]
    engine = Scripted([[call + after + [end]], [answer]], [end], tok.pad_token_id)
    turns = MultiTurn(config.worker.rollout.multi_turn, tok, config.data.max_response_length)
    try:
        out = turns.generate(engine, prompts, SamplingParams(1, 1.0, 1.0, -1, 96, seed=0))
    finally:
        turns.close()

    tool = ids(tok, tool_turn_text(tok, "3"))  # count(colour="red") answered 3
    expected = call + tool + answer  # the words after the call are cut: the tool answers first
    trained = [1.0] * len(call) + [0.0] * len(tool) + [1.0] * len(answer)
    k = len(expected)
    assert out["responses"][0, :k].tolist() == expected
    assert out["response_mask"][0].tolist() == trained + [0.0] * (out["responses"].shape[1] - k)
    assert out["response_attention_mask"][0, :k].tolist() == [1.0] * k
    assert out["rollout_log_probs"][0, :k].tolist() == [-0.5 * t for t in trained]
    assert out["tool_calls"].tolist() == [1.0] and out["tool_errors"].tolist() == [0.0]
    second = engine.prompts[1]  # the second model turn continues the prompt, the call and the tool turn
    prompt = prompts["input_ids"][0][prompts["attention_mask"][0].bool()].tolist()
    assert second["input_ids"][0][second["attention_mask"][0].bool()].tolist() == prompt + call + tool

    # the actor: log-probs of the model's tokens with the tool turn in context, padded and padding-free, equal
    # those of one forward over the hand-built conversation
    batch = assemble(prompts, out, 1, family(model_folder(config.model)))
    model = load_model(config.model, model_folder(config.model)).eval()
    with torch.no_grad():
        padded, _ = response_log_probs(model, batch, 1.0, CPU)
        packed, _ = packed_response_log_probs(model, batch, 1.0, CPU, suppressed_tokens(model.config))
        shared, _ = shared_response_log_probs(model, batch, [[0]], 1.0, CPU, suppressed_tokens(model.config))
        whole = torch.tensor([prompt + expected])
        logits = model(input_ids=whole, use_cache=False).logits[0, len(prompt) - 1:-1]
        reference = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(expected)[:, None])[:, 0]
    mask = torch.tensor(trained).bool()
    torch.testing.assert_close(padded[0, :k][mask], reference[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[0, :k][mask], reference[mask], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(shared[0, :k][mask], reference[mask], rtol=1e-5, atol=1e-5)
    assert (packed[0, :k][~mask] == 0).all()


def test_a_hanging_tool_times_out_and_is_counted(tmp_path: Path) -> None:
    config = multi_turn_config(tmp_path, "worker.rollout.multi_turn.tool_timeout_s=2")
    data = RLData(config)
    tok = data.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    prompts = next(data.train_batches()).select([0, 1])
    hang = ids(tok, '<tool_call>\n{"name": "hang", "arguments": {}}\n</tool_call>')
    fine = ids(tok, CALL)
    engine = Scripted([[hang, fine], [ids(tok, "No answer.") + [end], ids(tok, "3") + [end]]], [end],
                      tok.pad_token_id)
    turns = MultiTurn(config.worker.rollout.multi_turn, tok, config.data.max_response_length)
    try:
        out = turns.generate(engine, prompts, SamplingParams(1, 1.0, 1.0, -1, 96, seed=0))
    finally:
        turns.close()
    assert out["tool_calls"].tolist() == [1.0, 1.0] and out["tool_errors"].tolist() == [1.0, 0.0]
    first = tok.decode(out["responses"][0][out["response_attention_mask"][0].bool()])
    assert "timed out" in first and first.endswith("No answer.<|im_end|>")


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_one_turn_is_the_single_turn_generation(tmp_path: Path, temperature: float) -> None:
    """max_turns=1 with the real engine: the same tokens, mask and log-probs as a plain generation, even when a
    response holds a tool call (the last turn is kept whole)."""
    config = multi_turn_config(tmp_path, "worker.rollout.multi_turn.max_turns=1", "data.max_response_length=12")
    data = RLData(config)
    prompts = next(data.train_batches())
    model = load_model(config.model, model_folder(config.model))
    stops = [data.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    params = SamplingParams(2 if temperature else 1, temperature, 1.0, -1, 12, seed=3)
    plain = HFEngine(model, stops, data.tokenizer.pad_token_id, CPU).generate(prompts, params)
    turns = MultiTurn(config.worker.rollout.multi_turn, data.tokenizer, 12)
    try:
        out = turns.generate(HFEngine(model, stops, data.tokenizer.pad_token_id, CPU), prompts, params)
    finally:
        turns.close()
    width = max(out["responses"].shape[1], plain["responses"].shape[1])

    def widened(t: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]))

    mask = widened(plain["response_mask"])
    assert torch.equal(widened(out["response_mask"]), mask)
    assert torch.equal(widened(out["rollout_log_probs"]), widened(plain["rollout_log_probs"]))
    assert torch.equal(widened(out["responses"])[mask.bool()], widened(plain["responses"])[mask.bool()])
    assert torch.equal(out["response_attention_mask"], out["response_mask"])
    assert not out["tool_calls"].any()


@pytest.mark.slow
def test_a_grpo_step_with_tools_runs_and_logs_the_calls(ray_local: None, tmp_path: Path) -> None:
    """The whole path on Ray with the real engine: the prompts show the tools (the schemas reach the chat
    template), the rollout worker runs the loop, the step trains and logs the tool metrics."""
    from easytrain.data.dataset import PromptDataset
    from easytrain.trainer.rl import RLTrainer

    config = multi_turn_config(tmp_path, "trainer.val_freq=-1", "trainer.val_before_train=false",
                               "trainer.save_freq=0", "data.max_response_length=16")
    data = RLData(config)
    assert isinstance(data.train, PromptDataset)
    assert [t["function"]["name"] for t in data.train.tools] == ["count", "hang"]
    trainer = RLTrainer(config, data)
    try:
        trainer.step = 1
        metrics = trainer.train_step().metrics
    finally:
        trainer.close()
    assert metrics["rollout/tool_calls"] >= 0 and metrics["rollout/tool_errors"] >= 0
    assert torch.isfinite(torch.tensor(metrics["actor/pg_loss"]))


def painted(tmp_path: Path, colour: str) -> tuple[Config, Batch, list[bool]]:
    """A conversation on the tiny Qwen2.5-VL whose tool turn holds an image (``paint(colour)``'s, inverted when
    TURN_TOOLS_INVERT=1 as the tool process starts), assembled as the rollout worker does; which response tokens
    are the model's."""
    from easytrain.workers.rollout.multi_turn import ToolImages

    config = rl_config(tmp_path, "worker.rollout.multi_turn.enable=true",
                       f"worker.rollout.multi_turn.tools=[{TOOLS}:paint]", "data.max_response_length=160")
    data = RLData(config)
    tok, d = data.tokenizer, config.data
    end = tok.convert_tokens_to_ids("<|im_end|>")
    prompts = next(data.train_batches()).select([0])
    call = ids(tok, '<tool_call>\n{"name": "paint", "arguments": {"colour": "%s"}}\n</tool_call>' % colour)
    answer = ids(tok, "It is a square.") + [end]
    engine = Scripted([[call], [answer]], [end], tok.pad_token_id)
    images = ToolImages(data.visuals(), d.min_pixels, d.max_pixels)
    turns = MultiTurn(config.worker.rollout.multi_turn, tok, d.max_response_length, images=images)
    try:
        out = turns.generate(engine, prompts, SamplingParams(1, 1.0, 1.0, -1, d.max_response_length, seed=0))
    finally:
        turns.close()
    assert out["tool_errors"].tolist() == [0.0]
    prompt_images = int(prompts.image_counts[0])
    assert engine.prompts[1].image_counts.tolist() == [prompt_images + 1]  # the next turn sees the tool's image
    again = engine.prompts[1].repeat_interleave(2)  # its vision stream is whole: every per-image tensor splits
    assert again.image_counts.tolist() == [prompt_images + 1] * 2
    assert all(again[k].shape[0] == 2 * (prompt_images + 1) for k in ("image_grid_thw", "visual_seconds") if k in again)
    assert out.image_counts.tolist() == [prompt_images + 1]
    prompt_rows = int(prompts["image_grid_thw"].prod(-1).sum())  # the row's patch rows: its prompt's, then the tool's
    assert torch.equal(out["pixel_values"][:prompt_rows], prompts["pixel_values"])
    assert torch.equal(out["pixel_values"], engine.prompts[1]["pixel_values"])
    held = int(out["response_attention_mask"][0].sum())
    trained = out["response_mask"][0, :held].bool().tolist()
    assert trained == [True] * len(call) + [False] * (held - len(call) - len(answer)) + [True] * len(answer)
    return config, assemble(prompts, out, 1, family(model_folder(config.model))), trained


def test_a_tool_image_reaches_the_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same conversation but for the tool's image: the answer's log-probs change with the image; the padded
    and padding-free passes agree on them."""
    config, red, trained = painted(tmp_path / "red", "red")
    monkeypatch.setenv("TURN_TOOLS_INVERT", "1")
    _, blue, blue_trained = painted(tmp_path / "inverted", "red")
    assert torch.equal(red["input_ids"], blue["input_ids"]) and trained == blue_trained
    assert not torch.equal(red["pixel_values"], blue["pixel_values"])
    width = red["responses"].shape[1]
    assert int((red["mm_token_type_ids"][0, -width:] != 0).sum()) == 4  # 56x56 px: 2x2 merged patches
    model = load_model(config.model, model_folder(config.model)).eval()
    with torch.no_grad():
        red_padded, _ = response_log_probs(model, red, 1.0, CPU)
        red_packed, _ = packed_response_log_probs(model, red, 1.0, CPU, suppressed_tokens(model.config))
        blue_padded, _ = response_log_probs(model, blue, 1.0, CPU)
    mask = torch.zeros(width, dtype=torch.bool)
    mask[:len(trained)] = torch.tensor(trained)
    torch.testing.assert_close(red_packed[0][mask], red_padded[0][mask], rtol=1e-5, atol=1e-5)

    def answer(log_probs: torch.Tensor, trained: list[bool]) -> torch.Tensor:
        """The log-probs of the tokens after the tool turn (the same answer tokens in both conversations)."""
        after = trained[::-1].index(False)
        return log_probs[0, len(trained) - after:len(trained)]

    assert (answer(red_padded, trained) - answer(blue_padded, blue_trained)).abs().max() > 1e-4


def test_a_tool_that_takes_images_gets_the_samples_and_the_model_cannot_pass_them(tmp_path: Path) -> None:
    from easytrain.tools.registry import load_tools

    config = rl_config(tmp_path, "worker.rollout.multi_turn.enable=true",
                       f"worker.rollout.multi_turn.tools=[{TOOLS}:size]", "data.max_response_length=256")
    assert load_tools(config.worker.rollout.multi_turn.tools)["size"].schema["function"]["parameters"] == {
        "type": "object", "properties": {}, "required": []}  # the model sees no images argument
    data = RLData(config)
    tok = data.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    prompts = next(data.train_batches()).select([0, 1])
    image = prompts.meta["images"][0][0]
    asks = ids(tok, '<tool_call>\n{"name": "size", "arguments": {}}\n</tool_call>')
    passes = ids(tok, '<tool_call>\n{"name": "size", "arguments": {"images": 1}}\n</tool_call>')
    engine = Scripted([[asks, passes], [[end], [end]]], [end], tok.pad_token_id)
    turns = MultiTurn(config.worker.rollout.multi_turn, tok, config.data.max_response_length)
    try:
        out = turns.generate(engine, prompts, SamplingParams(1, 1.0, 1.0, -1, 256, seed=0))
    finally:
        turns.close()
    texts = [tok.decode(out["responses"][i][out["response_attention_mask"][i].bool()]) for i in range(2)]
    assert f"<|im_start|>tool\n{image.width}x{image.height}<|im_end|>" in texts[0]
    assert "'images' is filled by easytrain" in texts[1] and out["tool_errors"].tolist() == [0.0, 1.0]


def test_tool_images_past_the_limit_are_an_error_turn(tmp_path: Path) -> None:
    from easytrain.workers.rollout.multi_turn import ToolImages

    config = rl_config(tmp_path, "worker.rollout.multi_turn.enable=true", "data.max_response_length=256",
                       f"worker.rollout.multi_turn.tools=[{TOOLS}:paint]", "worker.rollout.multi_turn.max_tool_images=0")
    data = RLData(config)
    tok, d = data.tokenizer, config.data
    end = tok.convert_tokens_to_ids("<|im_end|>")
    prompts = next(data.train_batches()).select([0])
    call = ids(tok, '<tool_call>\n{"name": "paint", "arguments": {"colour": "red"}}\n</tool_call>')
    engine = Scripted([[call], [[end]]], [end], tok.pad_token_id)
    images = ToolImages(data.visuals(), d.min_pixels, d.max_pixels)
    turns = MultiTurn(config.worker.rollout.multi_turn, tok, d.max_response_length, images=images)
    try:
        out = turns.generate(engine, prompts, SamplingParams(1, 1.0, 1.0, -1, 256, seed=0))
    finally:
        turns.close()
    assert out["tool_errors"].tolist() == [1.0] and out.image_counts is None  # only the prompt's image: none added
    text = tok.decode(out["responses"][0][out["response_attention_mask"][0].bool()])
    assert "worker.rollout.multi_turn.max_tool_images" in text


def test_config_errors_name_the_key_and_the_fix(tmp_path: Path) -> None:
    from easytrain.config import ConfigError

    with pytest.raises(ConfigError, match=r"worker\.rollout\.multi_turn\.tools=\[\]: .*no tool is given"):
        rl_config(tmp_path, "worker.rollout.multi_turn.enable=true")
    rl_config(tmp_path, "worker.rollout.multi_turn.enable=true", f"worker.rollout.multi_turn.tools=[{TOOLS}:count]",
              "worker.rollout.engine=vllm")  # images and tool images continue on vLLM as on the HF engine
    with pytest.raises(ConfigError, match=r"data\.video_key='videos': .*vLLM.*worker\.rollout\.engine=hf"):
        rl_config(tmp_path, "worker.rollout.engine=vllm", "data.video_key=videos")
