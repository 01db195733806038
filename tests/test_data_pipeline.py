"""Loaders, token budgets, bad rows, batching: the data pipeline end to end on tiny models."""

from __future__ import annotations

import base64
import io
import json
import logging
import random
from pathlib import Path
from typing import Any, Callable

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image

from easytrain.config.schema import DataConfig, ModelConfig
from easytrain.data.collate import PromptCollator
from easytrain.models.families import family_of_folder
from easytrain.models.families.base import Bound
from easytrain.data.dataset import PromptDataset
from easytrain.data.loader import PromptLoader, PromptSampler
from easytrain.data.sources import DataError
from easytrain.data.vision import IMAGE_PAD, expand_image_placeholders
from easytrain.models.hf import load_image_processor, load_model, load_tokenizer

IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])


def png(size: tuple[int, int] = (60, 40), colour: tuple[int, int, int] = (200, 10, 10), mode: str = "RGB") -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, colour if mode == "RGB" else 0).save(buffer, format="PNG")
    return buffer.getvalue()


def write_geometry3k(path: Path, rows: list[dict[str, Any]]) -> Path:
    """The public geometry3k RL schema: images list<struct<bytes, path>>, problem, answer."""
    schema = pa.schema([("images", pa.list_(IMAGE)), ("problem", pa.string()), ("answer", pa.string())])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


@pytest.fixture(scope="module")
def vl(tiny_model: Callable[..., Path]) -> dict[str, Any]:
    folder = str(tiny_model("qwen2_5_vl"))
    cfg = ModelConfig(path=folder)
    tokenizer = load_tokenizer(cfg)
    return {"folder": folder, "tokenizer": tokenizer, "processor": load_image_processor(cfg),
            "image_token_id": tokenizer.convert_tokens_to_ids(IMAGE_PAD)}


def collator(vl: dict[str, Any]) -> PromptCollator:
    return PromptCollator(vl["tokenizer"].pad_token_id,
                          Bound.of(family_of_folder(vl["folder"]), vl["processor"], vl["tokenizer"]))


def test_geometry3k_parquet_round_trip(tmp_path: Path, vl: dict[str, Any]) -> None:
    rows = [{"images": [{"bytes": png((80 + 10 * i, 50)), "path": None}],
             "problem": f"<image>Find x in figure {i}.", "answer": str(i)} for i in range(6)]
    path = write_geometry3k(tmp_path / "geo.parquet", rows)
    dataset = PromptDataset([str(path)], DataConfig(), vl["tokenizer"], progress=False)
    assert len(dataset) == 6 and dataset.skips.as_dict()["skipped"] == {}
    for i in range(6):
        prompt = dataset[i]
        assert prompt.answer == str(i) and len(prompt.images) == 1
        text = vl["tokenizer"].decode(prompt.input_ids)
        assert f"Find x in figure {i}." in text and text.index("<|vision_start|>") < text.index("Find x")
    # The same file saved as a local HF dataset folder reads the same.
    import datasets

    folder = tmp_path / "hf"
    datasets.Dataset.from_parquet(str(path)).save_to_disk(str(folder))
    again = PromptDataset([str(folder)], DataConfig(), vl["tokenizer"], progress=False)
    assert [again[i].input_ids for i in range(6)] == [dataset[i].input_ids for i in range(6)]


