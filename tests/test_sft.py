"""SFT pieces in one process: labels, schemas, packed vs padded, gradient accumulation, what trains."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from easytrain.config import Config, load, with_overrides
from easytrain.data.images import BadSample
from easytrain.data.sft import IGNORE, SFTDataset, conversation_turns, render_conversation
from easytrain.distributed.batch import Batch, MicroBatch
from easytrain.trainer.data import SFTData, sft_batch
from easytrain.models.families import family_of
from easytrain.workers.packed import flatten
from easytrain.workers.sft import SFTWorker, accumulate_gradients, padded


def sft_config(tmp: Path, *extra: str) -> Config:
    return load([f"trainer.output_dir={tmp}", "+exp=tiny_sft", "data.synthetic_size=32", "data.synthetic_val_size=8",
                 "trainer.workers_per_node=1", "worker.actor.global_batch_size=4", *extra])


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> SFTData:
    return SFTData(sft_config(tmp_path_factory.mktemp("sft")))


def worker(config: Config) -> SFTWorker:
    w = SFTWorker(config, role="actor", rank=0, world_size=1)
    w.setup(10)
    return w


def uneven_batch(data: SFTData, indices: list[int]) -> Batch:
    """Samples of different lengths: the synthetic questions differ, and one gets a longer multi-turn tail."""
    return sft_batch(data.loader.collator([data.train[i] for i in indices]))


# ----------------------------------------------------------------------------- rendering and schemas


def test_only_assistant_words_and_end_of_turn_are_trained(data: SFTData) -> None:
    tok = data.tokenizer
    turns = conversation_turns([{"role": "system", "content": "Be brief."},
                                {"role": "user", "content": "<image>What colour is it?"},
                                {"role": "assistant", "content": "red"},
                                {"role": "user", "content": "Sure?"},
                                {"role": "assistant", "content": "yes, green"}], num_images=1)
    r = render_conversation(tok, turns, [4])
    trained = [tok.decode([i]) for i, label in zip(r.ids, r.labels) if label != IGNORE]
    assert "".join(trained) == "red<|im_end|>yes, green<|im_end|>"
    assert r.ids.count(tok.convert_tokens_to_ids("<|image_pad|>")) == 4
    prompt = tok.decode(r.ids[:r.prompt_len])
    assert prompt.endswith("Sure?<|im_end|>\n<|im_start|>assistant\n") and r.prompt_images == 1


@pytest.mark.parametrize("messages, images, reason", [
    ([{"role": "user", "content": "<image><image>hi"}, {"role": "assistant", "content": "a"}], 1,
     "placeholder_mismatch"),
    ([{"role": "user", "content": "hi"}], 0, "no_assistant_turn"),
    ([{"role": "robot", "content": "hi"}], 0, "bad_messages"),
    ("not a list", 0, "bad_messages"),
])
def test_bad_conversations_are_skipped_with_a_reason(messages: Any, images: int, reason: str) -> None:
    with pytest.raises(BadSample) as err:
        conversation_turns(messages, images)
    assert err.value.reason == reason


def test_messages_schema_with_images_and_parts(tmp_path: Path, data: SFTData) -> None:
    from PIL import Image

    png = tmp_path / "red.png"
    Image.new("RGB", (56, 56), (200, 10, 10)).save(png)
    rows = [{"messages": [{"role": "user", "content": "Look: <image> colour?"},
                          {"role": "assistant", "content": "red"}], "images": [str(png)]},
            {"messages": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]},
                          {"role": "assistant", "content": "red"}], "images": [str(png)]},
            {"messages": [{"role": "user", "content": "no image here"}, {"role": "assistant", "content": "ok"}],
             "images": []}]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = with_overrides(sft_config(tmp_path), {"data.image_dir": str(tmp_path)})  # absolute paths: only under it
    dataset = SFTDataset([str(path)], config.data, data.tokenizer, "train", vision=True, progress=False)
    assert len(dataset) == 3
    first, second, third = (dataset[i] for i in range(3))
    assert first.answer == "red" and len(first.images) == 1 and third.images == []
    assert second.ids[-3:] == first.ids[-3:]  # same answer tokens and end of turn
    assert sum(label != IGNORE for label in third.labels) == len(data.tokenizer("ok")["input_ids"]) + 1


def test_blank_images_are_white_and_same_size(tmp_path: Path) -> None:
    config = sft_config(tmp_path, "data.blank_images=true")
    data = SFTData(config)
    sample = data.train[0]
    assert sample.all_images and all(im.getextrema() == ((255, 255), (255, 255), (255, 255))
                                     for im in sample.all_images)


# ----------------------------------------------------------------------------- packed vs padded


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def test_packed_equals_padded_and_is_padding_free(data: SFTData, recorded_attention: list[dict[str, Any]],
                                                  tmp_path: Path) -> None:
    w = worker(sft_config(tmp_path))
    model = w.model
    batch = uneven_batch(data, [0, 1, 2])
    lengths = batch["attention_mask"].sum(-1).tolist()
    pad_id = data.tokenizer.pad_token_id
    assert len(set(lengths)) > 1, lengths  # uneven, so the padded batch really holds padding

    padded_loss, padded_tokens = accumulate_gradients(model, torch.Tensor.backward, [padded(batch, family_of(model))], 1.0,
                                                      w.device)
    padded_grads = grads(model)
    recorded_attention.clear()
    packed = flatten(batch, family_of(model))
    packed_loss, packed_tokens = accumulate_gradients(model, torch.Tensor.backward, [packed], 1.0, w.device)
    packed_grads = grads(model)

    assert packed_tokens == padded_tokens > 0
    assert packed_loss == pytest.approx(padded_loss, rel=1e-5)
    assert packed_grads.keys() == padded_grads.keys()
    for name, g in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)

    total = sum(lengths)
    assert packed["input_ids"].shape == (1, total) and not (packed["input_ids"] == pad_id).any()
    layers = model.config.text_config.num_hidden_layers if hasattr(model.config, "text_config") else \
        model.config.num_hidden_layers
    assert len(recorded_attention) == layers  # one call per decoder layer: the flattened sequence, once
    for call in recorded_attention:
        assert call["query"][0] == 1 and call["query"][2] == total
        mask = call["mask"].reshape(total, total)
        starts = torch.tensor([0] + lengths).cumsum(0)
        sample = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        same = sample[:, None] == sample[None, :]
        causal = torch.ones(total, total, dtype=torch.bool).tril()
        assert torch.equal(mask.bool(), same & causal), "samples must see only themselves, causally"
        assert int(starts[-1]) == total


def test_gradient_accumulation_equals_one_big_batch(data: SFTData, tmp_path: Path) -> None:
    w = worker(sft_config(tmp_path))
    batch = uneven_batch(data, [0, 1, 2, 3])
    tokens = int((batch["targets"] != IGNORE).sum())
    for inputs in (padded, flatten):
        family = family_of(w.model)
        one = accumulate_gradients(w.model, torch.Tensor.backward, [inputs(batch, family)], 1 / tokens, w.device)
        big = grads(w.model)
        micro = [inputs(batch.select(r), family) for r in (range(0, 2), range(2, 4))]
        two = accumulate_gradients(w.model, torch.Tensor.backward, micro, 1 / tokens, w.device)
        accumulated = grads(w.model)
        assert two[1] == one[1] and two[0] == pytest.approx(one[0], rel=1e-5)
        for name, g in big.items():
            torch.testing.assert_close(accumulated[name], g, rtol=1e-4, atol=1e-7, msg=name)


# ----------------------------------------------------------------------------- what trains


def changed_parameters(w: SFTWorker, data: SFTData) -> tuple[set[str], set[str]]:
    """(names that require grad, names whose values one SFT step changed)."""
    before = {n: p.detach().clone() for n, p in w.model.named_parameters()}
    trainable = {n for n, p in w.model.named_parameters() if p.requires_grad}
    batch = uneven_batch(data, [0, 1, 2, 3])
    w.sft_update([MicroBatch(batch, packed=w.cfg.padding_free)], int((batch["targets"] != IGNORE).sum()))
    changed = {n for n, p in w.model.named_parameters() if not torch.equal(p.detach(), before[n])}
    return trainable, changed


def test_lora_with_frozen_vision_tower_trains_only_language_adapters(data: SFTData, tmp_path: Path) -> None:
    w = worker(sft_config(tmp_path, "model.lora.rank=4", "model.freeze_vision_tower=true"))
    trainable, changed = changed_parameters(w, data)
    assert trainable and changed == trainable
    assert all("lora_" in n and "language_model" in n and "visual" not in n for n in trainable), sorted(trainable)
    projections = {n.split(".lora_")[0].rsplit(".", 1)[1] for n in trainable}
    assert projections == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_frozen_vision_tower_keeps_the_projector_training(data: SFTData, tmp_path: Path) -> None:
    w = worker(sft_config(tmp_path, "model.freeze_vision_tower=true"))
    trainable, changed = changed_parameters(w, data)
    visual = {n for n in trainable if ".visual." in n}
    assert visual and all(".visual.merger." in n for n in visual)
    assert any("language_model" in n for n in changed) and any(".visual.merger." in n for n in changed)
    assert not any(".visual." in n and ".merger." not in n for n in changed)

    w = worker(sft_config(tmp_path, "model.freeze_vision_tower=true", "model.freeze_aligner=true"))
    trainable, _ = changed_parameters(w, data)
    assert not any(".visual." in n for n in trainable)


def test_text_only_rows_pack_apart_on_a_vision_model(tmp_path: Path) -> None:
    """A VL model on text-only data: the packed sequence still keeps its samples apart (4-row positions)."""
    config = sft_config(tmp_path, "data.image_key=null")
    data = SFTData(config)
    w = worker(config)
    batch = uneven_batch(data, [0, 1, 2])
    assert "pixel_values" not in batch and batch["position_ids"].dim() == 2
    padded_loss, _ = accumulate_gradients(w.model, torch.Tensor.backward, [padded(batch, family_of(w.model))], 1.0,
                                          w.device)
    padded_grads = grads(w.model)
    packed = w._inputs(MicroBatch(batch, packed=True))
    packed_loss, _ = accumulate_gradients(w.model, torch.Tensor.backward, [packed], 1.0, w.device)
    assert packed["position_ids"].shape[0] == 4
    assert packed_loss == pytest.approx(padded_loss, rel=1e-5)
    for name, g in grads(w.model).items():
        torch.testing.assert_close(g, padded_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_blank_image_sample_changes_no_loss_and_runs_the_vision_tower(data: SFTData, tmp_path: Path) -> None:
    """What the driver appends to a micro batch without images (so every rank runs the sharded vision tower)."""
    w = worker(sft_config(tmp_path))
    samples = uneven_batch(data, [0, 1])
    text_only = Batch({**samples.tensors, "pixel_values": samples["pixel_values"][:0],  # how a selected micro
                       "image_grid_thw": samples["image_grid_thw"][:0],  # batch without images holds them: empty
                       "input_ids": torch.where(samples["mm_token_type_ids"].bool(), 0, samples["input_ids"]),
                       "mm_token_type_ids": torch.zeros_like(samples["mm_token_type_ids"])},
                      samples.meta, torch.zeros(2, dtype=torch.long))
    assert data.blank is not None
    with_blank = Batch.concat([text_only, data.blank])
    no_images = {k: v for k, v in text_only.tensors.items() if k not in ("pixel_values", "image_grid_thw")}
    for inputs in (padded, flatten):
        alone = accumulate_gradients(w.model, torch.Tensor.backward,
                                     [inputs(Batch(no_images, text_only.meta), family_of(w.model))], 1.0, w.device)
        alone_grads = grads(w.model)
        joined = accumulate_gradients(w.model, torch.Tensor.backward, [inputs(with_blank, family_of(w.model))], 1.0,
                                      w.device)
        joined_grads = grads(w.model)
        assert joined[1] == alone[1] and joined[0] == pytest.approx(alone[0], rel=1e-5)
        visual = [n for n in joined_grads if ".visual." in n]
        assert visual and all(n not in alone_grads for n in visual)  # the tower ran (and got zero gradient)
        assert all(float(joined_grads[n].abs().max()) == 0.0 for n in visual)
        for name, g in alone_grads.items():
            torch.testing.assert_close(joined_grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
