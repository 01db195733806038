"""The data profile (issue 50): what the rows will cost, read before launch by the training rules."""

from __future__ import annotations

import dataclasses
import functools
import io
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from easytrain.config import load, with_overrides
from easytrain.data.profile import Longest, percentiles, sample_positions
from easytrain.memory.data_shape import DataCosts
from easytrain.memory.planner import batch_bytes, paged, plan
from easytrain.memory.rl_shape import shape_of
from easytrain.models.hf import load_image_processor, model_folder
from easytrain.models.shapes import hf_config_for
from easytrain.trainer.data import RLData, profile_data

IMAGE = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
SMALL = [(56, 56), (84, 56), (112, 84), (140, 112), (168, 140)]
"""(width, height) of the ordinary images, taken in turn."""
HUGE = {7: (1400, 1050), 23: (2000, 1500), 41: (252, 196)}
"""Rows with a large image: the outliers (the last one within data.max_pixels: 63 tokens, over the prompt limit)."""
TWO_IMAGES = (13, 31)
"""Rows with two images (data.limit_images=1 skips them)."""
ROWS = 60
MAX_PIXELS = 112 * 112 * 4  # 64 vision tokens on Qwen2.5-VL's 28-px grid
MAX_PROMPT = 90


def png(size: tuple[int, int]) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 10, 10)).save(buffer, format="PNG")
    return buffer.getvalue()


def sizes_of(row: int) -> list[tuple[int, int]]:
    first = HUGE.get(row, SMALL[row % len(SMALL)])
    return [first, SMALL[0]] if row in TWO_IMAGES else [first]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("profile") / "train.parquet"
    rows = [{"images": [{"bytes": png(size), "path": None} for size in sizes_of(i)],
             "problem": "<image>" * len(sizes_of(i)) + "What colour is it?", "answer": "red"} for i in range(ROWS)]
    schema = pa.schema([("images", pa.list_(IMAGE)), ("problem", pa.string()), ("answer", pa.string())])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path, row_group_size=16)
    return path


def config(data: Path, tmp_path: Path, *extra: str):
    return load([f"data.train_files={data}", "data.val_files=null", f"data.max_pixels={MAX_PIXELS}",
                 f"data.max_prompt_length={MAX_PROMPT}", f"trainer.output_dir={tmp_path}", *extra])


def processor_tokens(cfg, width: int, height: int, max_pixels: int) -> int:
    """Vision tokens of one image by transformers' own Qwen2.5-VL image processor (not easytrain's resize)."""
    processor = image_processor(model_folder(cfg.model), cfg)
    out = processor(images=[Image.new("RGB", (width, height))], return_tensors="pt",
                    size={"shortest_edge": cfg.data.min_pixels, "longest_edge": max_pixels})
    return int(out["image_grid_thw"].prod()) // processor.merge_size ** 2


_processors: dict = {}


def image_processor(folder: str, cfg):
    if folder not in _processors:
        _processors[folder] = load_image_processor(cfg.model, folder)
    return _processors[folder]


def test_the_profile_matches_an_independent_count(data: Path, tmp_path: Path) -> None:
    cfg = config(data, tmp_path)
    [profile] = profile_data(cfg, progress=False)
    assert profile.rows == profile.sampled == ROWS
    tokens = {size: processor_tokens(cfg, *size, MAX_PIXELS) for size in {*SMALL, *HUGE.values()}}
    kept = [i for i in range(ROWS) if i not in TWO_IMAGES]

    # every kept row's text costs the same tokens: the prompt is the text plus the image's tokens
    text = {c.text_tokens for c in profile.costs}
    assert len(text) == 1
    [text_tokens] = text
    over = [i for i in kept if text_tokens + tokens[sizes_of(i)[0]] > MAX_PROMPT]
    assert over and len(over) < len(HUGE)  # some oversized rows are too long at this limit, not all
    assert dict(profile.skipped) == {"too_many_images": 2, **({"prompt_too_long": len(over)} if over else {})}
    assert sorted(profile.over["too_many_images"]) == [2, 2]
    fitting = [i for i in kept if i not in over]
    assert sorted(c.where.rsplit("#", 1)[1] for c in profile.costs) == sorted(str(i) for i in fitting)

    vision = [tokens[sizes_of(i)[0]] for i in fitting]
    stats = profile.stats()
    for q in (50, 90, 99):
        assert stats["vision_tokens"][f"p{q}"] == np.percentile(vision, q, method="inverted_cdf")
        assert stats["prompt_tokens"][f"p{q}"] == text_tokens + np.percentile(vision, q, method="inverted_cdf")
    assert stats["vision_tokens"]["max"] == max(vision) and stats["images"]["max"] == 1

    # the costliest rows: the oversized images first, named by file and row
    named = [c.where for c in profile.costliest()]
    huge = sorted((i for i in HUGE if i in fitting), key=lambda i: -tokens[HUGE[i]])
    assert named[:len(huge)] == [f"{data}#{i}" for i in huge]
    assert all(c.sizes[0] == (HUGE[i][1], HUGE[i][0]) for c, i in zip(profile.costliest(), huge))


