"""The built-in synthetic verifiable task: questions about coloured shapes drawn with PIL.

Three image question types, equally frequent, each with exactly balanced answers
(so the best constant answer scores 1/K within a type); ``synthetic:shapes/colour``
(or ``shapes/count+largest``) keeps a subset (the grammar: :func:`easytrain.config.data_spec.parse_task`):

- count:   "How many red circles are there?"          answer 1..4
- largest: "Which shape is the largest?"               circle | square | triangle
- colour:  "What colour is the square?"                red | green | blue | yellow

one question meant for a tool, asked only when named (``synthetic:shapes/dot``,
``+exp=tiny_tools``):

- dot:     "What colour is the dot?"                   red | green | blue | yellow
  (a 5x5 px square on 112x112 px of white: too little of the image for the tiny model
  to read its colour; the built-in tool :func:`easytrain.tools.shapes.zoom` returns it
  enlarged. Its rows also hold ``messages``, the conversation that calls the tool and
  answers from its image, and ``conversation_images`` (the prompt's image, then the
  tool's): what an SFT warm start teaches before RL with the tool)

and one video question, asked only when named (``synthetic:shapes/motion``, read with
``data.video_key=videos``):

- motion:  "Which way does the pattern move?"          left | right
  (4 frames of 112x56 px: a grey ramp, white to black every 224 px, slides 40 px a
  frame; its phase is uniform, so no single frame tells the direction, only the
  frames' order. A sliding pattern rather than a small moving shape: the tiny model
  learns a change spread over the whole frame, not where a small shape is)

``difficulty`` adds distractor shapes and grows the canvas; at 0 the colour
question's one shape is drawn large (radius 26-34 px of 112), so its colour is
what the image mostly shows (a tiny random model learns it reliably). The text-only
variant describes the same scene in words instead of showing it, for text
models. Splits are generated deterministically from (seed, split) and written
to parquet in the geometry3k schema (``images`` as a list of
``{"bytes", "path"}``, ``problem`` with an ``<image>`` placeholder,
``answer``; ``videos`` as a list of frame lists), so they go through the same loader as real data.
"""

from __future__ import annotations

import io
import json
import os
import random
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
from PIL import Image, ImageDraw

from easytrain.config.data_spec import QUESTION_TYPES, parse_task
from easytrain.data.prompts import IMAGE_PLACEHOLDER
from easytrain.tools.calls import CALL_END, CALL_START
from easytrain.tools.shapes import zoom

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
COUNTS = ("1", "2", "3", "4")
INSTRUCTION = " Put the final answer in \\boxed{}."
VERSION = 4
MOTION_SIZE = (112, 56)
MOTION_FRAMES = 4
MOTION_STEP = 40
"""Pixels the pattern moves between frames."""
MOTION_PERIOD = 224
"""Pixels of one ramp of the sliding pattern (twice the frame's width)."""


@dataclass
class Item:
    shape: str
    colour: str
    size: int
    x: int = 0
    y: int = 0


def _classes(kind: str) -> tuple[str, ...]:
    return {"count": COUNTS, "largest": SHAPES, "colour": tuple(COLOURS), "motion": ("left", "right"),
            "dot": tuple(COLOURS)}[kind]


def tool_conversation(question: str, answer: str, reply: str) -> list[dict[str, str]]:
    """The turns of a question answered with the zoom tool: the call (the Hermes tool-call format), the tool's turn (its image,
    then ``reply``, its text), the boxed answer."""
    call = f'{CALL_START}\n{json.dumps({"name": "zoom", "arguments": {}})}\n{CALL_END}'
    return [{"role": "user", "content": question}, {"role": "assistant", "content": call},
            {"role": "tool", "content": f"{IMAGE_PLACEHOLDER}{reply}"},
            {"role": "assistant", "content": f"\\boxed{{{answer}}}"}]


def _png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _motion(answer: str, rng: random.Random) -> tuple[list[bytes], str]:
    """Frames of a grey ramp sliding ``answer`` (left or right), and the question. The ramp darkens from white to
    black over MOTION_PERIOD px, then starts again (a sawtooth); its phase is uniform over the period, so every
    single frame is drawn from the same distribution whichever way it moves: only the frames' order tells."""
    width, height = MOTION_SIZE
    phase = rng.randrange(MOTION_PERIOD)
    sign = 1 if answer == "right" else -1
    frames = []
    for k in range(MOTION_FRAMES):
        v = ((np.arange(width) - sign * MOTION_STEP * k + phase) % MOTION_PERIOD) / MOTION_PERIOD
        row = np.repeat((255.0 * (1 - v)).round().astype(np.uint8)[:, None], 3, axis=1)
        frames.append(_png(Image.fromarray(np.repeat(row[None], height, 0))))
    return frames, "Which way does the pattern move: left or right?"


def _scene(kind: str, answer: str, rng: random.Random, difficulty: int) -> tuple[list[Item], str]:
    """Shapes whose truthful answer to the question of ``kind`` is ``answer``, and the question."""
    extra = difficulty
    if kind == "dot":
        return [Item("square", answer, 2)], "What colour is the dot? Zoom in with the zoom tool."
    if kind == "count":
        shape, colour = rng.choice(SHAPES), rng.choice(list(COLOURS))
        items = [Item(shape, colour, rng.randint(10, 18)) for _ in range(int(answer))]
        others = [(s, c) for s in SHAPES for c in COLOURS if (s, c) != (shape, colour)]
        items += [Item(*rng.choice(others), rng.randint(10, 18)) for _ in range(extra)]
        return items, f"How many {colour} {shape}s are there?"
    if kind == "largest":
        colours = list(COLOURS)
        big = Item(answer, rng.choice(colours), rng.randint(26, 32))
        small = [Item(s, rng.choice(colours), rng.randint(9, 16))
                 for s in [s for s in SHAPES if s != answer] + [rng.choice(SHAPES) for _ in range(extra)]]
        return [big, *small], "Which shape is the largest: circle, square or triangle?"
    shape = rng.choice(SHAPES)
    # alone on the canvas (difficulty 0) the shape is drawn large: its colour is the image's main signal
    target = Item(shape, answer, rng.randint(26, 34) if difficulty == 0 else rng.randint(14, 22))
    others = [Item(rng.choice([s for s in SHAPES if s != shape]), rng.choice(list(COLOURS)), rng.randint(10, 18))
              for _ in range(extra)]
    return [target, *others], f"What colour is the {shape}?"


