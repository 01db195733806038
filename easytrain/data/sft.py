"""Supervised fine-tuning data: conversations with images, trained on the assistant's tokens only.

Two row schemas are read:

- conversations: ``data.messages_key`` (default ``messages``) holds a list of
  ``{"role": system|user|assistant, "content": ...}`` turns, content a string
  with ``<image>`` marking where each image of ``data.image_key`` goes (or a
  list of ``{"type": "text"|"image"}`` parts); without any ``<image>`` the
  images go first in the first user turn;
- prompt/answer: ``data.prompt_key`` and ``data.answer_key`` become one user
  turn and one assistant turn (the RL datasets, e.g. geometry3k or the
  synthetic task, train as they are).

:func:`render_conversation` applies the chat template once per assistant turn
and keeps the pieces apart: the text up to and including each assistant
header is context (label -100), the assistant's words and its end-of-turn
token are trained. Each piece is tokenized on its own, as generation will see
it (the prompt with its generation header, then the response).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from easytrain.data.collate import Visuals, text_positions, vision_inputs
from easytrain.data.dataset import Prompt, PromptDataset, _text
from easytrain.data.images import BadSample
from easytrain.data.prompts import DEFAULT_LAYOUT, IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, build_messages
from easytrain.data.sources import DataError, RowSource, require_columns
from easytrain.data.video import Clip, video_tokens
from easytrain.data.vision import Layout


IGNORE = -100
"""Label of tokens that are not trained (and of padding)."""
ROLES = ("system", "user", "assistant", "tool")


@dataclass
class SFTSample(Prompt):
    """A prompt (the conversation up to its last assistant turn, for generation samples) plus the whole
    conversation's tokens and labels."""

    ids: list[int] = None  # type: ignore[assignment]
    """Tokens of the whole conversation, image placeholders expanded."""
    labels: list[int] = None  # type: ignore[assignment]
    """The token where it is trained (assistant turns), IGNORE elsewhere."""
    all_images: list[Any] = None  # type: ignore[assignment]
    """Every image of the conversation (``images`` holds those of the prompt part)."""
    all_videos: list[Clip] = field(default_factory=list)
    """Every video of the conversation (``videos`` holds those of the prompt part)."""


def conversation_turns(messages: Any, num_images: int, num_videos: int = 0) -> list[dict[str, Any]]:
    """Turns as chat-template messages (content parts, images and videos placed), checked."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise BadSample("bad_messages", "messages is not a non-empty list of turns")
    turns, placed, videos = [], 0, 0
    for i, turn in enumerate(messages):
        if not isinstance(turn, dict) or turn.get("role") not in ROLES:
            raise BadSample("bad_messages", f"turn {i} is not a {{role, content}} dict with role in {ROLES}")
        content = turn.get("content")
        if isinstance(content, (list, tuple)):
            if not all(isinstance(p, dict) and p.get("type") in ("text", "image", "video") for p in content):
                raise BadSample("bad_messages", f"turn {i}: content parts must be {{type: text|image|video}} dicts")
            parts = [dict(p) for p in content]
            placed += sum(p.get("type") == "image" for p in parts)
            videos += sum(p.get("type") == "video" for p in parts)
        else:
            text = _text(content, f"turn {i} content")
            placed += text.count(IMAGE_PLACEHOLDER)
            videos += text.count(VIDEO_PLACEHOLDER)
            parts = build_messages(text, text.count(IMAGE_PLACEHOLDER), text.count(VIDEO_PLACEHOLDER))[0]["content"]
        turns.append({"role": turn["role"], "content": parts})
    for kind, here, count in (("video", videos, num_videos), ("image", placed, num_images)):
        if here == 0 and count:  # images, then videos, first in the first user turn
            first_user = next((t for t in turns if t["role"] == "user"), None)
            if first_user is None:
                raise BadSample("placeholder_mismatch", f"{count} {kind}s but no user turn to put them in")
            first_user["content"] = [{"type": kind} for _ in range(count)] + first_user["content"]
        elif here != count:
            raise BadSample("placeholder_mismatch", f"{here} {kind} places in the turns but {count} {kind}s")
    if not any(t["role"] == "assistant" for t in turns):
        raise BadSample("no_assistant_turn", "the conversation has no assistant turn to train on")
    return turns


@dataclass
class RenderedConversation:
    ids: list[int]
    labels: list[int]
    prompt_len: int
    """Tokens before the last assistant turn's words (the prompt a generation sample starts from)."""
    prompt_text: str
    prompt_images: int
    """Images in the prompt part."""
    prompt_videos: int = 0
    """Videos in the prompt part."""


