"""Video input: patch layout checked against transformers' Qwen image processor, PyAV decoding and sampling,
confinement and the BadSample reasons."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from easytrain.data.images import BadSample, ImageFiles
from easytrain.data.video import decode_video, fit_video, video_tokens
from easytrain.models.families import adapter_class
from easytrain.models.families.qwen import video_patches

PATCH = 14


def _noise(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), mode="RGB")


def _by_frame(rows: torch.Tensor) -> torch.Tensor:
    """Rows (N, C*T*P*P) viewed as (N, C, T, P*P): each row is one patch, channels outermost, then time."""
    return rows.reshape(rows.shape[0], 3, 2, PATCH * PATCH)


def test_patches_match_the_image_processor_and_keep_frame_order() -> None:
    processor = adapter_class("qwen2_vl").tiny_processor()
    a, b = _noise(84, 56, 0), _noise(84, 56, 1)  # non-square, on the 28-px grid: the processor keeps its size
    want_a = processor(images=[a], return_tensors="pt")
    want_b = processor(images=[b], return_tensors="pt")

    pixels, grid = video_patches([a, a], processor)
    assert pixels.dtype == torch.float32 and grid.dtype == torch.long
    assert grid.tolist() == want_a["image_grid_thw"].tolist() == [[1, 4, 6]]
    assert pixels.shape == want_a["pixel_values"].shape == (24, 3 * 2 * PATCH * PATCH)
    assert torch.equal(pixels, want_a["pixel_values"].float())

    # The image processor's rows hold each frame twice (T slots equal); a video row holds A in slot 0, B in 1.
    pixels, grid = video_patches([a, b], processor)
    assert grid.tolist() == [[1, 4, 6]]
    got, ref_a, ref_b = _by_frame(pixels), _by_frame(want_a["pixel_values"]), _by_frame(want_b["pixel_values"])
    assert torch.equal(got[:, :, 0], ref_a[:, :, 0])
    assert torch.equal(got[:, :, 1], ref_b[:, :, 0])
    assert not torch.equal(got[:, :, 0], got[:, :, 1])


@pytest.mark.parametrize("count", [4, 3])
def test_temporal_patches_and_token_count(count: int) -> None:
    processor = adapter_class("qwen2_vl").tiny_processor()
    frames = fit_video([_noise(84, 56, seed) for seed in range(count)], 3136, 1003520, 28)
    assert len(frames) == 4
    if count == 3:  # an odd count repeats the last frame
        assert frames[3] is frames[2]
    pixels, grid = video_patches(frames, processor)
    assert grid.tolist() == [[2, 4, 6]]
    assert pixels.shape[0] == int(grid.prod())
    assert video_tokens(frames, 28) == int(grid.prod()) // 4 == 12
    # The second temporal patch holds frames 2 and 3, in that order.
    later = _by_frame(pixels[24:])
    single = _by_frame(video_patches([frames[2], frames[2]], processor)[0])
    assert torch.equal(later[:, :, 0], single[:, :, 0])
    assert torch.equal(later[:, :, 1], single[:, :, 0]) == (count == 3)


def _write_clip(path: Path, frames: int = 8, rate: int = 4) -> None:
    import av

    with av.open(str(path), mode="w") as container:
        stream = container.add_stream("mpeg4", rate=rate)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        for i in range(frames):
            pixels = np.zeros((48, 64, 3), dtype=np.uint8)
            left = 4 + 6 * i
            pixels[16:32, left:left + 12] = 255  # a bright square moving right
            for packet in stream.encode(av.VideoFrame.from_ndarray(pixels, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)


def _frame_index(image: Image.Image) -> int:
    """Which clip frame this is, from the square's centre (9.5 + 6 i px in frame i)."""
    x = _centre_x(image)
    index = round((x - 9.5) / 6)
    assert abs(x - (9.5 + 6 * index)) < 1.0, x
    return index


def _centre_x(image: Image.Image) -> float:
    brightness = np.asarray(image.convert("L"), dtype=np.float64)
    columns = brightness.sum(axis=0)
    return float((columns * np.arange(columns.size)).sum() / columns.sum())


def test_video_file_sampling(tmp_path: Path) -> None:
    images = tmp_path / "images"
    images.mkdir()
    _write_clip(images / "clip.mp4")
    files = ImageFiles(image_dir=str(images))

    frames, fps = decode_video("clip.mp4", files, "row 0", fps=2.0, max_frames=100)
    assert fps == 2.0 and len(frames) == 4
    assert all(f.size == (64, 48) for f in frames)
    assert [_frame_index(f) for f in frames] == [0, 2, 4, 6]  # the frames at 0, 0.5, 1 and 1.5 s

    frames, fps = decode_video({"path": "clip.mp4"}, files, "row 0", fps=4.0, max_frames=100)
    assert fps == 4.0 and len(frames) == 8
    assert [_frame_index(f) for f in frames] == list(range(8))

    # Past max_frames: 3 frames evenly over the 2 s video, at the rate they really have (1.5 fps).
    data = (images / "clip.mp4").read_bytes()
    frames, fps = decode_video({"bytes": data}, None, "row 0", fps=4.0, max_frames=3)
    assert len(frames) == 3 and fps == pytest.approx(1.5)
    # Nearest to 0, 0.667 and 1.333 s: frames 0 (0 s), 3 (0.75 s) and 5 (1.25 s), not the first three.
    assert [_frame_index(f) for f in frames] == [0, 3, 5]

    (images / "noise.mp4").write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(BadSample) as err:
        decode_video("noise.mp4", files, "row 1", fps=2.0, max_frames=8)
    assert err.value.reason == "video_unreadable"
    with pytest.raises(BadSample) as err:
        decode_video(b"not a video at all", files, "row 1", fps=2.0, max_frames=8)
    assert err.value.reason == "video_unreadable"

    outside = tmp_path / "outside"
    outside.mkdir()
    _write_clip(outside / "clip.mp4", frames=2)
    for path in (str(outside / "clip.mp4"), "../outside/clip.mp4"):
        with pytest.raises(BadSample) as err:
            decode_video(path, files, "row 2", fps=2.0, max_frames=8)
        assert err.value.reason == "image_outside_dir"
    with pytest.raises(BadSample) as err:
        decode_video("missing.mp4", files, "row 3", fps=2.0, max_frames=8)
    assert err.value.reason == "video_missing"


def test_frame_lists() -> None:
    frames = [_noise(84, 56, seed) for seed in range(3)]
    got, fps = decode_video(frames, None, "row 0", fps=2.0, max_frames=3)
    assert got == frames and fps == 2.0
    with pytest.raises(BadSample) as err:
        decode_video(frames, None, "row 0", fps=2.0, max_frames=2)
    assert err.value.reason == "too_many_frames" and "3 frames > data.max_frames=2" in str(err.value)
    with pytest.raises(BadSample) as err:
        decode_video([], None, "row 0", fps=2.0, max_frames=2)
    assert err.value.reason == "video_empty"

    mixed = [_noise(84, 56, 0), _noise(40, 90, 1), _noise(84, 56, 2).convert("L"), _noise(200, 100, 3)]
    fitted = fit_video(mixed, 3136, 1003520, 28)
    assert [f.size for f in fitted] == [(84, 56)] * 4 and all(f.mode == "RGB" for f in fitted)
    with pytest.raises(BadSample) as err:
        fit_video([_noise(84, 56, 0), _noise(3, 56, 1)], 3136, 1003520, 28)
    assert err.value.reason == "image_too_small"
