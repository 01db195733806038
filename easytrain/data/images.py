"""Decoding, cleaning and sizing images onto a family's grid.

Images arrive as PIL images, raw bytes, ``{"bytes": ..., "path": ...}``
dicts (the HF/geometry3k parquet form, HF datasets read undecoded), file paths
(relative to ``data.image_dir``) or base64 strings (optionally
``data:image/...;base64,``). Whatever arrives is decoded here, fully,
converted to 8-bit RGB and resized with the dynamic-resolution ("smart
resize") rule onto the family layout's grid (:class:`easytrain.data.vision.Layout`;
by default 28 px: 14-px patches merged 2x2), so its vision-token count is
known exactly: ``(height / 28) * (width / 28)`` on the default grid.

A path is read only where :class:`ImageFiles` allows: its real path (links
and ``..`` resolved) must lie under ``data.image_dir`` (or the current folder
when unset) unless ``data.allow_outside_image_dir``; it must be a regular
file (checked before it is opened, so a FIFO or ``/dev/zero`` is refused
without blocking), and at most :data:`MAX_IMAGE_FILE_BYTES` are read.

Every failure is a :class:`BadSample` with a short reason code; the dataset
counts them and skips the row instead of crashing the run.
"""

from __future__ import annotations

import base64
import binascii
import io
import math
import os
import stat
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
from PIL import Image

PATCH_SIZE = 14
MERGE_SIZE = 2
FACTOR = PATCH_SIZE * MERGE_SIZE
"""Pixels per vision token along each side (a token covers FACTOR x FACTOR pixels)."""
MAX_ASPECT_RATIO = 200
"""Dynamic-resolution vision towers refuse images more elongated than this."""
MIN_SIDE = 4
"""Images with a side shorter than this carry no usable content; skipped."""
MAX_DECODED_PIXELS = 89_478_485
"""Decompression-bomb guard: PIL's default warning limit (~89 MP, e.g. 9459 x 9459)."""
MAX_IMAGE_FILE_BYTES = 64 * 2**20
"""Most bytes read from one image file (64 MiB); a larger file is skipped (``image_file_too_large``). Far above a
compressed photo within MAX_DECODED_PIXELS (an uncompressed RGB file over ~22 MP exceeds it), it bounds what a
wrong path (a disk image, a log, a growing file) costs a loader process."""


class BadSample(Exception):
    """A row that cannot be used; ``reason`` is a short code counted in the skip summary."""

    def __init__(self, reason: str, detail: str = "", measured: Optional[int] = None, cost: Any = None) -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason, self.detail = reason, detail
        self.measured = measured
        """The count that broke a limit (a prompt's tokens, a row's images or videos), where one was measured."""
        self.cost = cost
        """A row over ``data.max_prompt_length``: what it costs (:class:`easytrain.data.profile.RowCost`), so a
        data profile can price it under other limits."""


def smart_resize(height: int, width: int, min_pixels: int, max_pixels: int,
                 factor: int = FACTOR) -> tuple[int, int]:
    """Target (height, width): multiples of ``factor``, area within [min_pixels, max_pixels], aspect kept.

    The dynamic-resolution processors' rule: round to the grid, then scale down
    or up by the square root of the area ratio.
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
        except Image.UnidentifiedImageError as err:  # its own text names a BytesIO object, not the image
            raise BadSample("image_unreadable", f"{where}: not an image format PIL can read") from err
        except Exception as err:  # PIL raises many types for corrupt data
            raise BadSample("image_unreadable", f"{where}: {type(err).__name__}: {err}") from err
    return image


@dataclass(frozen=True)
class ImageFiles:
    """Where image paths are resolved and which files may be read: one per row source."""

    image_dir: Optional[str] = None
    """data.image_dir: relative paths are resolved against it (the current folder when None)."""
    allow_outside: bool = False
    """data.allow_outside_image_dir: also read paths whose real path leads outside image_dir."""
    also_under: tuple[str, ...] = ()
    """Further folders files may be read from: an HF dataset's own folder, the HF caches of a hub dataset."""
    max_bytes: int = MAX_IMAGE_FILE_BYTES
    """Most bytes read from one file."""

    def base(self) -> str:
        return os.path.realpath(os.path.expanduser(self.image_dir) if self.image_dir else os.getcwd())

    def joined(self, path: str) -> str:
        """``path`` against the base, unresolved (an absolute path stays itself)."""
        return os.path.join(self.base(), path)

    def resolve(self, path: str) -> str:
        """The real path of ``path``; BadSample ``image_outside_dir`` where it leads out of the allowed folders."""
        if "\x00" in path:
            raise BadSample("image_missing", f"{path[:200]!r}: a path cannot hold a NUL character")
        full = os.path.realpath(self.joined(path))
        if self.allow_outside:
            return full
        roots = [self.base(), *(os.path.realpath(os.path.expanduser(r)) for r in self.also_under)]
        if any(os.path.commonpath([full, root]) == root for root in roots):
            return full
        where = (f"data.image_dir ({roots[0]})" if self.image_dir
                 else f"the current folder ({roots[0]}; data.image_dir is unset)")
        what = "an absolute path" if os.path.isabs(path) else f"leads to {full}"
        raise BadSample("image_outside_dir", f"{path}: {what}, outside {where}; "
                        "set data.allow_outside_image_dir=true to read it")


