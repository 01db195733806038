"""The tool-call format the model emits (Hermes, as ChatML templates describe it)::

    <tool_call>
    {"name": "zoom", "arguments": {"x": 1}}
    </tool_call>

Only the first complete call of a turn is parsed; a malformed one gives a short reason, which the model sees
as the tool's error turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Union

CALL_START = "<tool_call>"
CALL_END = "</tool_call>"


@dataclass(frozen=True)
class ToolCall:
    """One call: the tool's name and its keyword arguments."""

    name: str
    arguments: dict[str, Any]


def call_end(text: str) -> Optional[int]:
    """The index just past the first ``</tool_call>`` that closes a ``<tool_call>``; None without one."""
    start = text.find(CALL_START)
    if start < 0:
        return None
    end = text.find(CALL_END, start + len(CALL_START))
    return None if end < 0 else end + len(CALL_END)


def parse_tool_call(text: str) -> Union[ToolCall, str, None]:
    """The first call in ``text``: None without ``<tool_call>``, a ToolCall when well-formed, else why not."""
    start = text.find(CALL_START)
    if start < 0:
        return None
    end = call_end(text)
    if end is None:
        return f"unclosed {CALL_START}: no {CALL_END} follows it"
    body = text[start + len(CALL_START):end - len(CALL_END)].strip()
    try:
        call = json.loads(body)
    except json.JSONDecodeError as err:
        return f"the tool call is not JSON ({err.msg} at character {err.pos})"
    if not isinstance(call, dict):
        return 'the tool call is not a JSON object with "name" and "arguments"'
    name = call.get("name")
    if not isinstance(name, str) or not name:
        return 'the tool call has no "name"'
    arguments = call.get("arguments", {})
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):  # some models give the arguments as a JSON string holding the object
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            return f'the "arguments" of {name} are a string that is not JSON'
    if not isinstance(arguments, dict):
        return f'the "arguments" of {name} are not a JSON object'
    return ToolCall(name, arguments)
