"""Decoding, sampling and sizing videos for the families that take them.

A row's video is either a list of frames (any form :func:`decode_image`
accepts, taken to be at ``data.video_fps``) or a video file (a path, a
``{"path": ...}`` / ``{"bytes": ...}`` dict, or raw bytes) decoded with PyAV.
A file is sampled at ``fps`` (the frame nearest each time ``k / fps``); when
that would give more than ``max_frames`` frames, ``max_frames`` frames are
taken evenly over the whole video and the rate they really have is returned,
so temporal positions stay true. Paths are confined exactly like image paths
(:class:`ImageFiles`), at most :data:`MAX_VIDEO_FILE_BYTES` per file.

Frames are then fitted to one size on the family's grid (:func:`fit_video`,
the layout's cell side) in an even count, as frame pairs form one temporal
patch; the family's adapter patchifies them into its vision stream
(:mod:`easytrain.models.families`).

Every failure is a :class:`BadSample`; the dataset counts it and skips the row.
"""

from __future__ import annotations

import io
import logging
import math
import os
import stat
from dataclasses import dataclass
from typing import IO, Any, Optional, Sequence

from PIL import Image

from easytrain.data.images import (MAX_DECODED_PIXELS, MIN_SIDE, BadSample, ImageFiles, _kind, decode_image,
                                   smart_resize, to_rgb)

logger = logging.getLogger(__name__)


@dataclass
class Clip:
    """A prompt's video: fitted frames (one size, an even count) and the rate they are at."""

    frames: list[Image.Image]
    fps: float

    @property
    def seconds_per_patch(self) -> float:
        """Seconds one temporal patch (TEMPORAL_PATCH_SIZE frames) spans."""
        return TEMPORAL_PATCH_SIZE / self.fps

TEMPORAL_PATCH_SIZE = 2
MAX_VIDEO_FILE_BYTES = 1 << 30
"""Most bytes read from one video file (1 GiB); a larger file is skipped (``video_file_too_large``)."""


