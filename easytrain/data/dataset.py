"""Prompt datasets: rows checked once before training, then served as ready prompts.

Building a :class:`PromptDataset` reads every row once (with a progress bar):
images decoded and sized, prompts templated and counted. Rows that cannot be
used are skipped with one warning line naming the row and the reason and
counted by reason in :attr:`PromptDataset.skips` (written to the run folder
by :meth:`PromptDataset.write_skip_report`). A prompt whose text plus image
tokens exceed ``data.max_prompt_length`` is skipped, or, with
``data.downscale_images_to_fit``, its images are shrunk until it fits.
"""

from __future__ import annotations

import json
import logging
import os
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from PIL import Image
from tqdm import tqdm

from easytrain.config.schema import DataConfig
from easytrain.data.images import BadSample, ImageFiles, decode_image, fit_image
from easytrain.data.profile import Longest, RowCost, Rules, downscale_share, row_cost
from easytrain.data.prompts import DEFAULT_LAYOUT, build_messages, load_format_template, render_prompt
from easytrain.data.sources import DataError, RowSource, open_source, require_columns
from easytrain.data.video import Clip, decode_video, fit_video, video_tokens
from easytrain.data.vision import Layout

logger = logging.getLogger(__name__)


@dataclass
class Prompt:
    """One usable prompt, ready for either engine."""

    uid: str
    """``<file>#<row>``: stable across runs, used in logs and to group a prompt's responses."""
    input_ids: list[int]
    vllm_text: str
    images: list[Image.Image]
    """RGB images already sized onto the token grid."""
    image_tokens: list[int]
    answer: str
    downscaled: bool = False
    """Images were shrunk below data.max_pixels to fit data.max_prompt_length."""
    videos: list[Clip] = field(default_factory=list)
    """Videos (data.video_key): frames sized onto the token grid, and their rate."""
    sizes: list[tuple[int, int]] = field(default_factory=list)
    """Each image's (height, width) as decoded, before the resize rules."""
    video_tokens: int = 0
    """The videos' tokens in ``input_ids``."""


@dataclass
class SkipReport:
    """Rows seen and skipped, by reason."""

    split: str
    rows: int = 0
    kept: int = 0
    downscaled: int = 0
    reasons: Counter = field(default_factory=Counter)

    def as_dict(self) -> dict[str, Any]:
        return {"split": self.split, "rows": self.rows, "kept": self.kept, "downscaled": self.downscaled,
                "skipped": dict(sorted(self.reasons.items()))}


def _text(value: Any, what: str) -> str:
    if isinstance(value, bytes):
        try:
            value = value.decode("utf-8")
        except UnicodeDecodeError as err:
            raise BadSample("bad_text", f"{what} is not UTF-8") from err
    if value is None or (isinstance(value, float) and value != value):  # None or NaN
        raise BadSample("missing_answer" if what == "answer" else "empty_prompt", f"{what} is missing")
    if not isinstance(value, str):
        if what == "answer" and isinstance(value, (int, float, list)):
            return json.dumps(value) if isinstance(value, list) else str(value)
        raise BadSample("bad_text", f"{what} is a {type(value).__name__}, not text")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise BadSample("bad_text", f"{what} holds characters that are not valid UTF-8") from err
    if not value.strip():
        raise BadSample("missing_answer" if what == "answer" else "empty_prompt", f"{what} is empty")
    return value


