"""Tools: user functions named like reward functions, each with the JSON schema the model sees.

``load_tools(["tools.py:zoom", "mypkg.tools:count"])`` imports each function (never evaluated from config
text) and describes it in the OpenAI function format (what chat templates' ``tools`` take)::

    {"type": "function", "function": {"name": "zoom", "description": "<the docstring's first paragraph>",
     "parameters": {"type": "object", "properties": {"x": {"type": "integer", "description": "..."}},
                    "required": ["x"]}}}

Argument types come from the annotations, argument descriptions from a Google-style ``Args:`` section.
"""

from __future__ import annotations

import collections.abc
import inspect
import re
import types
import typing
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from easytrain.rewards.registry import RewardLoadError, import_callable

KEY = "worker.rollout.multi_turn.tools"
CONTEXT_ARGS = ("images",)
"""Arguments easytrain fills, never the model: ``images``, the sample's prompt images (PIL). A tool that declares
one gets it on every call; the schema the model sees leaves it out."""
_FORM = "give each tool as path/to/file.py:function or package.module:function"
_SIMPLE = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", tuple: "array",
           set: "array", frozenset: "array", dict: "object"}
_ORIGINS = {list: "array", tuple: "array", set: "array", frozenset: "array", collections.abc.Sequence: "array",
            collections.abc.Iterable: "array", dict: "object", collections.abc.Mapping: "object"}
_NAMED = {"str": "string", "int": "integer", "float": "number", "bool": "boolean", "list": "array",
          "tuple": "array", "dict": "object"}
_SECTION = re.compile(r"^\s*(Args|Arguments|Parameters|Returns?|Yields?|Raises|Examples?|Notes?)\s*:\s*$")
_ARGS = re.compile(r"^(\s*)(Args|Arguments|Parameters)\s*:\s*$")
_ENTRY = re.compile(r"^\*{0,2}(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


class ToolLoadError(ValueError):
    """``worker.rollout.multi_turn.tools`` names something that is not a usable tool."""


@dataclass(frozen=True)
class Tool:
    """A loaded tool: its name (the function's), the function, and its JSON schema."""

    name: str
    fn: Callable[..., Any]
    schema: dict[str, Any]


def load_tools(specs: Sequence[str], key: str = KEY) -> dict[str, Tool]:
    """Name -> tool for each ``path/to/file.py:name`` or ``package.module:name``, in order."""
    tools: dict[str, Tool] = {}
    origin: dict[str, str] = {}
    files: dict[str, types.ModuleType] = {}  # a file holding several tools runs once
    for i, spec in enumerate(specs):
        where = f"{key}[{i}]"
        try:
            fn = import_callable(spec, where, files)
        except RewardLoadError as err:
            raise ToolLoadError(f"{err}; {_FORM}") from err
        name = spec.rsplit(":", 1)[1]
        if name in tools:
            raise ToolLoadError(f"{where}={spec!r}: a tool named {name!r} is already loaded from "
                                f"{origin[name]!r}; tools are named by their functions, so rename one")
        try:
            schema = schema_of(fn, name)
        except ToolLoadError as err:
            raise ToolLoadError(f"{where}={spec!r}: {err}") from err
        tools[name] = Tool(name, fn, schema)
        origin[name] = spec
    return tools


def schema_of(fn: Callable[..., Any], name: Optional[str] = None) -> dict[str, Any]:
    """The OpenAI function schema of ``fn`` (named ``name``, by default its ``__name__``)."""
    name = name or getattr(fn, "__name__", type(fn).__name__)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError) as err:
        raise ToolLoadError(f"{name} has no signature to describe ({err}); use a plain Python function") from err
    hints = _hints(fn)
    doc = inspect.getdoc(fn) or ""
    described = _arg_descriptions(doc)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for param in signature.parameters.values():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            star = "*" if param.kind is param.VAR_POSITIONAL else "**"
            raise ToolLoadError(f"{name} takes {star}{param.name}, which a JSON schema cannot describe; "
                                "give the tool named arguments only")
        if param.name in CONTEXT_ARGS:
            continue
        if param.kind is param.POSITIONAL_ONLY:
            raise ToolLoadError(f"{name} takes {param.name} positional-only, but tools are called with named "
                                "arguments; remove the '/' from its signature")
        prop: dict[str, Any] = {}
        json_type = _json_type(hints.get(param.name, param.annotation))
        if json_type is not None:
            prop["type"] = json_type
        if param.name in described:
            prop["description"] = described[param.name]
        properties[param.name] = prop
        if param.default is param.empty:
            required.append(param.name)
    return {"type": "function",
            "function": {"name": name, "description": _first_paragraph(doc),
                         "parameters": {"type": "object", "properties": properties, "required": required}}}


def _hints(fn: Callable[..., Any]) -> dict[str, Any]:
    """Resolved annotations; the raw ones (maybe strings) when some name cannot be resolved."""
    try:
        return typing.get_type_hints(fn)
    except Exception:  # an annotation naming something undefined: fall back to the text
        return dict(getattr(fn, "__annotations__", {}) or {})


def _json_type(annotation: Any) -> Optional[str]:
    """The JSON schema type of an annotation; None when it has none (missing, Any, a union of several)."""
    if annotation is inspect.Parameter.empty or annotation is Any:
        return None
    if isinstance(annotation, str):  # annotations that could not be resolved: read the text
        text = re.sub(r"\s*\|\s*None\b|\bNone\s*\|\s*", "", annotation.strip())
        inner = re.fullmatch(r"(?:typing\.)?Optional\[(.+)\]", text)
        text = (inner.group(1) if inner else text).removeprefix("typing.")
        return _NAMED.get(re.split(r"[\[ ]", text)[0].lower())
    if annotation in _SIMPLE:
        return _SIMPLE[annotation]
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        kinds = {_json_type(arg) for arg in typing.get_args(annotation) if arg is not type(None)}
        return kinds.pop() if len(kinds) == 1 else None
    if origin is typing.Literal:
        kinds = {_json_type(type(value)) for value in typing.get_args(annotation)}
        return kinds.pop() if len(kinds) == 1 else None
    return _ORIGINS.get(origin) if origin is not None else None


def _first_paragraph(doc: str) -> str:
    """The docstring's first paragraph on one line; empty when it starts with a section."""
    lines: list[str] = []
    for line in doc.splitlines():
        if not line.strip() or _SECTION.match(line):
            break
        lines.append(line.strip())
    return " ".join(lines)


def _arg_descriptions(doc: str) -> dict[str, str]:
    """Argument -> description from a Google-style ``Args:`` section (continuation lines joined)."""
    lines = doc.splitlines()
    start = next((i for i, line in enumerate(lines) if _ARGS.match(line)), None)
    if start is None:
        return {}
    header = len(_ARGS.match(lines[start]).group(1))  # type: ignore[union-attr]
    found: dict[str, list[str]] = {}
    entry_indent: Optional[int] = None
    current: Optional[str] = None
    for line in lines[start + 1:]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent <= header:
            break
        if entry_indent is None:
            entry_indent = indent
        match = _ENTRY.match(line.strip())
        if indent <= entry_indent and match:
            current = match.group(1)
            found[current] = [match.group(2).strip()] if match.group(2).strip() else []
        elif current is not None:
            found[current].append(line.strip())
    return {arg: " ".join(parts) for arg, parts in found.items() if parts}
