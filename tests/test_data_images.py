"""Image decoding, mode conversion and smart resize, checked against transformers' Qwen image processor."""

from __future__ import annotations

import base64
import io
import random
from pathlib import Path

import pytest
from PIL import Image

from easytrain.data.images import (BadSample, ImageFiles, decode_image, fit_image, smart_resize, to_rgb,
                                   vision_tokens)
from easytrain.models.families import adapter_class


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def test_smart_resize_matches_the_qwen_image_processor() -> None:
    rng = random.Random(0)
    cls = type(adapter_class("qwen2_vl").tiny_processor())
    checked = 0
    for _ in range(40):
        width, height = rng.randint(8, 900), rng.randint(8, 900)
        min_pixels = rng.choice([784, 3136, 50176])
        max_pixels = rng.choice([12544, 200704, 1003520])
        if max(width, height) / min(width, height) > 200 or min_pixels > max_pixels:
            continue  # both refused before this point (data.max_pixels >= data.min_pixels is validated)
        processor = cls(size={"shortest_edge": min_pixels, "longest_edge": max_pixels})
        grid = processor(images=[Image.new("RGB", (width, height))], return_tensors="pt")["image_grid_thw"][0]
        expected = (int(grid[1]) * 14, int(grid[2]) * 14)
        assert smart_resize(height, width, min_pixels, max_pixels) == expected, (width, height)
        # After our resize the processor has nothing left to change: same grid, same token count.
        fitted = fit_image(Image.new("RGB", (width, height)), min_pixels, max_pixels)
        regrid = processor(images=[fitted], return_tensors="pt")["image_grid_thw"][0]
        assert (fitted.height, fitted.width) == expected and regrid.tolist() == grid.tolist()
        assert vision_tokens(fitted.height, fitted.width) == int(grid.prod()) // 4
        checked += 1
    assert checked >= 20


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P", "L", "1", "CMYK", "I;16", "I", "F", "RGB", "YCbCr"])
def test_any_mode_becomes_rgb(mode: str) -> None:
    image = Image.new(mode, (40, 30))
    rgb = to_rgb(image)
    assert rgb.mode == "RGB" and rgb.size == (40, 30)


def test_transparency_is_composited_on_white() -> None:
    clear = Image.new("RGBA", (8, 8), (255, 0, 0, 0))
    assert to_rgb(clear).getpixel((0, 0)) == (255, 255, 255)
    palette = Image.new("P", (8, 8), 0)
    palette.putpalette([0, 0, 0] * 256)
    palette.info["transparency"] = 0
    assert to_rgb(palette).getpixel((0, 0)) == (255, 255, 255)


def test_sixteen_bit_is_scaled_not_clipped() -> None:
    image = Image.new("I;16", (4, 1))
    for x, value in enumerate([0, 1000, 30000, 60000]):
        image.putpixel((x, 0), value)
    row = [to_rgb(image).getpixel((x, 0))[0] for x in range(4)]
    assert row[0] == 0 and row[-1] == 255 and row == sorted(row)


def test_decode_every_supported_form(tmp_path: Path) -> None:
    image = Image.new("RGB", (30, 20), (1, 2, 3))
    data = _png(image)
    (tmp_path / "a.png").write_bytes(data)
    b64 = base64.b64encode(data).decode()
    forms = [image, data, {"bytes": data, "path": None}, {"bytes": None, "path": "a.png"},
             str(tmp_path / "a.png"), "a.png", b64, f"data:image/png;base64,{b64}"]
    for form in forms:
        decoded = decode_image(form, ImageFiles(str(tmp_path)))
        assert decoded.size == (30, 20) and decoded.convert("RGB").getpixel((0, 0)) == (1, 2, 3)


@pytest.mark.parametrize("value,reason", [
    (b"not an image at all", "image_unreadable"),
    (b"", "image_unreadable"),
    ("missing/file.png", "image_missing"),
    ("A" * 300 + "!!", "image_missing"),
    ("QUJD", "image_unreadable"),  # valid base64, not an image
    ({"bytes": None, "path": None}, "image_unreadable"),
    (12345, "image_unreadable"),
])
def test_bad_image_values(value, reason: str) -> None:
    with pytest.raises(BadSample) as info:
        decode_image(value)
    assert info.value.reason == reason


def test_truncated_png_is_unreadable() -> None:
    data = _png(Image.new("RGB", (64, 64), (9, 9, 9)))
    with pytest.raises(BadSample, match="image_unreadable"):
        decode_image(data[: len(data) // 2])


def test_decompression_bomb_is_refused_before_decoding() -> None:
    bomb = _png(Image.new("1", (10_000, 10_000)))  # 100 MP, a few KB on disk
    assert len(bomb) < 200_000
    with pytest.raises(BadSample, match="image_too_large"):
        decode_image(bomb)
    with pytest.raises(BadSample, match="image_too_large"):  # already decoded elsewhere: the limit holds too
        decode_image(Image.new("1", (10_000, 10_000)))


def test_tiny_and_elongated_images_are_refused() -> None:
    with pytest.raises(BadSample, match="image_too_small"):
        fit_image(Image.new("RGB", (1, 1)), 3136, 12544)
    with pytest.raises(BadSample, match="image_aspect_ratio"):
        fit_image(Image.new("RGB", (1000, 4)), 3136, 12544)