class PromptDataset:
    """Usable prompts of ``files``, for one split."""

    def __init__(self, files: Sequence[str], cfg: DataConfig, tokenizer: Any, split: str = "train",
                 seed: int = 0, vision: bool = True, cache_dir: Optional[str] = None, progress: bool = True,
                 tools: Sequence[dict[str, Any]] = (), layout: Layout = DEFAULT_LAYOUT, scan: bool = True) -> None:
        """``scan=False``: open the sources and check their columns only (a data profile reads a sample of the
        rows itself, through :meth:`build`); such a dataset serves no rows."""
        self.cfg, self.tokenizer, self.split = cfg, tokenizer, split
        self.layout = layout
        """How the model's family sizes images and writes their placeholders (its adapter's)."""
        self.tools = list(tools)
        """JSON schemas of the tools the prompts show (worker.rollout.multi_turn); empty: none."""
        self.image_key = cfg.image_key if vision else None
        self.template = load_format_template(cfg.format_prompt)
        size = cfg.synthetic_size if split == "train" else cfg.synthetic_val_size
        self.sources: list[RowSource] = []
        self.image_files: list[ImageFiles] = []
        """Per source: where its image paths resolve and which files they may read."""
        for spec in files:
            source = open_source(spec, cache_dir=cache_dir, seed=seed, split=split, text_only=not self.image_key,
                                 synthetic_size=size, difficulty=cfg.synthetic_difficulty)
            self._check_columns(source)
            self.sources.append(source)
            self.image_files.append(ImageFiles(cfg.image_dir, cfg.allow_outside_image_dir, source.image_roots))
        self.skips = SkipReport(split)
        self._index: list[tuple[int, int]] = []
        self.prompt_lengths: list[int] = []
        self.longest = Longest()
        """The largest prompt, image count and vision tokens of the kept rows (the in-run plan check prices them)."""
        self.vision_tokens: list[int] = []
        """Each kept row's vision tokens (the plan prices a step batch's pixels on its costliest rows)."""
        if scan:
            self._scan(progress)

    def _check_columns(self, source: RowSource) -> None:
        require_columns(source, [("data.prompt_key", self.cfg.prompt_key), ("data.answer_key", self.cfg.answer_key),
                                 *self._visual_columns()])

    def _visual_columns(self) -> list[tuple[str, Optional[str]]]:
        """The image and video columns a source must have: with data.video_key, the video column (video data
        need not have an image column too)."""
        if self.image_key and self.cfg.video_key:
            return [("data.video_key", self.cfg.video_key)]
        return [("data.image_key", self.image_key)]

    def _scan(self, progress: bool) -> None:
        total = sum(len(s) for s in self.sources)
        bar = tqdm(total=total, desc=f"checking {self.split} data", unit="row", disable=not progress)
        for s, source in enumerate(self.sources):
            for r in range(len(source)):
                self.skips.rows += 1
                try:
                    prompt = self.build(s, r)
                except BadSample as bad:
                    self.skips.reasons[bad.reason] += 1
                    logger.warning("data: skipped %s row %d: %s", source.name, r, bad)
                else:
                    self._index.append((s, r))
                    self.prompt_lengths.append(len(prompt.input_ids))
                    cost = row_cost(prompt)
                    self.longest = self.longest.add(cost)
                    self.vision_tokens.append(cost.vision_tokens)
                    self.skips.downscaled += prompt.downscaled
                bar.update(1)
        bar.close()
        self.skips.kept = len(self._index)
        if not self._index:
            raise DataError(f"no usable rows in {', '.join(s.name for s in self.sources)} "
                            f"({self.split}): skipped {dict(self.skips.reasons)}")
        if self.skips.reasons:
            logger.warning("data (%s): kept %d of %d rows; skipped %s", self.split, self.skips.kept,
                           self.skips.rows, dict(self.skips.reasons))

    def __len__(self) -> int:
        return len(self._index)

    def rules(self) -> Rules:
        """The limits and the grid this dataset reads its rows by."""
        return Rules.of(self.cfg, self.layout)

    def __getitem__(self, index: int) -> Prompt:
        s, r = self._index[index]
        return self.build(s, r)

    def _row(self, s: int, r: int) -> tuple[dict[str, Any], str]:
        """Row ``r`` of source ``s`` and where it is (``<file>#<row>``); an unreadable row raises its BadSample."""
        source = self.sources[s]
        row = source[r]
        if isinstance(row, BadSample):
            raise row
        return row, f"{source.name}#{r}"

    def build(self, s: int, r: int) -> Prompt:
        """Row ``r`` of source ``s`` as a prompt, by the training rules; a row that cannot be used raises its
        :class:`BadSample`."""
        cfg = self.cfg
        row, where = self._row(s, r)
        problem = _text(row.get(cfg.prompt_key), "prompt")
        answer = _text(row.get(cfg.answer_key), "answer")
        if self.template is not None:
            problem = self.template.render(content=problem)
        decoded = self._decoded_images(s, row, where)
        images = self.fit(decoded, cfg.min_pixels, cfg.max_pixels)
        videos = self._videos(s, row, where)
        messages = build_messages(problem, len(images), len(videos))
        frames = [video_tokens(v.frames, self.layout.factor) for v in videos]
        rendered = render_prompt(self.tokenizer, messages, self.image_tokens(images), self.tools, frames, self.layout)
        downscaled = len(rendered.input_ids) > cfg.max_prompt_length
        if downscaled:
            full = RowCost(where, tuple((im.height, im.width) for im in decoded), tuple(rendered.image_tokens),
                           sum(frames), len(rendered.input_ids), 0)
            if not (cfg.downscale_images_to_fit and images):
                raise BadSample("prompt_too_long", f"{len(rendered.input_ids)} tokens > "
                                f"data.max_prompt_length={cfg.max_prompt_length}"
                                + (f" ({sum(frames)} of them video)" if videos else ""), len(rendered.input_ids), full)
            images, rendered = self._downscale(decoded, messages, rendered, frames, full)
        return Prompt(uid=where, input_ids=rendered.input_ids, vllm_text=rendered.vllm_text, images=images,
                      image_tokens=rendered.image_tokens, answer=answer,
                      downscaled=downscaled, videos=videos, sizes=[(im.height, im.width) for im in decoded],
                      video_tokens=sum(frames))

    def _videos(self, s: int, row: dict[str, Any], where: str) -> list[Clip]:
        """The row's videos (data.video_key): decoded, sampled, sized; blanked when data.blank_images."""
        cfg = self.cfg
        value = row.get(cfg.video_key) if cfg.video_key and self.image_key else None
        if value is None:
            return []
        values = list(value) if isinstance(value, (list, tuple)) else [value]  # a list of videos, or one file
        if len(values) > cfg.limit_videos:
            raise BadSample("too_many_videos", f"{len(values)} videos > data.limit_videos={cfg.limit_videos}",
                            len(values))
        clips = []
        for i, v in enumerate(values):
            frames, fps = decode_video(v, self.image_files[s], f"{where} video {i}", cfg.video_fps, cfg.max_frames)
            if cfg.blank_images:
                frames = [Image.new("RGB", f.size, (255, 255, 255)) for f in frames]
            clips.append(Clip(fit_video(frames, cfg.min_pixels, cfg.max_pixels, self.layout.factor), fps))
        return clips

    def fit(self, decoded: Sequence[Image.Image], min_pixels: int, max_pixels: int) -> list[Image.Image]:
        """Images resized onto the family's grid within [min_pixels, max_pixels]."""
        if self.layout.fixed_size:
            side = self.layout.factor
            return [fit_image(im, side * side, side * side, side).resize((side, side), Image.Resampling.BICUBIC)
                    for im in decoded]
        return [fit_image(im, min_pixels, max_pixels, self.layout.factor) for im in decoded]

    def image_tokens(self, images: Sequence[Image.Image]) -> list[int]:
        return [self.layout.image_tokens(im.height, im.width) for im in images]

    def _decoded_images(self, s: int, row: dict[str, Any], where: str) -> list[Image.Image]:
        """The row's images (of source ``s``), decoded to RGB (blanked to white when data.blank_images)."""
        decoded = [decode_image(v, self.image_files[s], f"{where} image {i}")
                   for i, v in enumerate(self._raw_images(row))]
        if self.cfg.blank_images:
            decoded = [Image.new("RGB", im.size, (255, 255, 255)) for im in decoded]
        return decoded

    def _raw_images(self, row: dict[str, Any]) -> list[Any]:
        if not self.image_key:
            return []
        value = row.get(self.image_key)
        if value is None:
            return []
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        if len(values) > self.cfg.limit_images:
            raise BadSample("too_many_images", f"{len(values)} images > data.limit_images={self.cfg.limit_images}",
                            len(values))
        return values

    def _downscale(self, decoded: list[Image.Image], messages: list[dict[str, Any]], rendered: Any,
                   frames: Sequence[int], full: RowCost) -> tuple:
        """Shrink every image to an equal share of the tokens the text (and the videos) leave free (``full``: the
        row at full size)."""
        text_tokens = len(rendered.input_ids) - sum(rendered.image_tokens)
        share = downscale_share(self.cfg.max_prompt_length, text_tokens, len(decoded))
        if share < 1:
            raise BadSample("prompt_too_long", f"the text alone takes {text_tokens} tokens "
                            f"of data.max_prompt_length={self.cfg.max_prompt_length}", len(rendered.input_ids), full)
        max_pixels = self.layout.pixels_for(share)
        min_pixels = min(self.cfg.min_pixels, max_pixels)
        images = self.fit(decoded, min_pixels, max_pixels)
        rendered = render_prompt(self.tokenizer, messages, self.image_tokens(images), self.tools, frames, self.layout)
        return images, rendered

    def write_skip_report(self, folder: str | Path) -> Path:
        """Append this split's counts to ``<folder>/data_report.json``."""
        path = Path(folder) / "data_report.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        report = json.loads(path.read_text()) if path.is_file() else {}
        report[self.split] = self.skips.as_dict()
        # written aside and renamed: a process reading it meanwhile (ranks of a run share the folder) sees the
        # whole old report or the whole new one, never half a file
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        os.replace(tmp, path)
        return path
