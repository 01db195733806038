"""The tool process: loads the tools itself and runs one call at a time for :class:`~.runner.ToolRunner`.

It imports only the standard library and, to load the tools, ``easytrain.rewards.registry`` (pure Python);
never torch, Ray or the rest of easytrain. Results come back already turned into text and images, the text
cut to the size limit, so nothing large or unpicklable crosses the pipe.
"""

from __future__ import annotations

import json
import signal
import sys
from multiprocessing.connection import Connection
from typing import Any, Callable

Reply = tuple[Any, ...]
"""``("ok", text, images)`` or ``("error", one-line reason)``."""


def serve(conn: Connection, specs: dict[str, str], max_chars: int) -> None:
    """Load ``specs`` (tool name -> ``file.py:name`` / ``module:name``), say ready, then answer calls
    ``(name, arguments)`` until None or the parent goes away."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    tools, broken = _load(specs)
    conn.send(("ready",))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        name, arguments = message
        reply = _call(tools, broken, name, arguments, max_chars)
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return
        except Exception as err:  # an image that does not pickle
            conn.send(("error", one_line(f"{name} returned something that cannot be sent back: {err}")))


def _load(specs: dict[str, str]) -> tuple[dict[str, Callable[..., Any]], dict[str, str]]:
    """Tools that load, and why each other one does not."""
    from easytrain.rewards.registry import import_callable  # pure Python: nothing heavy comes with it

    tools: dict[str, Callable[..., Any]] = {}
    broken: dict[str, str] = {}
    files: dict[str, Any] = {}
    for name, spec in specs.items():
        try:
            tools[name] = import_callable(spec, "tool", files)
        except BaseException as err:  # a user's module may raise anything, even SystemExit, while importing
            broken[name] = one_line(f"{name} could not be loaded in the tool process: {type(err).__name__}: {err}")
    return tools, broken


def _call(tools: dict[str, Callable[..., Any]], broken: dict[str, str], name: str, arguments: dict[str, Any],
          max_chars: int) -> Reply:
    if name in broken:
        return ("error", broken[name])
    try:
        value = tools[name](**arguments)
        text, images = _render(value)
    except BaseException as err:  # the tool's own failure, sys.exit() too: the model sees it, the process stays
        return ("error", one_line(f"{name} raised {type(err).__name__}: {err}"))
    return ("ok", cut_text(text, max_chars), images)


def _render(value: Any) -> tuple[str, list[Any]]:
    """A str as is, images apart (alone or in a list with text), dicts and lists as JSON, anything else str()."""
    if isinstance(value, str):
        return value, []
    if _is_image(value):
        return "", [value]
    if isinstance(value, (list, tuple)) and any(_is_image(part) for part in value):
        images = [part for part in value if _is_image(part)]
        texts = [_render(part)[0] for part in value if not _is_image(part)]
        return "\n".join(text for text in texts if text), images
    if isinstance(value, (dict, list, tuple)):
        return json.dumps(value, ensure_ascii=False, default=str), []
    return str(value), []


def _is_image(value: Any) -> bool:
    """A PIL image (PIL is loaded only if the tool itself imported it)."""
    module = sys.modules.get("PIL.Image")
    return module is not None and isinstance(value, module.Image)


def cut_text(text: str, limit: int) -> str:
    """``text`` cut to ``limit`` characters, saying how many were cut."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… [cut {len(text) - limit} characters]"


def one_line(text: str, limit: int = 500) -> str:
    """``text`` on one line, at most about ``limit`` characters."""
    return cut_text(" ".join(text.split()), limit)