def _place(items: list[Item], side: int, rng: random.Random) -> None:
    """Positions without overlap (rejection sampling; shrinks a shape if the canvas is crowded)."""
    placed: list[Item] = []
    for item in items:
        for attempt in range(200):
            r = item.size
            item.x, item.y = rng.randint(r + 2, side - r - 2), rng.randint(r + 2, side - r - 2)
            if all((item.x - o.x) ** 2 + (item.y - o.y) ** 2 > (r + o.size + 3) ** 2 for o in placed):
                break
            if attempt % 50 == 49:
                item.size = max(6, item.size - 2)
        placed.append(item)


def _draw(items: list[Item], side: int) -> bytes:
    return _png(_render(items, (side, side)))


def _render(items: list[Item], size: tuple[int, int]) -> Image.Image:
    image = Image.new("RGB", size, (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for it in items:
        colour, r = COLOURS[it.colour], it.size
        if it.shape == "circle":
            draw.ellipse([it.x - r, it.y - r, it.x + r, it.y + r], fill=colour)
        elif it.shape == "square":
            draw.rectangle([it.x - r, it.y - r, it.x + r, it.y + r], fill=colour)
        else:
            draw.polygon([(it.x, it.y - r), (it.x - r, it.y + r), (it.x + r, it.y + r)], fill=colour)
    return image


def _describe(items: list[Item], rng: random.Random) -> str:
    shuffled = items[:]
    rng.shuffle(shuffled)
    return "The picture shows " + "; ".join(f"a {i.colour} {i.shape} of size {i.size}" for i in shuffled) + "."


def generate(size: int, seed: int, split: str = "train", difficulty: int = 1, text_only: bool = False,
             types: tuple[str, ...] = QUESTION_TYPES) -> list[dict[str, Any]]:
    """Rows of the shapes task, deterministic in (size, seed, split, difficulty, text_only, types)."""
    rng = random.Random(f"shapes/{seed}/{split}/{difficulty}/{'+'.join(types)}")
    side = 112 + 28 * max(0, difficulty - 1)
    plan = []
    for i in range(size):
        kind = types[i % len(types)]
        classes = _classes(kind)
        plan.append((kind, classes[(i // len(types)) % len(classes)]))
    rng.shuffle(plan)
    rows = []
    for kind, answer in plan:
        if kind == "motion":  # a video question (text-only: the video's frames have no words)
            frames, question = _motion(answer, rng)
            rows.append({"images": [], "videos": [[{"bytes": f, "path": None} for f in frames]],
                         "problem": f"<video>{question}{INSTRUCTION}", "answer": answer, "question_type": kind})
            continue
        items, question = _scene(kind, answer, rng, difficulty)
        _place(items, side, rng)
        if text_only:
            rows.append({"images": [], "videos": [], "problem": f"{_describe(items, rng)} {question}{INSTRUCTION}",
                         "answer": answer, "question_type": kind})
        else:
            rows.append({"images": [{"bytes": _draw(items, side), "path": None}], "videos": [],
                         "problem": f"<image>{question}{INSTRUCTION}", "answer": answer, "question_type": kind})
            if kind == "dot":
                image = Image.open(io.BytesIO(rows[-1]["images"][0]["bytes"]))
                zoomed, reply = zoom([image])
                rows[-1]["messages"] = tool_conversation(rows[-1]["problem"], answer, reply)
                rows[-1]["conversation_images"] = [rows[-1]["images"][0], {"bytes": _png(zoomed), "path": None}]
    return rows


def write_parquet(rows: list[dict[str, Any]], path: Path) -> None:
    """Write rows in the geometry3k schema (images as list<struct<bytes, path>>), atomically."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    image = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    schema = pa.schema([("images", pa.list_(image)), ("videos", pa.list_(pa.list_(image))),
                        ("problem", pa.string()), ("answer", pa.string()), ("question_type", pa.string())])
    if any("messages" in r for r in rows):  # conversations (tool questions): a column of their own
        turn = pa.struct([("role", pa.string()), ("content", pa.string())])
        schema = schema.append(pa.field("messages", pa.list_(turn)))
        schema = schema.append(pa.field("conversation_images", pa.list_(image)))
    table = pa.Table.from_pylist(rows, schema=schema)
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def ensure_synthetic(task: str, split: str, size: int, seed: int, difficulty: int = 1,
                     text_only: bool = False, cache_dir: Optional[str] = None) -> Path:
    """Path of the task's parquet for this split, generated on first use."""
    types = parse_task(task)
    root = Path(os.path.expanduser(cache_dir or "~/.cache/easytrain")) / "synthetic"
    root.mkdir(parents=True, exist_ok=True)
    variant = "-text" if text_only else ""
    path = root / f"shapes-{'+'.join(types)}{variant}-{split}-n{size}-seed{seed}-d{difficulty}-v{VERSION}.parquet"
    if not path.is_file():
        write_parquet(generate(size, seed, split, difficulty, text_only, types), path)
    return path