def render_conversation(tokenizer: Any, turns: list[dict[str, Any]], image_tokens: Sequence[int],
                        video_tokens: Sequence[int] = (), layout: Layout = DEFAULT_LAYOUT) -> RenderedConversation:
    """Token ids and labels of a conversation: assistant words and end-of-turn trained, the rest context."""
    pieces: list[tuple[str, bool]] = []
    done = ""
    for i, turn in enumerate(turns):
        if turn["role"] != "assistant":
            continue
        header = tokenizer.apply_chat_template(turns[:i], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(turns[:i + 1], tokenize=False)
        if not (header.startswith(done) and full.startswith(header)):
            raise DataError("the chat template of model.path (or model.tokenizer_path) does not render a "
                            "conversation as a growing prefix (each turn appended to the previous text); SFT labels "
                            "cannot be placed: use a tokenizer whose template appends turns")
        answer = full[len(header):]
        trained = answer.rstrip("\n")
        pieces += [(header[len(done):], False), (trained, True), (answer[len(trained):], False)]
        done = full
    last_full = tokenizer.apply_chat_template(turns, tokenize=False)
    pieces.append((last_full[len(done):], False))
    ids: list[int] = []
    labels: list[int] = []
    counts, frames = list(image_tokens), list(video_tokens)
    prompt_len, prompt_text, prompt_images, used, used_videos, prompt_videos = 0, "", 0, 0, 0, 0
    last_answer = max(i for i, (_, trained) in enumerate(pieces) if trained)
    for n, (text, trained) in enumerate(pieces):
        if not text:
            continue
        here, here_videos = text.count(layout.image_pad), text.count(layout.video_pad)
        if used + here > len(counts) or used_videos + here_videos > len(frames):
            break  # more slots than visuals: reported below
        piece = tokenizer(layout.expand(text, counts[used:used + here], frames[used_videos:used_videos + here_videos]),
                          add_special_tokens=False)["input_ids"]
        if n == last_answer:  # the last assistant turn: what came before is the prompt
            prompt_len, prompt_images, prompt_videos = len(ids), used, used_videos
            prompt_text = "".join(t for t, _ in pieces[:n])
        used += here
        used_videos += here_videos
        ids += piece
        labels += piece if trained else [IGNORE] * len(piece)
    for pad, count, kind in ((layout.image_pad, len(counts), "image"), (layout.video_pad, len(frames), "video")):
        slots = sum(text.count(pad) for text, _ in pieces)
        if slots != count:
            raise BadSample("placeholder_mismatch", f"the chat template wrote {slots} {kind} slots for {count} {kind}s")
    return RenderedConversation(ids, labels, prompt_len, prompt_text, prompt_images, prompt_videos)


class SFTDataset(PromptDataset):
    """Usable SFT samples of ``files`` for one split (checked once, skips reported like prompts)."""

    def _check_columns(self, source: RowSource) -> None:
        if self.cfg.messages_key in source.columns():
            require_columns(source, self._visual_columns())
        else:
            super()._check_columns(source)

    def build(self, s: int, r: int) -> SFTSample:
        cfg = self.cfg
        row, where = self._row(s, r)
        images = self.fit(self._decoded_images(s, row, where), cfg.min_pixels, cfg.max_pixels)
        videos = self._videos(s, row, where)
        frames = [video_tokens(v.frames, self.layout.factor) for v in videos]
        if cfg.messages_key in row:
            turns = conversation_turns(row[cfg.messages_key], len(images), len(videos))
        else:
            problem = _text(row.get(cfg.prompt_key), "prompt")
            if self.template is not None:
                problem = self.template.render(content=problem)
            answer = _text(row.get(cfg.answer_key), "answer")
            turns = build_messages(problem, len(images), len(videos)) + [{"role": "assistant",
                                                              "content": [{"type": "text", "text": answer}]}]
        rendered = render_conversation(self.tokenizer, turns, self.image_tokens(images), frames, self.layout)
        limit = cfg.max_prompt_length + cfg.max_response_length
        if len(rendered.ids) > limit:
            raise BadSample("too_long", f"{len(rendered.ids)} tokens > data.max_prompt_length + "
                            f"data.max_response_length = {limit}")
        last = next(t for t in reversed(turns) if t["role"] == "assistant")
        answer = "".join(p.get("text", "") for p in last["content"])
        prompt_images = images[:rendered.prompt_images]
        return SFTSample(uid=where, input_ids=rendered.ids[:rendered.prompt_len], vllm_text=rendered.prompt_text,
                         images=prompt_images, image_tokens=self.image_tokens(prompt_images),
                         answer=answer, ids=rendered.ids, labels=rendered.labels, all_images=images,
                         videos=videos[:rendered.prompt_videos], all_videos=videos)


@dataclass
class SFTCollator:
    """Right-padded conversations with their shifted targets (picklable: runs in loader processes).

    ``targets[t]`` is the label of token ``t + 1`` (IGNORE at each sample's last
    token and on padding), so a packed sequence never trains one sample's last
    token to predict the next sample's first.
    """

    pad_token_id: int
    visuals: Optional[Visuals] = None
    """The model family's vision inputs (see :class:`easytrain.data.collate.PromptCollator`)."""

    def __call__(self, samples: Sequence[SFTSample]) -> dict[str, Any]:
        longest = max(len(s.ids) for s in samples)
        shape = (len(samples), longest)
        input_ids = torch.full(shape, self.pad_token_id, dtype=torch.long)
        targets = torch.full(shape, IGNORE, dtype=torch.long)
        attention_mask = torch.zeros(shape, dtype=torch.long)
        for i, s in enumerate(samples):
            n = len(s.ids)
            input_ids[i, :n] = torch.tensor(s.ids)
            targets[i, :n - 1] = torch.tensor(s.labels[1:])
            attention_mask[i, :n] = 1
        batch: dict[str, Any] = {"input_ids": input_ids, "attention_mask": attention_mask, "targets": targets,
                                 "uids": [s.uid for s in samples], "images": [s.all_images for s in samples],
                                 "visual_counts": [len(s.all_images) + len(s.all_videos) for s in samples]}
        if self.visuals is None:
            batch["position_ids"] = text_positions(attention_mask)
            return batch
        batch.update(vision_inputs(self.visuals, input_ids, attention_mask, [s.all_images for s in samples],
                                   [s.all_videos for s in samples]))
        return batch

