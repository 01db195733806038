"""A stand-in for geometry3k's rows, for pricing EasyR1's recipe on data shaped like its own (issue 50).

Neither geometry3k nor Qwen2.5-VL-7B's tokenizer is on this machine, so the profile is built from documented
sizes instead of read:

- **Images.** ``bench/data/geometry3k_extents.csv``: for each Geometry3K diagram that InterGPS labelled for its
  symbol detector (lupantech/InterGPS, ``diagram_parser/detection/geometry_labels.csv`` and
  ``geometry_labels_val.csv``, one bounding box per text label or symbol), the largest right and bottom edges of
  its boxes. A diagram's labels sit at its vertices and sides, so these extents are close to the image's size
  and never above it: the stand-in's images are each at least as small as the real one, and the plan priced
  on them a lower bound of the one priced on the real images (the margin beyond the outermost label is not
  known). Each labelled diagram is one row with one image, sized (height, width) = (max bottom, max right).
  Under EasyR1's recipe (``data.min_pixels=262144``) 95% of these extents are below 512 x 512 px and are raised
  to it, as the real images would be: the unknown margin moves only the larger diagrams' cost.
- **Text.** :data:`TEXT_TOKENS` per prompt besides the image: Qwen2.5's chat template with its default system
  prompt (~20 tokens), a geometry3k problem with its answer choices (one or two sentences) and EasyR1's
  ``math.jinja`` format instruction (~45 tokens). An estimate, not a count: the real tokenizer is not here.
  :data:`TEXT_SENSITIVITY` re-plans at other values to show how much the result leans on it.

The rows are priced under each config's limits by :func:`easytrain.data.profile.reprice`, as the dataset
prices rows it has read (the 28-px grid of Qwen2.5-VL, ``data.max_pixels`` and ``min_pixels``).
"""

from __future__ import annotations

import csv
from dataclasses import replace
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXTENTS = ROOT / "bench" / "data" / "geometry3k_extents.csv"
SOURCE = ("lupantech/InterGPS diagram_parser/detection/geometry_labels.csv and geometry_labels_val.csv "
          "(commit d9d2c4cc91079c4449297fa4e22b91f230e09b4d): per labelled Geometry3K diagram, the largest right and "
          "bottom edges of its symbol and text boxes")
TEXT_TOKENS = 150
"""Tokens of a prompt besides its image: template, problem with choices, format instruction (an estimate)."""
TEXT_SENSITIVITY = (100, 300)


def extents() -> list[tuple[str, int, int]]:
    """(diagram, height, width) per labelled diagram."""
    with EXTENTS.open() as f:
        return [(row["image"], int(row["max_y2"]), int(row["max_x2"])) for row in csv.DictReader(f)]


def standin_costs(config: Any, text_tokens: int = TEXT_TOKENS) -> Any:
    """The stand-in's rows as the data profiles of the train and validation splits (the recipe validates on
    geometry3k's test split, the same kind of diagrams), read by ``config``'s limits on its family's grid
    (:class:`easytrain.memory.data_shape.DataCosts`). A validation call is priced at the recipe's
    ``data.val_batch_size`` (1024 prompts; the test split has 601 rows, which the plan cannot count for a hub
    dataset): on the safe side."""
    from easytrain.data.profile import DataProfile, RowCost, Rules, reprice
    from easytrain.memory.data_shape import DataCosts
    from easytrain.models.families import family_of
    from easytrain.models.shapes import hf_config_for

    rules = Rules.of(config.data, family_of(hf_config_for(config.model)).layout())
    costs, too_long = [], []
    for name, height, width in extents():
        bare = RowCost(where=name, sizes=((height, width),), image_tokens=(0,), video_tokens=0,
                       prompt_tokens=text_tokens, pixels=0)
        priced = reprice(bare, rules)
        if priced is None:
            too_long.append(bare)
            continue
        costs.append(RowCost(where=name, sizes=bare.sizes, image_tokens=(priced.image_tokens,), video_tokens=0,
                             prompt_tokens=priced.prompt, pixels=rules.layout.pixels_for(priced.image_tokens)))
    skipped = Counter({"prompt_too_long": len(too_long)} if too_long else {})
    train = DataProfile("train", len(costs) + len(too_long), rules, costs, too_long, skipped)
    return DataCosts.of([train, replace(train, split="val")])


def shape_summary(costs: Any) -> dict[str, Any]:
    """The stand-in's vision tokens and sizes, as the profile states them."""
    profile = costs.profiles[0]
    return {"source": SOURCE, "diagrams": profile.rows, "text_tokens_assumed": TEXT_TOKENS, **profile.stats()}
