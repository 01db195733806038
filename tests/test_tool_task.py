"""The built-in tool task (``synthetic:shapes/dot``, ``+exp=tiny_tools``): the zoom tool finds the dot from the
pixels, the rows' conversations are what the tool gives, and SFT trains the calls and answers, not the tool's turn.
bench/tool_use.py measures the learning against the pipeline without the tool."""

from __future__ import annotations

import io
from collections import Counter
from pathlib import Path

import numpy as np
from PIL import Image

from easytrain.config import load
from easytrain.data.sft import IGNORE
from easytrain.data.synthetic import COLOURS, generate
from easytrain.tools.registry import load_tools
from easytrain.tools.shapes import zoom
from easytrain.trainer.data import RLData, SFTData


def decoded(value: dict) -> Image.Image:
    return Image.open(io.BytesIO(value["bytes"])).convert("RGB")


def test_zoom_finds_the_dot_and_the_rows_hold_what_it_returns() -> None:
    rows = generate(64, 3, "train", 1, False, ("dot",))
    assert Counter(r["answer"] for r in rows) == {c: 16 for c in COLOURS}  # balanced: chance is 1/4
    for row in rows:
        prompt = decoded(row["images"][0])
        image, text = zoom([prompt])
        pixels = np.asarray(image).reshape(-1, 3)
        drawn = pixels[(255 - pixels).max(-1) >= 60]
        assert len(drawn) > 0.2 * len(pixels)  # the dot fills much of the zoomed image, a speck of the prompt's
        assert (np.asarray(prompt).reshape(-1, 3) != 255).any(-1).mean() < 0.01
        assert {tuple(p) for p in drawn} == {COLOURS[row["answer"]]}
        assert np.array_equal(np.asarray(decoded(row["conversation_images"][1])), np.asarray(image))
        assert [t["role"] for t in row["messages"]] == ["user", "assistant", "tool", "assistant"]
        assert row["messages"][2]["content"] == f"<image>{text}"
        assert row["messages"][3]["content"] == f"\\boxed{{{row['answer']}}}"
    schema = load_tools(["easytrain.tools.shapes:zoom"])["zoom"].schema
    assert schema["function"]["parameters"]["properties"] == {}  # the images are easytrain's to pass, not the model's


def test_sft_trains_the_call_and_the_answer_not_the_tools_turn(tmp_path: Path) -> None:
    config = load(["+exp=tiny_tools_sft", "data.synthetic_size=16", "data.synthetic_val_size=4",
                   "worker.actor.global_batch_size=4", f"trainer.output_dir={tmp_path}"])
    data = SFTData(config)
    sample = data.train[0]
    tokenizer = data.tokenizer
    assert len(sample.all_images) == 2 and len(sample.images) == 2  # the answer's prompt holds the tool's image
    trained = tokenizer.decode([t for t in sample.labels if t != IGNORE])
    assert trained.startswith('<tool_call>\n{"name": "zoom", "arguments": {}}\n</tool_call>')
    assert "zoomed in" not in trained and trained.rstrip().endswith(f"\\boxed{{{sample.answer[7:-1]}}}<|im_end|>")
    image_pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert sum(t == image_pad for t in sample.ids) == 2 * 16  # two 112x112 images of 16 tokens each

    rl = RLData(load(["+exp=tiny_tools", "data.synthetic_size=16", "data.synthetic_val_size=4",
                      f"trainer.output_dir={tmp_path / 'rl'}"]))
    prompt = rl.train[0]
    assert len(prompt.images) == 1 and prompt.answer in COLOURS  # RL reads the question and its one image