def test_jsonl_with_paths_and_base64(tmp_path: Path, vl: dict[str, Any]) -> None:
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "a.png").write_bytes(png())
    lines = [{"question": "What is shown? <image>", "label": "red", "pics": ["a.png"]},
             {"question": "<image> colour?", "label": "red",
              "pics": [base64.b64encode(png()).decode()]}]
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    cfg = DataConfig(prompt_key="question", answer_key="label", image_key="pics", image_dir=str(tmp_path / "img"))
    dataset = PromptDataset([str(path)], cfg, vl["tokenizer"], progress=False)
    assert len(dataset) == 2 and dataset[0].input_ids != dataset[1].input_ids
    assert dataset[0].image_tokens == dataset[1].image_tokens


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen2_vl"])
def test_image_tokens_equal_image_features_for_one_to_four_images(
        tmp_path: Path, tiny_model: Callable[..., Path], family: str) -> None:
    folder = str(tiny_model(family))
    model_cfg = ModelConfig(path=folder)
    tokenizer, processor = load_tokenizer(model_cfg), load_image_processor(model_cfg)
    rng = random.Random(1)
    rows = []
    for n in range(1, 5):
        sizes = [(rng.randint(30, 300), rng.randint(30, 300)) for _ in range(n)]
        rows.append({"images": [{"bytes": png(s), "path": None} for s in sizes],
                     "problem": "Compare " + " and ".join("<image>" for _ in sizes) + ".", "answer": "1"})
    path = write_geometry3k(tmp_path / "multi.parquet", rows)
    cfg = DataConfig(limit_images=4, max_prompt_length=1024, max_pixels=50176)
    dataset = PromptDataset([str(path)], cfg, tokenizer, progress=False)
    assert len(dataset) == 4
    bound = Bound.of(family_of_folder(folder), processor, tokenizer)
    batch = PromptCollator(tokenizer.pad_token_id, bound)([dataset[i] for i in range(4)])
    model = load_model(model_cfg)
    with torch.no_grad():
        features = model.model.get_image_features(batch["pixel_values"], batch["image_grid_thw"])
        features = features.pooler_output if hasattr(features, "pooler_output") else features
        n_features = sum(f.shape[0] for f in features)
        assert n_features == int((batch["input_ids"] == bound.image_token_id).sum())
        assert n_features == sum(sum(dataset[i].image_tokens) for i in range(4))
        inputs = {k: batch[k] for k in ("input_ids", "attention_mask", "pixel_values", "image_grid_thw",
                                        "mm_token_type_ids", "position_ids")}
        logits = model(**inputs).logits
    assert torch.isfinite(logits).all()
    reference, _ = model.model.get_rope_index(batch["input_ids"], mm_token_type_ids=batch["mm_token_type_ids"],
                                              image_grid_thw=batch["image_grid_thw"],
                                              attention_mask=batch["attention_mask"])
    assert torch.equal(reference, batch["position_ids"])


def test_vllm_and_hf_prompt_forms_agree(vl: dict[str, Any]) -> None:
    dataset = PromptDataset(["synthetic:shapes"], DataConfig(synthetic_size=12), vl["tokenizer"],
                            cache_dir=vl["folder"] + "/..", progress=False)
    for i in range(len(dataset)):
        prompt = dataset[i]
        assert prompt.vllm_text.count(IMAGE_PAD) == len(prompt.images) == 1
        expanded = expand_image_placeholders(prompt.vllm_text, prompt.image_tokens)
        assert vl["tokenizer"](expanded, add_special_tokens=False)["input_ids"] == prompt.input_ids


BAD_ROWS: list[tuple[Any, str]] = [
    ({"problem": "<image>a", "answer": "1", "images": [{"bytes": b"garbage", "path": None}]}, "image_unreadable"),
    ({"problem": "<image>a", "answer": "1", "images": ["nowhere/missing.png"]}, "image_missing"),
    ({"problem": "<image>a", "answer": "1", "images": [{"bytes": png((1, 1)), "path": None}]}, "image_too_small"),
    ({"problem": "<image>a", "answer": "1", "images": [{"bytes": png((10_000, 10_000), mode="1"), "path": None}]},
     "image_too_large"),
    ({"problem": "<image>a", "answer": "1", "images": [{"bytes": png((1000, 4)), "path": None}]},
     "image_aspect_ratio"),
    ({"problem": "<image><image><image>a", "answer": "1", "images": [{"bytes": png(), "path": None}] * 3},
     "too_many_images"),
    ({"problem": "<image><image>a", "answer": "1", "images": [{"bytes": png(), "path": None}]},
     "placeholder_mismatch"),
    ({"problem": "<image>a", "answer": "1", "images": [{"bytes": png(), "path": None}] * 2},
     "placeholder_mismatch"),
    ({"problem": "   ", "answer": "1", "images": []}, "empty_prompt"),
    ({"problem": None, "answer": "1", "images": []}, "empty_prompt"),
    ({"problem": "a", "answer": None, "images": []}, "missing_answer"),
    ({"problem": "a", "images": []}, "missing_answer"),
    ({"problem": "a", "answer": "", "images": []}, "missing_answer"),
    ({"problem": 42, "answer": "1", "images": []}, "bad_text"),
    ({"problem": "a \ud800 b", "answer": "1", "images": []}, "bad_text"),
    ({"problem": "word " * 400, "answer": "1", "images": []}, "prompt_too_long"),
    ({"problem": "<image>a", "answer": "1", "images": [{"bytes": None, "path": None}]}, "image_unreadable"),
    ({"problem": "<image>a", "answer": "1", "images": ["%%%not-base64-or-a-path%%%"]}, "image_missing"),
]


