"""Image paths are confined to data.image_dir, read only from regular files, and capped in bytes (issue 25, item 8).

Each refusal is a counted skip with a reason, never a crash, a hang or an unbounded read.
"""

from __future__ import annotations

import io
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any, Callable

import pytest
from PIL import Image

from easytrain.config.schema import DataConfig, ModelConfig
from easytrain.data.dataset import PromptDataset
from easytrain.data.images import MAX_IMAGE_FILE_BYTES, BadSample, ImageFiles, decode_image
from easytrain.models.hf import load_tokenizer


def _png(colour: tuple[int, int, int] = (10, 200, 10)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (40, 30), colour).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture()
def tree(tmp_path: Path) -> dict[str, Path]:
    """``img/`` (data.image_dir) holding ``in.png``, a folder ``sub``, a link out of it and a sparse file over the
    byte cap; ``outside.png`` beside it."""
    images = tmp_path / "img"
    (images / "sub").mkdir(parents=True)
    (images / "in.png").write_bytes(_png())
    (tmp_path / "outside.png").write_bytes(_png((200, 0, 0)))
    (images / "link.png").symlink_to(tmp_path / "outside.png")
    with open(images / "huge.png", "wb") as f:
        f.truncate(MAX_IMAGE_FILE_BYTES + 1)  # sparse: no disk used, nothing written
    return {"root": tmp_path, "img": images}


def _reason(value: Any, files: ImageFiles) -> str:
    with pytest.raises(BadSample) as info:
        decode_image(value, files)
    return info.value.reason


def test_paths_are_confined_to_image_dir(tree: dict[str, Path]) -> None:
    confined = ImageFiles(str(tree["img"]))
    opted_in = ImageFiles(str(tree["img"]), allow_outside=True)
    outside = str(tree["root"] / "outside.png")
    for escape in ("../outside.png", "sub/../../outside.png", outside, "link.png",
                   {"bytes": None, "path": "../outside.png"}, {"bytes": None, "path": outside}):
        assert _reason(escape, confined) == "image_outside_dir", escape
        assert decode_image(escape, opted_in).convert("RGB").getpixel((0, 0)) == (200, 0, 0), escape
    # Inside is inside however it is written.
    for inside in ("in.png", "./in.png", "sub/../in.png", str(tree["img"] / "in.png")):
        assert decode_image(inside, confined).size == (40, 30)
    with pytest.raises(BadSample, match=r"\.\./outside.png: leads to .*outside.png, outside data.image_dir .*; "
                                        r"set data.allow_outside_image_dir=true to read it"):
        decode_image("../outside.png", confined)
    with pytest.raises(BadSample, match=r"outside.png: an absolute path, outside data.image_dir"):
        decode_image(outside, confined)


def test_without_image_dir_the_current_folder_confines(tree: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tree["img"])
    assert decode_image("in.png").size == (40, 30)
    with pytest.raises(BadSample, match=r"outside the current folder \(.*; data.image_dir is unset\)"):
        decode_image("../outside.png")


def test_devices_are_refused_without_reading() -> None:
    if not os.path.exists("/dev/zero"):
        pytest.skip("no /dev/zero here")
    start = time.monotonic()
    assert _reason("/dev/zero", ImageFiles()) == "image_outside_dir"
    with pytest.raises(BadSample, match=r"/dev/zero: a character device, not a regular file") as info:
        decode_image({"bytes": None, "path": "/dev/zero"}, ImageFiles(allow_outside=True))
    assert info.value.reason == "image_not_a_file"
    assert time.monotonic() - start < 5


def test_a_fifo_is_refused_before_it_is_opened(tree: dict[str, Path]) -> None:
    fifo = tree["img"] / "pipe.png"
    os.mkfifo(fifo)
    outcome: dict[str, Any] = {}

    def read() -> None:
        try:
            decode_image("pipe.png", ImageFiles(str(tree["img"])))
        except BadSample as bad:
            outcome["bad"] = bad

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    thread.join(10)
    if thread.is_alive():  # blocked in open(): give it a writer so the thread ends, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        thread.join(5)
        pytest.fail("reading a FIFO image path blocked")
    assert outcome["bad"].reason == "image_not_a_file" and "a FIFO, not a regular file" in str(outcome["bad"])


def test_bytes_read_are_capped(tree: dict[str, Path]) -> None:
    files = ImageFiles(str(tree["img"]))
    with pytest.raises(BadSample, match=rf"huge.png: {MAX_IMAGE_FILE_BYTES + 1} bytes, over {MAX_IMAGE_FILE_BYTES}, "
                                        "the most read from one image file") as info:
        decode_image("huge.png", files)
    assert info.value.reason == "image_file_too_large"
    # A file whose size says nothing (procfs reports 0) is cut by the read itself.
    if os.path.isfile("/proc/self/status"):
        with pytest.raises(BadSample, match=r"status: over 16 bytes") as info:
            decode_image("/proc/self/status", ImageFiles(allow_outside=True, max_bytes=16))
        assert info.value.reason == "image_file_too_large"


@pytest.fixture(scope="module")
def tokenizer(tiny_model: Callable[..., Path]) -> Any:
    return load_tokenizer(ModelConfig(path=str(tiny_model("qwen2_5_vl"))))


def test_refused_paths_are_counted_skips(tree: dict[str, Path], tokenizer: Any,
                                         caplog: pytest.LogCaptureFixture) -> None:
    os.mkfifo(tree["img"] / "pipe.png")
    images = ["in.png", "../outside.png", str(tree["root"] / "outside.png"), "link.png", "pipe.png", "huge.png",
              "/dev/zero"]
    path = tree["root"] / "rows.jsonl"
    path.write_text("".join(json.dumps({"problem": "<image>colour?", "answer": "green", "images": [image]}) + "\n"
                            for image in images))
    cfg = DataConfig(image_dir=str(tree["img"]))
    with caplog.at_level(logging.WARNING, logger="easytrain.data.dataset"):
        dataset = PromptDataset([str(path)], cfg, tokenizer, progress=False)
    assert len(dataset) == 1 and dataset[0].uid.endswith("#0")
    expected = {"image_file_too_large": 1, "image_not_a_file": 1, "image_outside_dir": 4}
    assert dataset.skips.as_dict()["skipped"] == expected
    assert json.loads(dataset.write_skip_report(tree["root"] / "run").read_text())["train"]["skipped"] == expected
    lines = [r.getMessage() for r in caplog.records if " row " in r.getMessage()]
    assert any("row 1: image_outside_dir: ../outside.png: leads to" in line for line in lines)
    cfg.allow_outside_image_dir = True  # the user's opt-in: outside paths read; devices, FIFOs, huge files never
    opted_in = PromptDataset([str(path)], cfg, tokenizer, progress=False)
    assert len(opted_in) == 4
    assert opted_in.skips.as_dict()["skipped"] == {"image_file_too_large": 1, "image_not_a_file": 2}
