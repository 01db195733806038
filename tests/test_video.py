"""Video rows end to end on the real tiny models (issue 28, item 3): the data pre-flight, positions equal to the
model's own rope index, the same log-probs from every layout, the rollout's log-probs equal the training pass's,
the frames' order reaches the model, and the tiny model learns the motion task (``+exp=tiny_video``).

The tests in :mod:`tests.test_video_data` check decoding, sampling and the patch layout on their own."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from easytrain.config import load
from easytrain.data.vision import MM_VIDEO
from easytrain.distributed.batch import Batch
from easytrain.models.families import family_of
from easytrain.trainer.data import RLData, to_batch
from easytrain.workers.forward import log_probs_of, response_log_probs, takes_video_seconds
from easytrain.workers.sequences import assemble

from conftest import tiny_families
from rl_batches import planned
from test_shared_prompt import actor_model

CPU = torch.device("cpu")
N = 2
LEARNED = 0.8
"""Held-out accuracy the motion task must reach (chance: 1/2)."""


def video_config(tmp_path: Path, family: str = "qwen2_5_vl", *extra: str) -> Any:
    """RL settings on a mixed task: image questions and motion clips in one batch."""
    return load([f"model.path=tiny:{family}", "model.tiny_size=tiny", "model.dtype=float32",
                 "data.train_files=synthetic:shapes/colour+motion", "data.val_files=null",
                 "data.video_key=videos", "data.synthetic_size=16", "data.rollout_batch_size=4",
                 "data.synthetic_difficulty=0", "data.max_response_length=4", "data.num_workers=0",
                 "worker.actor.global_batch_size=4",
                 f"worker.rollout.n={N}", "trainer.device=cpu", "trainer.val_before_train=false",
                 "trainer.workers_per_node=1", f"trainer.output_dir={tmp_path / 'run'}", *extra])


def prompts_with_both(config: Any) -> Batch:
    """The first 4 prompts of the mixed task, collated as the loader does (with the prompts' positions)."""
    data = RLData(config)
    raw = data.collator([data.train[i] for i in range(4)])
    batch = to_batch(raw, keep_images=False).union(Batch({"position_ids": raw["position_ids"]}))
    types = batch["mm_token_type_ids"]
    assert (types == MM_VIDEO).any() and (types == 1).any(), "the batch should hold images and videos"
    return batch


def with_responses(prompts: Batch, model: torch.nn.Module, seed: int = 0) -> Batch:
    rows = len(prompts) * N
    g = torch.Generator().manual_seed(seed)
    responses = torch.randint(20, 1000, (rows, 4), generator=g)
    mask = (torch.arange(4)[None] < torch.tensor([4, 2, 3, 1] * (rows // 4 + 1))[:rows, None]).long()
    return assemble(prompts, Batch({"responses": responses * mask, "response_mask": mask}), N, family_of(model))


@pytest.mark.parametrize("family", tiny_families("video"))
def test_positions_equal_the_models_rope_index(family: str, tmp_path: Path) -> None:
    """easytrain's positions for a batch of images and videos (the training passes take these) equal the model's own
    ``get_rope_index`` given the split image and video arguments (what its generation computes)."""
    config = video_config(tmp_path, family)
    prompts = prompts_with_both(config)
    model = actor_model(config)
    inputs = family_of(model).visual_kwargs(prompts.expanded_tensors(), seconds_arg=True)
    assert inputs["video_grid_thw"][:, 0].tolist() == [2] * len(inputs["video_grid_thw"])  # 4 frames: 2 patches
    extra = {"second_per_grid_ts": inputs["second_per_grid_ts"]} if takes_video_seconds(model) else {}
    want, _ = model.model.get_rope_index(prompts["input_ids"], prompts["mm_token_type_ids"],
                                         inputs.get("image_grid_thw"), inputs["video_grid_thw"],
                                         attention_mask=prompts["attention_mask"], **extra)
    mask = prompts["attention_mask"].bool()
    assert torch.equal(prompts["position_ids"][:, mask], want[:, mask])
    if family == "qwen2_5_vl":  # 2 frames a patch at 2 fps = 1 s; 4 positions per second (tokens_per_second)
        video = prompts["mm_token_type_ids"] == MM_VIDEO
        row = int(video.any(-1).nonzero()[0])
        times = prompts["position_ids"][0, row][video[row]]
        assert times.unique().numel() == 2 and int(times.max() - times.min()) == 4


def test_every_layout_gives_the_same_log_probs_and_frame_order_matters(tmp_path: Path) -> None:
    config = video_config(tmp_path)
    model = actor_model(config)
    batch = with_responses(prompts_with_both(config), model)
    mask = batch["response_mask"].bool()
    padded, _ = response_log_probs(model, batch, 1.0, CPU)
    for packed, shared in ((True, False), (False, True), (True, True)):
        got, _ = log_probs_of(model, planned(batch, model, packed, shared), 1.0, CPU)
        torch.testing.assert_close(got[mask], padded[mask], rtol=1e-5, atol=1e-5)

    # the same clips with their frames in reverse order: the video rows' log-probs move, the image rows' do not
    reversed_batch = reverse_frames(batch)
    again, _ = response_log_probs(model, reversed_batch, 1.0, CPU)
    video_rows = (batch["mm_token_type_ids"] == MM_VIDEO).any(-1)
    moved = (again - padded).abs().amax(-1)
    assert (moved[video_rows] > 1e-4).all(), moved
    assert (moved[~video_rows] < 1e-6).all(), moved


def reverse_frames(batch: Batch) -> Batch:
    """``batch`` with each video's temporal patches in reverse order and each patch's two frames swapped."""
    pixels, grid, seconds = batch["pixel_values"].clone(), batch["image_grid_thw"], batch["visual_seconds"]
    start = 0
    for (t, h, w), s in zip(grid.tolist(), seconds.tolist()):
        size = t * h * w
        if s > 0:
            block = pixels[start:start + size].view(t, h * w, 3, 2, -1)  # (patch, place, C, frame, 14*14)
            pixels[start:start + size] = block.flip(0).flip(3).reshape(size, -1)
        start += size
    return Batch({**batch.tensors, "pixel_values": pixels}, batch.meta, batch.image_counts)


@pytest.mark.parametrize("fps", [2.0, 0.05])
def test_the_rollouts_log_probs_equal_the_training_pass(fps: float, tmp_path: Path) -> None:
    """The HF engine generates from video prompts (the model computes its positions from the split arguments and
    the clips' seconds; each prompt prefilled once for its rows) and its per-token log-probs equal the training
    forward's over the assembled
    rows, which use easytrain's positions. At 0.05 fps a temporal patch spans 40 s: the clip's temporal positions (160 per patch) reach past the
    text after it, and the responses continue from the prompt's largest position, as generation does."""
    from easytrain.workers.rollout.engine import SamplingParams
    from easytrain.workers.rollout.hf_engine import HFEngine

    config = video_config(tmp_path, "qwen2_5_vl", f"data.video_fps={fps}")
    prompts = prompts_with_both(config)
    model = actor_model(config)
    engine = HFEngine(model, [-1], 0, CPU)  # no stop: 4 tokens
    generated = engine.generate(prompts, SamplingParams(N, 1.0, 1.0, -1, 4, seed=5))
    batch = assemble(prompts, generated, N, family_of(model))
    lp, _ = response_log_probs(model, batch, 1.0, CPU)
    mask = batch["response_mask"].bool()
    assert mask.all()
    torch.testing.assert_close(lp, generated["rollout_log_probs"], rtol=1e-4, atol=1e-4)


def png(colour: tuple[int, int, int], size: tuple[int, int] = (56, 56)) -> str:
    """A PNG frame as base64 text (a form the image decoder takes)."""
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def test_video_rows_pass_the_pre_flight_or_are_counted_skips(tmp_path: Path) -> None:
    """Like images: too many frames, an unreadable video file and a prompt over the token budget are skipped and
    counted by reason in data_report.json; the good rows are kept, their video tokens in the prompt."""
    (tmp_path / "broken.mp4").write_bytes(b"not a video at all")
    frame = png((200, 30, 30))
    rows = [
        {"problem": "<video>Which way?", "answer": "left", "videos": [[frame] * 4]},   # kept: 2 patches x 4 tokens
        {"problem": "<video>Which way?", "answer": "left", "videos": [[frame] * 6]},   # 6 frames > max_frames=4
        {"problem": "<video>Which way?", "answer": "left", "videos": ["broken.mp4"]},  # a file PyAV cannot read
        {"problem": "<video>Which way?", "answer": "left", "videos": [[png((0, 0, 255), (224, 224))] * 4]},  # 2 x 16 tokens
        {"problem": "No video here.", "answer": "right", "videos": []},               # kept: text only
    ]
    data_file = tmp_path / "clips.jsonl"
    data_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = load([f"data.train_files={data_file}", "data.val_files=null", "data.video_key=videos",
                   f"data.image_dir={tmp_path}", "data.image_key=images", "data.max_frames=4",
                   "data.max_prompt_length=56", "data.rollout_batch_size=2", "worker.actor.global_batch_size=2",
                   "trainer.val_before_train=false", "data.num_workers=0", f"trainer.output_dir={tmp_path / 'run'}"])
    data = RLData(config)
    report = json.loads((tmp_path / "run" / "data_report.json").read_text())["train"]
    assert report["rows"] == 5 and report["kept"] == 2, report
    assert report["skipped"] == {"too_many_frames": 1, "video_unreadable": 1, "prompt_too_long": 1}, report
    kept = [data.train[i] for i in range(len(data.train))]
    assert [len(p.videos) for p in kept] == [1, 0]
    clip = kept[0].videos[0]
    assert len(clip.frames) == 4 and clip.fps == config.data.video_fps
    assert kept[0].input_ids.count(data.tokenizer.convert_tokens_to_ids("<|video_pad|>")) == 2 * 4


@pytest.mark.slow
def test_tiny_video_learns_which_way_the_pattern_moves(ray_local: None, tmp_path: Path) -> None:
    """``+exp=tiny_video`` (SFT) ends far above chance (1/2) on held-out clips; the same clips with their frames
    reversed get the opposite answers (the model reads the order of the frames, which alone holds the answer)."""
    from easytrain.data.synthetic import ensure_synthetic, write_parquet
    from easytrain.trainer.sft import SFTTrainer
    from test_sft_run import fit

    run = tmp_path / "sft"
    final = fit(SFTTrainer(load(["+exp=tiny_video", f"trainer.output_dir={run}", "trainer.loggers=[jsonl]",
                                 "trainer.export_final=true"])))
    assert final["val/reward/mean"] >= LEARNED, final

    config = load(["+exp=tiny_video"])
    val = ensure_synthetic("synthetic:shapes/motion".split(":")[1], "val", config.data.synthetic_val_size,
                           config.trainer.seed, config.data.synthetic_difficulty, cache_dir=config.model.cache_dir)
    rows = pq.read_table(val).to_pylist()
    reversed_file = tmp_path / "reversed.parquet"
    write_parquet([{**r, "videos": [frames[::-1] for frames in r["videos"]]} for r in rows], reversed_file)
    flipped = fit(SFTTrainer(load(["+exp=tiny_video", f"trainer.output_dir={tmp_path / 'reversed'}",
                                   "trainer.val_only=true", f"model.path={run / 'hf'}",
                                   f"data.val_files={reversed_file}", "trainer.loggers=[jsonl]"])))
    assert flipped["val/reward/mean"] <= 1 - LEARNED, flipped


@pytest.mark.slow
def test_grpo_steps_on_video_rows(ray_local: None, tmp_path: Path) -> None:
    """RL takes video rows end to end on Ray (the loader, the fused workers' rollout, reference-free update and
    validation): two GRPO steps of the tiny default preset on the motion clips."""
    from easytrain.trainer.rl import RLTrainer
    from test_sft_run import fit, records

    run = tmp_path / "rl"
    fit(RLTrainer(load(["data.train_files=synthetic:shapes/motion", "data.val_files=synthetic:shapes/motion",
                        "data.video_key=videos", "data.synthetic_val_size=8", "trainer.max_steps=2", "trainer.val_freq=2",
                        f"trainer.output_dir={run}", "trainer.loggers=[jsonl]"])))
    steps = [r for r in records(run) if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert [r["step"] for r in records(run) if "val/reward/mean" in r] == [2]  # the final validation, on clips


def test_sft_padded_and_padding_free_passes_take_video_rows(tmp_path: Path) -> None:
    """SFT on clips with padded micro batches (worker.actor.padding_free=false) feeds the videos as videos, and its
    summed loss equals the padding-free pass's."""
    from easytrain.models.hf import load_model, model_folder
    from easytrain.trainer.data import SFTData
    from easytrain.workers.packed import flatten, token_loss_sum
    from easytrain.workers.sft import padded

    config = load(["+exp=tiny_video", "data.synthetic_size=8", "data.synthetic_val_size=4",
                   "worker.actor.global_batch_size=4", f"trainer.output_dir={tmp_path}"])
    batch = next(SFTData(config).train_batches())
    assert (batch["visual_seconds"] > 0).all()
    model = load_model(config.model, model_folder(config.model)).eval()
    with torch.no_grad():
        loss, tokens = token_loss_sum(model, padded(batch, family_of(model)), CPU, None)
        flat_loss, flat_tokens = token_loss_sum(model, flatten(batch, family_of(model)), CPU, None)
    assert tokens == flat_tokens > 0
    torch.testing.assert_close(loss, flat_loss, rtol=1e-5, atol=1e-5)


def test_batches_with_and_without_per_visual_seconds_join() -> None:
    """A multi-turn chunk whose rows got tool images carries no ``visual_seconds`` (still images); it joins a chunk
    that does, in either order, with zeros for its images."""
    def chunk(seconds: bool) -> Batch:
        tensors = {"input_ids": torch.ones(1, 3, dtype=torch.long), "pixel_values": torch.zeros(4, 2),
                   "image_grid_thw": torch.tensor([[1, 2, 2]])}
        if seconds:
            tensors["visual_seconds"] = torch.tensor([1.0])
        return Batch(tensors, image_counts=torch.tensor([1]))

    for first, second in ((True, False), (False, True)):
        joined = Batch.concat([chunk(first), chunk(second)])
        assert joined["visual_seconds"].tolist() == [1.0 if first else 0.0, 1.0 if second else 0.0]
        assert joined.select([1])["visual_seconds"].tolist() == [1.0 if second else 0.0]