def _jsonable(row: dict[str, Any]) -> dict[str, Any]:
    """JSON cannot hold bytes: image bytes travel as base64 strings, as they do in real jsonl data."""
    def image(value: Any) -> Any:
        if isinstance(value, dict) and value.get("bytes"):
            return base64.b64encode(value["bytes"]).decode()
        return value
    return {k: [image(v) for v in value] if k == "images" else value for k, value in row.items()}


def test_bad_rows_are_counted_skips(tmp_path: Path, vl: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    good = _jsonable({"problem": "<image>fine", "answer": "2", "images": [{"bytes": png(), "path": None}]})
    lines = [json.dumps(good).encode()]
    for row, _ in BAD_ROWS:
        lines.append(json.dumps(_jsonable(row), ensure_ascii=True).encode())
    lines.append(b'{"problem": "caf\xe9", "answer": "1", "images": []}')  # Latin-1, not UTF-8
    lines.append(b'{"problem": "broken json", ')
    lines.append(json.dumps(good).encode())
    path = tmp_path / "dirty.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    expected = [reason for _, reason in BAD_ROWS] + ["bad_text", "bad_json"]
    with caplog.at_level(logging.WARNING, logger="easytrain.data.dataset"):
        dataset = PromptDataset([str(path)], DataConfig(limit_images=2), vl["tokenizer"], progress=False)
    assert len(dataset) == 2
    report = dataset.skips.as_dict()
    assert report["rows"] == len(expected) + 2 and report["kept"] == 2
    counts: dict[str, int] = {}
    for reason in expected:
        counts[reason] = counts.get(reason, 0) + 1
    assert report["skipped"] == dict(sorted(counts.items()))
    skip_lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage() and " row " in r.getMessage()]
    assert len(skip_lines) == len(expected)
    assert all(str(path) in line and "\n" not in line for line in skip_lines)
    assert f"row {1 + BAD_ROWS.index(BAD_ROWS[4])}: image_aspect_ratio" in "\n".join(skip_lines)
    written = json.loads(dataset.write_skip_report(tmp_path / "run").read_text())
    assert written["train"]["skipped"] == report["skipped"]


def test_unusable_files_fail_before_training(tmp_path: Path, vl: dict[str, Any]) -> None:
    path = write_geometry3k(tmp_path / "geo.parquet", [{"images": [], "problem": "a", "answer": "1"}])
    with pytest.raises(DataError, match=r"geo.parquet: no column 'question' \(set by data.prompt_key\); "
                                        r"the file has: images, problem, answer"):
        PromptDataset([str(path)], DataConfig(prompt_key="question"), vl["tokenizer"], progress=False)
    with pytest.raises(DataError, match="no such file or folder"):
        PromptDataset([str(tmp_path / "nope.parquet")], DataConfig(), vl["tokenizer"], progress=False)
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type '.csv'"):
        PromptDataset([str(tmp_path / "x.csv")], DataConfig(), vl["tokenizer"], progress=False)
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 nope")
    with pytest.raises(DataError, match="not a readable parquet file"):
        PromptDataset([str(tmp_path / "bad.parquet")], DataConfig(), vl["tokenizer"], progress=False)
    empty = write_geometry3k(tmp_path / "empty.parquet", [{"images": [], "problem": "", "answer": "1"}])
    with pytest.raises(DataError, match="no usable rows"):
        PromptDataset([str(empty)], DataConfig(), vl["tokenizer"], progress=False)


def test_long_prompts_are_filtered_or_downscaled(tmp_path: Path, vl: dict[str, Any]) -> None:
    rows = [{"images": [{"bytes": png((400, 400)), "path": None}] * 2, "problem": "<image><image>same?",
             "answer": "yes"}, {"images": [], "problem": "short", "answer": "1"}]
    path = write_geometry3k(tmp_path / "big.parquet", rows)
    cfg = DataConfig(limit_images=2, max_pixels=200704, max_prompt_length=120)  # 2 x 256 image tokens > 120
    strict = PromptDataset([str(path)], cfg, vl["tokenizer"], progress=False)
    assert len(strict) == 1 and strict.skips.reasons["prompt_too_long"] == 1
    cfg.downscale_images_to_fit = True
    fitted = PromptDataset([str(path)], cfg, vl["tokenizer"], progress=False)
    assert len(fitted) == 2 and fitted.skips.downscaled == 1
    prompt = fitted[0]
    assert prompt.downscaled and len(prompt.input_ids) <= 120 and sum(prompt.image_tokens) > 8
    assert prompt.images[0].size[0] < 400


