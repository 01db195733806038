"""Decoding, cleaning and sizing images the way the Qwen2-VL family sees them.

Images arrive as PIL images, raw bytes, ``{"bytes": ..., "path": ...}``
dicts (the HF/geometry3k parquet form), file paths (absolute or relative to
``data.image_dir``) or base64 strings (optionally ``data:image/...;base64,``).
Whatever arrives is decoded fully, converted to 8-bit RGB and resized with
the "smart resize" rule onto the 28-px grid (14-px patches merged 2x2), so
its vision-token count is known exactly: ``(height / 28) * (width / 28)``.

Every failure is a :class:`BadSample` with a short reason code; the dataset
counts them and skips the row instead of crashing the run.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import os
import warnings
from typing import Any, Optional

import numpy as np
from PIL import Image

PATCH_SIZE = 14
MERGE_SIZE = 2
FACTOR = PATCH_SIZE * MERGE_SIZE
"""Pixels per vision token along each side (a token covers FACTOR x FACTOR pixels)."""
MAX_ASPECT_RATIO = 200
"""Qwen's vision tower refuses images more elongated than this."""
MIN_SIDE = 4
"""Images with a side shorter than this carry no usable content; skipped."""
MAX_DECODED_PIXELS = 89_478_485
"""Decompression-bomb guard: PIL's default warning limit (~89 MP, e.g. 9459 x 9459)."""


class BadSample(Exception):
    """A row that cannot be used; ``reason`` is a short code counted in the skip summary."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail


def smart_resize(height: int, width: int, min_pixels: int, max_pixels: int,
                 factor: int = FACTOR) -> tuple[int, int]:
    """Target (height, width): multiples of ``factor``, area within [min_pixels, max_pixels], aspect kept.

    The same rule as Qwen2-VL's image processor (rounding to the grid, then
    scaling down or up by the square root of the area ratio).
    """
    if min(height, width) <= 0:
        raise BadSample("image_too_small", f"{width}x{height}")
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise BadSample("image_aspect_ratio", f"{width}x{height} is more elongated than {MAX_ASPECT_RATIO}:1")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def vision_tokens(height: int, width: int) -> int:
    """Tokens an image of this (already resized) size occupies."""
    return (height // FACTOR) * (width // FACTOR)


def _open_bytes(data: bytes, where: str) -> Image.Image:
    if not data:
        raise BadSample("image_unreadable", f"{where}: empty bytes")
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data))
            if image.width * image.height > MAX_DECODED_PIXELS:
                raise BadSample("image_too_large", f"{where}: {image.width}x{image.height} pixels")
            image.load()
        except BadSample:
            raise
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as err:
            raise BadSample("image_too_large", f"{where}: {err}") from err
        except Exception as err:  # PIL raises many types for corrupt data
            raise BadSample("image_unreadable", f"{where}: {type(err).__name__}: {err}") from err
    return image


def _resolve(path: str, image_dir: Optional[str]) -> str:
    return path if os.path.isabs(path) or not image_dir else os.path.join(image_dir, path)


def _read_path(path: str, image_dir: Optional[str]) -> bytes:
    full = _resolve(path, image_dir)
    try:
        with open(full, "rb") as f:
            return f.read()
    except OSError as err:
        raise BadSample("image_missing", f"{full}: {err.strerror or err}") from err


def _base64(text: str) -> Optional[bytes]:
    payload = text.split(",", 1)[1] if text.startswith("data:") else text
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        return None


def decode_image(value: Any, image_dir: Optional[str] = None, where: str = "image") -> Image.Image:
    """Decode any supported image form into a fully loaded PIL image (any mode)."""
    if isinstance(value, Image.Image):
        return value
    if isinstance(value, dict):
        if value.get("bytes"):
            return _open_bytes(value["bytes"], where)
        if value.get("path"):
            return _open_bytes(_read_path(value["path"], image_dir), str(value["path"]))
        raise BadSample("image_unreadable", f"{where}: neither bytes nor path")
    if isinstance(value, (bytes, bytearray)):
        return _open_bytes(bytes(value), where)
    if isinstance(value, str):
        full = _resolve(value, image_dir)
        if not value.startswith("data:") and os.path.exists(full):
            return _open_bytes(_read_path(value, image_dir), value)
        data = _base64(value)
        if data:
            return _open_bytes(data, where)
        raise BadSample("image_missing", f"{full[:200]}: no such file, and not base64 image data")
    raise BadSample("image_unreadable", f"{where}: unsupported type {type(value).__name__}")


def to_rgb(image: Image.Image) -> Image.Image:
    """8-bit RGB from any mode: transparency over white, 16-bit/float scaled to 0-255, CMYK converted."""
    mode = image.mode
    if mode == "RGB":
        return image
    if mode in ("I", "I;16", "I;16B", "I;16L", "I;16N", "F"):
        array = np.asarray(image, dtype=np.float64)
        low, high = float(array.min()), float(array.max())
        scaled = (array - low) * (255.0 / (high - low)) if high > low else np.zeros_like(array)
        return Image.fromarray(scaled.astype(np.uint8), mode="L").convert("RGB")
    if mode == "P" and "transparency" in image.info:
        image = image.convert("RGBA")
        mode = "RGBA"
    if mode in ("RGBA", "LA", "PA", "RGBa", "La"):
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def fit_image(image: Image.Image, min_pixels: int, max_pixels: int) -> Image.Image:
    """RGB image resized (bicubic) onto the token grid within [min_pixels, max_pixels]."""
    if min(image.size) < MIN_SIDE:
        raise BadSample("image_too_small", f"{image.width}x{image.height} (sides under {MIN_SIDE} px)")
    rgb = to_rgb(image)
    height, width = smart_resize(rgb.height, rgb.width, min_pixels, max_pixels)
    if (height, width) != (rgb.height, rgb.width):
        rgb = rgb.resize((width, height), Image.Resampling.BICUBIC)
    return rgb
