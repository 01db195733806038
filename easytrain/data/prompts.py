"""Turning a row's text and images into the exact prompt the model sees.

One function, :func:`render_prompt`, produces both forms from one chat
template call: the vLLM form keeps one ``<|image_pad|>`` per image (vLLM
expands it itself from the image), the HF form expands each to the image's
vision-token count. The HF form's token ids therefore hold exactly as many
image tokens as the vision tower will produce features: a mismatch cannot be
built.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from easytrain.data.images import BadSample
from easytrain.data.vision import Layout

IMAGE_PLACEHOLDER = "<image>"
"""How datasets (geometry3k and most RL sets) mark where an image goes in the prompt text."""
VIDEO_PLACEHOLDER = "<video>"
"""And where a video goes."""


def load_format_template(path: Optional[str]) -> Optional[Any]:
    """The Jinja template of ``data.format_prompt`` (it receives the prompt text as ``content``)."""
    if path is None:
        return None
    import jinja2

    with open(path, encoding="utf-8") as f:
        return jinja2.Template(f.read())


def build_messages(problem: str, num_images: int, num_videos: int = 0) -> list[dict[str, Any]]:
    """A one-turn chat: the text split at ``<image>`` / ``<video>`` placeholders, images and videos interleaved.

    Without placeholders the images, then the videos, go first (the usual layout for VLM data); with
    placeholders their counts must equal the number of images and of videos.
    """
    pieces = re.split(f"({re.escape(IMAGE_PLACEHOLDER)}|{re.escape(VIDEO_PLACEHOLDER)})", problem)
    marks = pieces[1::2]
    if not marks:
        content = ([{"type": "image"} for _ in range(num_images)] + [{"type": "video"} for _ in range(num_videos)]
                   + [{"type": "text", "text": problem}])
        return [{"role": "user", "content": content}]
    for mark, count, kind in ((IMAGE_PLACEHOLDER, num_images, "images"), (VIDEO_PLACEHOLDER, num_videos, "videos")):
        if marks.count(mark) != count:
            raise BadSample("placeholder_mismatch", f"{marks.count(mark)} {mark} placeholders but {count} {kind}")
    content: list[dict[str, Any]] = []
    for i, piece in enumerate(pieces):
        if i % 2:
            content.append({"type": "image" if piece == IMAGE_PLACEHOLDER else "video"})
        elif piece:
            content.append({"type": "text", "text": piece})
    return [{"role": "user", "content": content}]


DEFAULT_LAYOUT = Layout()


@dataclass
class RenderedPrompt:
    vllm_text: str
    """Chat-templated text with one <|image_pad|> per image (vLLM expands it)."""
    input_ids: list[int]
    """Token ids with each image's placeholder expanded to its vision-token count (the HF form)."""
    image_tokens: list[int]
    """Vision tokens per image."""


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]], image_tokens: Sequence[int],
                  tools: Optional[Sequence[dict[str, Any]]] = None,
                  video_tokens: Sequence[int] = (), layout: Layout = DEFAULT_LAYOUT) -> RenderedPrompt:
    """Apply the chat template once and derive the vLLM and HF forms from it. ``tools``: the JSON schemas of
    the tools a multi-turn rollout may call, which the template shows the model (ChatML templates: in the system turn).
    ``video_tokens``: vision tokens per video, expanded like the images'."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **({"tools": list(tools)} if tools else {}))
    for pad, counts, kind in ((layout.image_pad, image_tokens, "image"), (layout.video_pad, video_tokens, "video")):
        if text.count(pad) != len(counts):
            raise BadSample("placeholder_mismatch",
                            f"the chat template wrote {text.count(pad)} {kind} slots for {len(counts)} {kind}s")
    ids = tokenizer(layout.expand(text, image_tokens, video_tokens), add_special_tokens=False)["input_ids"]
    return RenderedPrompt(vllm_text=text, input_ids=list(ids), image_tokens=list(image_tokens))
