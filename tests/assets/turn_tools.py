"""Tools for the multi-turn tests (tests/test_multi_turn.py)."""

import time


def count(colour: str) -> str:
    """Count the shapes of one colour in the image.

    Args:
        colour: the colour to count, e.g. red.
    """
    return {"red": "3", "blue": "1"}.get(colour, "0")


def hang(seconds: float = 3600.0) -> str:
    """Never answers in time."""
    time.sleep(seconds)
    return "late"


def paint(colour: str):
    """Show a square of one colour.

    Args:
        colour: red or blue.
    """
    import os

    from PIL import Image

    rgb = {"red": (220, 30, 30), "blue": (30, 30, 220)}[colour]
    if os.environ.get("TURN_TOOLS_INVERT") == "1":  # the same call answered with another image (a test's switch)
        rgb = tuple(255 - c for c in rgb)
    return [Image.new("RGB", (56, 56), rgb), f"a {colour} square"]


def size(images: list) -> str:
    """The size of the sample's first image (easytrain passes the sample's images)."""
    return "x".join(map(str, images[0].size)) if images else "no image"


def three() -> str:
    """Always 3 (a call short enough for a small context)."""
    return "3"
