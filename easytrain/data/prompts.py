"""Turning a row's text and images into the exact prompt the model sees.

One function, :func:`render_prompt`, produces both forms from one chat
template call: the vLLM form keeps one ``<|image_pad|>`` per image (vLLM
expands it itself from the image), the HF form expands each to the image's
vision-token count. The HF form's token ids therefore hold exactly as many
image tokens as the vision tower will produce features: a mismatch cannot be
built.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from easytrain.data.images import BadSample
from easytrain.data.vision import IMAGE_PAD, expand_image_placeholders

IMAGE_PLACEHOLDER = "<image>"
"""How datasets (geometry3k and most RL sets) mark where an image goes in the prompt text."""


def load_format_template(path: Optional[str]) -> Optional[Any]:
    """The Jinja template of ``data.format_prompt`` (it receives the prompt text as ``content``)."""
    if path is None:
        return None
    import jinja2

    with open(path, encoding="utf-8") as f:
        return jinja2.Template(f.read())


def build_messages(problem: str, num_images: int) -> list[dict[str, Any]]:
    """A one-turn chat: the text split at ``<image>`` placeholders, images interleaved.

    Without placeholders the images go first (the usual layout for VLM data);
    with placeholders their count must equal the number of images.
    """
    pieces = problem.split(IMAGE_PLACEHOLDER)
    placeholders = len(pieces) - 1
    if placeholders == 0:
        content = [{"type": "image"} for _ in range(num_images)] + [{"type": "text", "text": problem}]
        return [{"role": "user", "content": content}]
    if placeholders != num_images:
        raise BadSample("placeholder_mismatch", f"{placeholders} <image> placeholders but {num_images} images")
    content: list[dict[str, Any]] = []
    for i, piece in enumerate(pieces):
        if piece:
            content.append({"type": "text", "text": piece})
        if i < num_images:
            content.append({"type": "image"})
    return [{"role": "user", "content": content}]


@dataclass
class RenderedPrompt:
    vllm_text: str
    """Chat-templated text with one <|image_pad|> per image (vLLM expands it)."""
    input_ids: list[int]
    """Token ids with each image's placeholder expanded to its vision-token count (the HF form)."""
    image_tokens: list[int]
    """Vision tokens per image."""


def render_prompt(tokenizer: Any, messages: list[dict[str, Any]], image_tokens: Sequence[int],
                  tools: Optional[Sequence[dict[str, Any]]] = None) -> RenderedPrompt:
    """Apply the chat template once and derive the vLLM and HF forms from it. ``tools``: the JSON schemas of
    the tools a multi-turn rollout may call, which the template shows the model (Qwen: in the system turn)."""
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         **({"tools": list(tools)} if tools else {}))
    if text.count(IMAGE_PAD) != len(image_tokens):
        raise BadSample("placeholder_mismatch",
                        f"the chat template wrote {text.count(IMAGE_PAD)} image slots for {len(image_tokens)} images")
    expanded = expand_image_placeholders(text, image_tokens)
    ids = tokenizer(expanded, add_special_tokens=False)["input_ids"]
    return RenderedPrompt(vllm_text=text, input_ids=list(ids), image_tokens=list(image_tokens))
