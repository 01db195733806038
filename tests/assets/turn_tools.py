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