_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _read_path(path: str, files: ImageFiles) -> bytes:
    """The bytes of an image file: confined, a regular file (checked before opening), at most files.max_bytes."""
    full = files.resolve(path)
    try:
        info = os.stat(full)
    except OSError as err:
        raise BadSample("image_missing", f"{full}: {err.strerror or err}") from err
    if not stat.S_ISREG(info.st_mode):  # a FIFO would block open() and read(); /dev/zero never ends
        raise BadSample("image_not_a_file", f"{full}: {_kind(info.st_mode)}, not a regular file")
    if info.st_size > files.max_bytes:
        raise BadSample("image_file_too_large", f"{full}: {info.st_size} bytes, over {files.max_bytes}, "
                        "the most read from one image file")
    try:  # O_NONBLOCK: a file swapped for a FIFO since the stat above cannot block the open
        fd = os.open(full, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as err:
        raise BadSample("image_missing", f"{full}: {err.strerror or err}") from err
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(f.fileno()).st_mode
        if not stat.S_ISREG(mode):
            raise BadSample("image_not_a_file", f"{full}: {_kind(mode)}, not a regular file")
        try:
            data = f.read(files.max_bytes + 1)  # a file that grew, or reports no size (/proc), stops here
        except OSError as err:
            raise BadSample("image_missing", f"{full}: {err.strerror or err}") from err
    if len(data) > files.max_bytes:
        raise BadSample("image_file_too_large", f"{full}: over {files.max_bytes} bytes, "
                        "the most read from one image file")
    return data


def _base64(text: str) -> Optional[bytes]:
    payload = text.split(",", 1)[1] if text.startswith("data:") else text
    try:
        return base64.b64decode("".join(payload.split()), validate=True)
    except (binascii.Error, ValueError):
        return None


def decode_image(value: Any, files: Optional[ImageFiles] = None, where: str = "image") -> Image.Image:
    """Decode any supported image form into a fully loaded PIL image (any mode); paths are read as ``files``
    allows (the current folder, confined, when None)."""
    files = files or ImageFiles()
    if isinstance(value, Image.Image):
        if value.width * value.height > MAX_DECODED_PIXELS:
            raise BadSample("image_too_large", f"{where}: {value.width}x{value.height} pixels")
        return value
    if isinstance(value, dict):
        if value.get("bytes"):
            return _open_bytes(value["bytes"], where)
        if value.get("path"):
            return _open_bytes(_read_path(str(value["path"]), files), str(value["path"]))
        raise BadSample("image_unreadable", f"{where}: neither bytes nor path")
    if isinstance(value, (bytes, bytearray)):
        return _open_bytes(bytes(value), where)
    if isinstance(value, str):
        if not value.startswith("data:") and os.path.lexists(files.joined(value)):
            return _open_bytes(_read_path(value, files), value)
        data = _base64(value)
        if data:
            return _open_bytes(data, where)
        raise BadSample("image_missing", f"{files.joined(value)[:200]}: no such file, and not base64 image data")
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


def fit_image(image: Image.Image, min_pixels: int, max_pixels: int, factor: int = FACTOR) -> Image.Image:
    """RGB image resized (bicubic) onto the ``factor``-px grid (a family's :class:`easytrain.data.vision.Layout`)
    within [min_pixels, max_pixels]."""
    if min(image.size) < MIN_SIDE:
        raise BadSample("image_too_small", f"{image.width}x{image.height} (sides under {MIN_SIDE} px)")
    rgb = to_rgb(image)
    height, width = smart_resize(rgb.height, rgb.width, min_pixels, max_pixels, factor)
    if (height, width) != (rgb.height, rgb.width):
        rgb = rgb.resize((width, height), Image.Resampling.BICUBIC)
    return rgb