def test_format_prompt_template(tmp_path: Path, vl: dict[str, Any]) -> None:
    template = tmp_path / "fmt.jinja"
    template.write_text("{{ content | trim }} Think step by step.")
    path = write_geometry3k(tmp_path / "g.parquet", [{"images": [], "problem": " What is 2+2? ", "answer": "4"}])
    cfg = DataConfig(format_prompt=str(template), image_key=None)
    text = vl["tokenizer"].decode(PromptDataset([str(path)], cfg, vl["tokenizer"], progress=False)[0].input_ids)
    assert "What is 2+2? Think step by step." in text


def test_sampler_resumes_exactly_across_epochs() -> None:
    full = PromptSampler(size=23, batch_size=4, shuffle=True, seed=7)
    uninterrupted = []
    for _ in range(3 * full.batches_per_epoch):
        uninterrupted.append(full.remaining()[0])
        full.advance()
    for stop in (1, 5, 7, 13):
        first = PromptSampler(23, 4, True, 7)
        seen = []
        for _ in range(stop):
            seen.append(first.remaining()[0])
            first.advance()
        state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint file
        resumed = PromptSampler(23, 4, True, 7)
        resumed.load_state_dict(state)
        while len(seen) < len(uninterrupted):
            seen.append(resumed.remaining()[0])
            resumed.advance()
        assert seen == uninterrupted
    epoch0 = sum(uninterrupted[:5], [])
    assert len(set(epoch0)) == 20  # no prompt twice within an epoch
    assert uninterrupted[:5] != uninterrupted[5:10]  # reshuffled each epoch


def test_loader_position_moves_only_with_consumed_batches(vl: dict[str, Any]) -> None:
    dataset = PromptDataset(["synthetic:shapes"], DataConfig(synthetic_size=12), vl["tokenizer"],
                            cache_dir=vl["folder"] + "/..", progress=False)
    loader = PromptLoader(dataset, 4, collator(vl), seed=3)
    iterator = iter(loader)
    first = next(iterator)
    state = loader.state_dict()
    assert state["batch"] == 1 and len(loader) == 2
    resumed = PromptLoader(dataset, 4, collator(vl), seed=3)
    resumed.load_state_dict(state)
    rest = [batch["uids"] for batch in resumed]
    assert rest[0] == next(iterator)["uids"] and len(rest) == 2
    assert not set(first["uids"]) & set(sum(rest, []))
    assert resumed.state_dict()["epoch"] == 1 and resumed.state_dict()["batch"] == 0


@pytest.mark.slow
def test_worker_processes_give_the_same_batches(vl: dict[str, Any]) -> None:
    dataset = PromptDataset(["synthetic:shapes"], DataConfig(synthetic_size=16), vl["tokenizer"],
                            cache_dir=vl["folder"] + "/..", progress=False)
    inline = list(PromptLoader(dataset, 4, collator(vl), seed=5, num_workers=0))
    workers = list(PromptLoader(dataset, 4, collator(vl), seed=5, num_workers=2))
    assert [b["uids"] for b in inline] == [b["uids"] for b in workers]
    assert all(torch.equal(a["pixel_values"], b["pixel_values"]) for a, b in zip(inline, workers))


def test_text_model_reads_the_text_variant(tiny_model: Callable[..., Path]) -> None:
    tokenizer = load_tokenizer(ModelConfig(path=str(tiny_model("qwen2"))))
    cfg = DataConfig(image_key=None, synthetic_size=9)
    dataset = PromptDataset(["synthetic:shapes"], cfg, tokenizer, vision=False,
                            cache_dir=str(tiny_model("qwen2")) + "/..", progress=False)
    batch = PromptCollator(tokenizer.pad_token_id)([dataset[i] for i in range(3)])
    assert "pixel_values" not in batch and batch["position_ids"].shape == batch["input_ids"].shape
    assert "The picture shows" in tokenizer.decode(dataset[0].input_ids)