def _open_file(path: str, files: ImageFiles) -> IO[bytes]:
    """A video file opened for reading: confined, a regular file (checked before and after opening), bounded."""
    full = files.resolve(path)  # image_outside_dir where it leads out of the allowed folders
    try:
        info = os.stat(full)
    except OSError as err:
        raise BadSample("video_missing", f"{full}: {err.strerror or err}") from err
    if not stat.S_ISREG(info.st_mode):  # a FIFO would block open(); /dev/zero never ends
        raise BadSample("video_not_a_file", f"{full}: {_kind(info.st_mode)}, not a regular file")
    try:  # O_NONBLOCK: a file swapped for a FIFO since the stat above cannot block the open
        fd = os.open(full, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    except OSError as err:
        raise BadSample("video_missing", f"{full}: {err.strerror or err}") from err
    handle = os.fdopen(fd, "rb")
    info = os.fstat(handle.fileno())
    if not stat.S_ISREG(info.st_mode) or info.st_size > MAX_VIDEO_FILE_BYTES:
        handle.close()
        if not stat.S_ISREG(info.st_mode):
            raise BadSample("video_not_a_file", f"{full}: {_kind(info.st_mode)}, not a regular file")
        raise BadSample("video_file_too_large", f"{full}: {info.st_size} bytes, over {MAX_VIDEO_FILE_BYTES}, "
                        "the most read from one video file")
    return handle


def _timeline(source: IO[bytes]) -> tuple[float, float, Optional[float]]:
    """(start, duration, rate) of the first video stream from its packets (demuxed, not decoded).

    ``rate`` is None where every packet has a timestamp (frames are then placed by their own); otherwise
    frames are placed by index at the stream's rate.
    """
    import av

    with av.open(source) as container:
        if not container.streams.video:
            raise BadSample("video_unreadable", "no video stream")
        stream = container.streams.video[0]
        stamps: list[Optional[float]] = []
        for packet in container.demux(stream):
            if packet.size:  # the empty packet at the end only flushes the decoder
                stamps.append(None if packet.pts is None else float(packet.pts * stream.time_base))
        guessed = stream.average_rate or stream.guessed_rate or stream.base_rate
    if not stamps:
        raise BadSample("video_empty", "no frames")
    if all(s is not None for s in stamps):
        times = sorted(s for s in stamps if s is not None)
        step = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 0.0
        if step <= 0:
            step = 1.0 / float(guessed) if guessed else 1.0
        return times[0], times[-1] - times[0] + step, None
    if not guessed:
        raise BadSample("video_unreadable", "frames without timestamps and no frame rate")
    return 0.0, len(stamps) / float(guessed), float(guessed)


def _sample(source: IO[bytes], targets: Sequence[float], index_rate: Optional[float]) -> list[Image.Image]:
    """For each target time (ascending), the decoded frame nearest it, in one streaming decode pass."""
    import av

    chosen: list[Image.Image] = []
    prev: Any = None
    prev_time = -math.inf
    with av.open(source) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        for k, frame in enumerate(container.decode(stream)):
            if frame.width * frame.height > MAX_DECODED_PIXELS:
                raise BadSample("image_too_large", f"{frame.width}x{frame.height} pixels a frame")
            if index_rate:
                time = k / index_rate
            elif frame.time is not None:
                time = float(frame.time)
            else:  # a stray frame without a timestamp: just after the one before it
                time = prev_time + 1e-9 if prev is not None else 0.0
            while len(chosen) < len(targets) and targets[len(chosen)] <= time:
                target = targets[len(chosen)]
                near = prev if prev is not None and target - prev_time <= time - target else frame
                chosen.append(near.to_image())
            if len(chosen) == len(targets):
                break
            prev, prev_time = frame, time
    while prev is not None and len(chosen) < len(targets):  # targets past the last frame get the last frame
        chosen.append(prev.to_image())
    return chosen


def _decode_file(source: IO[bytes], fps: float, max_frames: int) -> tuple[list[Image.Image], float]:
    start, duration, index_rate = _timeline(source)
    count = max(1, math.ceil(duration * fps - 1e-6))
    if count > max_frames:
        logger.debug("%.2f s at %.3g fps is %d frames > %d; sampling %d evenly", duration, fps, count,
                     max_frames, max_frames)
        count, fps = max_frames, max_frames / duration
    source.seek(0)
    frames = _sample(source, [start + k / fps for k in range(count)], index_rate)
    if not frames:
        raise BadSample("video_empty", "no frame decoded")
    return frames, fps


def decode_video(value: Any, files: Optional[ImageFiles], where: str, fps: float,
                 max_frames: int) -> tuple[list[Image.Image], float]:
    """A row's video as decoded frames and the rate they are at (frames per second).

    A list/tuple is taken as frames at ``fps``; a path, ``{"path"}``/``{"bytes"}`` dict or bytes is a video
    file, sampled at ``fps`` or, past ``max_frames``, at ``max_frames`` frames evenly over the whole video
    (whose real rate is returned).
    """
    if fps <= 0 or max_frames < 1:
        raise ValueError(f"video fps must be > 0 and max_frames >= 1, got {fps} and {max_frames}")
    files = files or ImageFiles()
    if isinstance(value, (list, tuple)):
        if not value:
            raise BadSample("video_empty", f"{where}: no frames")
        if len(value) > max_frames:
            raise BadSample("too_many_frames", f"{len(value)} frames > data.max_frames={max_frames}")
        return [decode_image(frame, files, f"{where} frame {i}") for i, frame in enumerate(value)], float(fps)
    if isinstance(value, dict) and not value.get("bytes"):
        value = value.get("path")
        if not value:
            raise BadSample("video_unreadable", f"{where}: neither bytes nor path")
    elif isinstance(value, dict):
        value = value["bytes"]
    if isinstance(value, (bytes, bytearray)):
        if len(value) > MAX_VIDEO_FILE_BYTES:
            raise BadSample("video_file_too_large", f"{where}: {len(value)} bytes")
        source: IO[bytes] = io.BytesIO(bytes(value))
    elif isinstance(value, (str, os.PathLike)):
        where = os.fspath(value)
        source = _open_file(where, files)
    else:
        raise BadSample("video_unreadable", f"{where}: unsupported type {type(value).__name__}")
    with source:
        try:
            return _decode_file(source, fps, max_frames)
        except BadSample as err:
            raise BadSample(err.reason, f"{where}: {err.detail}") from err
        except Exception as err:  # PyAV/FFmpeg raise many types for corrupt or unsupported data
            raise BadSample("video_unreadable", f"{where}: {type(err).__name__}: {err}") from err


def fit_video(frames: Sequence[Image.Image], min_pixels: int, max_pixels: int, factor: int) -> list[Image.Image]:
    """RGB frames all resized (bicubic) to the first frame's size on the ``factor``-px grid (the family layout's
    cell side); an odd count repeats the last frame."""
    if not frames:
        raise BadSample("video_empty", "no frames")
    for frame in frames:
        if min(frame.size) < MIN_SIDE:
            raise BadSample("image_too_small", f"{frame.width}x{frame.height} (sides under {MIN_SIDE} px)")
    height, width = smart_resize(frames[0].height, frames[0].width, min_pixels, max_pixels, factor)
    fitted = []
    for frame in frames:
        rgb = to_rgb(frame)
        if rgb.size != (width, height):
            rgb = rgb.resize((width, height), Image.Resampling.BICUBIC)
        fitted.append(rgb)
    if len(fitted) % TEMPORAL_PATCH_SIZE:
        fitted.extend([fitted[-1]] * (TEMPORAL_PATCH_SIZE - len(fitted) % TEMPORAL_PATCH_SIZE))
    return fitted


def video_tokens(frames: Sequence[Image.Image], factor: int) -> int:
    """Vision tokens of frames fitted on the ``factor``-px grid: (frames / 2) * (height / factor) * (width / factor)."""
    if not frames:
        return 0
    return math.ceil(len(frames) / TEMPORAL_PATCH_SIZE) * (frames[0].height // factor) * (frames[0].width // factor)
