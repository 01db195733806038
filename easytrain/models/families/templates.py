"""The chat templates the families' tiny tokenizers share: ChatML turns, each family writing its own image (and
video) placeholder into them (Qwen-VL's vision pads, InternVL's context token, Gemma 3's start-of-image)."""

from __future__ import annotations

CHATML_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
"""The turns' special tokens (pad, turn start, end of turn and eos)."""


def chatml_template(image: str, video: str = "", system: bool = True) -> str:
    """A ChatML chat template (the tiny tokenizers' turns) that writes ``image`` (``video``) for an image (video)
    part of a message's content list; ``system``: a default system turn first. No whitespace control: the string
    holds no incidental whitespace."""
    default_system = ("{% if loop.first and message['role'] != 'system' %}"
                      "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                      "{% endif %}") if system else ""
    video_part = f"{{% elif part['type'] == 'video' %}}{video}" if video else ""
    return (
        "{% for message in messages %}"
        + default_system
        + "<|im_start|>{{ message['role'] }}\n"
        "{% if message['content'] is string %}{{ message['content'] }}"
        "{% else %}{% for part in message['content'] %}"
        f"{{% if part['type'] == 'image' %}}{image}"
        + video_part
        + "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
        "{% endfor %}{% endif %}"
        "<|im_end|>\n"
        "{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