def test_candidate_limits_against_the_image_processor(data: Path, tmp_path: Path) -> None:
    cfg = config(data, tmp_path, "data.max_prompt_length=4096")  # every one-image row kept
    [profile] = profile_data(cfg, progress=False)
    kept = [i for i in range(ROWS) if i not in TWO_IMAGES]
    table = profile.pixel_candidates([MAX_PIXELS // 4, MAX_PIXELS, 4 * MAX_PIXELS])
    for row in table:
        m = row["max_pixels"]
        vision = [processor_tokens(cfg, *sizes_of(i)[0], m) for i in kept]
        whole = [(round(h / 28) * 28) * (round(w / 28) * 28) <= m for w, h in (sizes_of(i)[0] for i in kept)]
        assert row["unscaled_share"] == pytest.approx(sum(whole) / len(kept))
        assert row["vision_tokens_p99"] == np.percentile(vision, 99, method="inverted_cdf")
        assert row["vision_tokens_max"] == max(vision)
    assert [r["unscaled_share"] for r in table] == sorted(r["unscaled_share"] for r in table)

    lengths = profile.length_candidates([50, 100, 4096])
    prompt = sorted(c.prompt_tokens for c in profile.costs)
    assert [r["kept_share"] for r in lengths] == [sum(p <= v for p in prompt) / len(prompt) for v in (50, 100, 4096)]
    images = profile.image_count_candidates([1, 2])
    assert [r["kept_share"] for r in images] == [(ROWS - len(TWO_IMAGES)) / ROWS, 1.0]


def test_a_sample_is_seeded_uniform_and_in_file_order() -> None:
    positions = sample_positions([5, 0, 7], 4, seed=3)
    assert positions == sorted(positions) and len(set(positions)) == 4
    assert all((s, r) in {(0, i) for i in range(5)} | {(2, i) for i in range(7)} for s, r in positions)
    assert positions == sample_positions([5, 0, 7], 4, seed=3) != sample_positions([5, 0, 7], 4, seed=4)
    assert sample_positions([2, 1], 10, seed=0) == [(0, 0), (0, 1), (1, 0)]
    assert percentiles([]) == {"p50": 0, "p90": 0, "p99": 0, "max": 0}
    values = list(range(1, 201))
    assert percentiles(values) == {"p50": 100, "p90": 180, "p99": 198, "max": 200}


def test_a_whole_split_gives_the_data_reports_counts(data: Path, tmp_path: Path) -> None:
    cfg = config(data, tmp_path, "data.val_files=null")
    [profile] = profile_data(cfg, progress=False)
    run = RLData(cfg)
    report = run.train.skips
    assert (profile.sampled, len(profile.costs), dict(profile.skipped)) == (report.rows, report.kept,
                                                                            dict(report.reasons))
    # what the run's own read keeps (the in-run plan check's prices): the longest of every kept row
    read = DataCosts.read([run.train])
    assert read.longest(cfg) == functools.reduce(Longest.add, profile.costs, Longest()) != Longest()
    assert read.why_not(cfg) == "" and not run.sampled_at_launch()
    assert read.why_not(with_overrides(cfg, {"data.max_pixels": MAX_PIXELS // 4})) != ""
    small = config(data, tmp_path, "data.profile_rows=20")
    sampled = profile_data(small, progress=False)[0]
    picked = [r for _, r in sample_positions([ROWS], 20, small.trainer.seed)]
    assert sampled.rows == ROWS and sampled.sampled == 20
    assert sorted(int(c.where.rsplit("#", 1)[1]) for c in sampled.costs) == [
        r for r in picked if f"{data}#{r}" in {c.where for c in profile.costs}]


def test_the_plan_is_priced_on_the_longest_row_and_re_priced_under_other_limits(data: Path, tmp_path: Path) -> None:
    cfg = config(data, tmp_path, "data.max_prompt_length=4096", "data.max_pixels=1003520")  # 1280 tokens a side
    hf = hf_config_for(cfg.model)
    costs = DataCosts.of(profile_data(cfg, progress=False))
    kept = [i for i in range(ROWS) if i not in TWO_IMAGES]
    [text] = {c.text_tokens for c in costs.profiles[0].costs}
    for max_pixels in (1003520, MAX_PIXELS, MAX_PIXELS // 4):
        under = with_overrides(cfg, {"data.max_pixels": max_pixels})
        vision = max(processor_tokens(cfg, *sizes_of(i)[0], max_pixels) for i in kept)
        shape = costs.shape(under, hf)
        assert (shape.prompt, shape.images, shape.image_tokens) == (text + vision, 1, vision)
        assert shape.response == cfg.data.max_response_length
    data_plan, bound = plan(cfg, hf, data=costs), plan(cfg, hf)
    for phase in ("update", "generation"):
        assert data_plan.row(phase).process_host < bound.row(phase).process_host  # the limits overstate it
    shorter = with_overrides(cfg, {"data.max_prompt_length": text + 40})  # drops the rows over it
    fitting = [processor_tokens(cfg, *sizes_of(i)[0], 1003520) for i in kept]
    assert costs.shape(shorter, hf).prompt == text + max(v for v in fitting if text + v <= text + 40)
    more_images = with_overrides(cfg, {"data.limit_images": 2})
    assert costs.shape(more_images, hf) is None and "data.limit_images=2" in costs.why_not(more_images)


def test_a_step_is_priced_on_the_train_rows_and_a_validation_on_the_validation_rows(data: Path,
                                                                                   tmp_path: Path) -> None:
    """The update never sees a validation row: it is priced on the train split's rows, a validation on the
    validation split's (here, longer prompts with smaller images)."""
    val = tmp_path / "val.parquet"
    rows = [{"images": [{"bytes": png((56, 56)), "path": None}], "answer": "red",
             "problem": "<image>" + "Look at the picture and say what colour it is. " * 30}] * 2
    schema = pa.schema([("images", pa.list_(IMAGE)), ("problem", pa.string()), ("answer", pa.string())])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), val)
    cfg = config(data, tmp_path, "data.max_prompt_length=4096", f"data.val_files={val}")
    hf = hf_config_for(cfg.model)
    costs = DataCosts.of(profile_data(cfg, progress=False))
    train, validation = (max(c.prompt_tokens for c in p.costs) for p in costs.profiles)
    assert validation > train
    s = shape_of(cfg, hf, costs)
    assert (s.seq_tokens, s.validation.seq_tokens) == (train + s.response, validation + s.response)
    on, as_split = costs.profiles, dataclasses.replace
    train_rows = DataCosts.of([on[0], as_split(on[0], split="val")])  # every phase on the train rows
    val_rows = DataCosts.of([as_split(on[1], split="train"), on[1]])  # every phase on the validation rows
    both, on_train, on_val = (plan(cfg, hf, data=d) for d in (costs, train_rows, val_rows))
    assert on_train.row("validation").device != on_val.row("validation").device
    assert both.row("validation").device == on_val.row("validation").device
    assert both.row("update") == on_train.row("update")
    unread = plan(cfg, hf, data=DataCosts.of([on[0]]))  # validation files the data has not read: on the limits
    assert unread.row("validation").device == plan(cfg, hf).row("validation").device


def test_a_step_batch_carries_its_costliest_prompts_pixels_not_each_at_the_longest(data: Path,
                                                                                  tmp_path: Path) -> None:
    """A batch's pixel values are its own prompts': the plan prices a step batch's at its costliest prompts' sum
    (every row read), where the limits price every prompt at the longest row's."""
    cfg = config(data, tmp_path, "data.max_prompt_length=4096", "data.max_pixels=1003520",
                 "data.rollout_batch_size=4", "worker.actor.global_batch_size=4")
    hf = hf_config_for(cfg.model)
    costs = DataCosts.of(profile_data(cfg, progress=False))
    kept = [i for i in range(ROWS) if i not in TWO_IMAGES]
    tokens = sorted((processor_tokens(cfg, *sizes_of(i)[0], 1003520) for i in kept), reverse=True)
    s = shape_of(cfg, hf, costs)
    assert s.batch_vision == sum(tokens[:4]) < 4 * tokens[0] == 4 * s.image_tokens
    on_limits = dataclasses.replace(s, batch_vision=4 * s.image_tokens)
    pixel_bytes = s.values_per_token * 4
    assert batch_bytes(cfg, on_limits) - batch_bytes(cfg, s) == (4 * tokens[0] - sum(tokens[:4])) * pixel_bytes
    sampled = DataCosts.of(profile_data(with_overrides(cfg, {"data.profile_rows": 20}), progress=False))
    seen = [c.vision_tokens for c in sampled.profiles[0].costs]
    assert max(seen) <= sampled.batch_vision(cfg, "train", 4) <= 4 * max(seen)
    read = DataCosts.read([RLData(cfg).train])  # the run's own read of every row prices it the same
    assert read.batch_vision(cfg, "train", 4) == sum(tokens[:4])
    # a worker's share of a batch: the costliest prompts may all be its own
    world = s.world
    assert world == 2 and s.rank_vision == sum(tokens[:2])
    row = plan(cfg, hf, data=costs).row("update")
    share, even = (-(-paged(cfg, shape, "update") // world) for shape in (s.ranked, s))
    assert row.host_parts["object store pages (batches)"] == s.per_node * share and share > even


@pytest.fixture(scope="module")
def mixed(data: Path) -> Path:
    """``data`` plus a row of long text and a large image: over data.max_prompt_length at MAX_PIXELS, and the
    longest prompt once its image is smaller."""
    table = pq.read_table(data).to_pylist()
    table.append({"images": [{"bytes": png((700, 700)), "path": None}], "answer": "red",
                  "problem": "<image>" + "Look at the picture and say what colour it is. " * 3})
    path = data.with_name("mixed.parquet")
    schema = pa.schema([("images", pa.list_(IMAGE)), ("problem", pa.string()), ("answer", pa.string())])
    pq.write_table(pa.Table.from_pylist(table, schema=schema), path, row_group_size=16)
    return path


@pytest.mark.parametrize("family", ["qwen2_5_vl", "internvl", "gemma3"])
def test_a_profile_priced_under_other_limits_equals_the_data_read_under_them(family: str, mixed: Path,
                                                                           tmp_path: Path) -> None:
    """The plan re-prices a profile for a suggestion's limits without reading the data again: what it finds must
    be what the dataset reads under those limits (a smaller data.max_pixels brings back rows that were too long,
    downscale_images_to_fit shrinks them, a shorter max_prompt_length drops some)."""
    base = config(mixed, tmp_path, f"model.path=tiny:{family}")
    costs = DataCosts.of(profile_data(base, progress=False))
    text = min(c.text_tokens for c in costs.profiles[0].costs)
    changes = [{}, {"data.max_pixels": MAX_PIXELS // 4}, {"data.max_pixels": 4 * MAX_PIXELS},
               {"data.downscale_images_to_fit": True}, {"data.max_prompt_length": text + 20},
               {"data.max_prompt_length": text + 20, "data.downscale_images_to_fit": True}]
    found = []
    for change in changes:
        other = with_overrides(base, change)
        [read] = profile_data(other, progress=False)
        expected = functools.reduce(Longest.add, read.costs, Longest()) if read.costs else None
        assert costs.longest(other) == expected, change
        found.append(expected)
    assert len(set(found)) > 1  # the limits changed what is kept
    if family == "qwen2_5_vl":  # the long row is over the limit, and back (the longest) at a quarter of the pixels
        long_row = f"{mixed}#{ROWS}"
        assert long_row not in {c.where for c in costs.profiles[0].costs}
        quarter = profile_data(with_overrides(base, changes[1]), progress=False)[0]
        assert quarter.costliest(1)[0].where == long_row


def test_what_is_not_on_this_machine_is_not_downloaded_for_a_profile(data: Path, tmp_path: Path) -> None:
    from easytrain.trainer.data import try_profile

    hub_model = config(data, tmp_path, "model.path=Qwen/Qwen2.5-VL-7B-Instruct")
    assert try_profile(hub_model) == ([], "no data profile (model.path=Qwen/Qwen2.5-VL-7B-Instruct is not on this "
                                          "machine)")
    hub_data = config(data, tmp_path, "data.val_files=hiyouga/geometry3k@validation")
    assert try_profile(hub_data)[1] == ("no data profile (data.val_files=hiyouga/geometry3k@validation is not on "
                                        "this machine)")
    assert len(try_profile(config(data, tmp_path), progress=False)[0]) == 1
