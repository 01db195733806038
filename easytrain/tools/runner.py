"""Running tool calls in a separate process, with a timeout and a size limit on their output.

``ToolRunner(tools, timeout_s, max_output_chars).run(call)`` always returns a :class:`ToolResult`: a tool that
raises, is called wrongly, runs past ``timeout_s`` or takes its process down gives ``ok=False`` and a one-line
error turn for the model, never an exception. Calls run one at a time in one persistent process (multiprocessing
"spawn", started at the first call, importing only :mod:`easytrain.tools.child`); a process that hung (killed at
the timeout) or died is replaced at the next call.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import multiprocessing
import os
import sys
import threading
import time
import types
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Iterator, Optional, Union

from easytrain.rewards.registry import USER_MODULE_PREFIX
from easytrain.tools.calls import ToolCall
from easytrain.tools.child import one_line, serve
from easytrain.tools.registry import CONTEXT_ARGS, Tool, ToolLoadError

logger = logging.getLogger(__name__)


@dataclass
class ToolResult:
    """What a call gave: the text (and images) of the tool turn, or ``ok=False`` with the error."""

    text: str
    ok: bool
    error: Optional[str] = None
    """One line on why it failed; ``text`` is then ``"error: " + error``, what the model sees."""
    images: list[Any] = field(default_factory=list)
    """PIL images the tool returned."""
    seconds: float = 0.0
    """Wall time of the call."""


def _failed(error: str) -> ToolResult:
    error = one_line(error)
    return ToolResult(text=f"error: {error}", ok=False, error=error)


class ToolRunner:
    """Runs calls of ``tools`` in a separate process; see the module docstring. Usable as a context manager."""

    def __init__(self, tools: dict[str, Tool], timeout_s: float, max_output_chars: int,
                 start_timeout_s: float = 60.0) -> None:
        self.tools = dict(tools)
        self.timeout_s = float(timeout_s)
        self.max_output_chars = max_output_chars
        self.start_timeout_s = start_timeout_s
        """How long the process may take to start and load the tools (not counted against a call)."""
        self._specs = {name: _spec_of(tool) for name, tool in self.tools.items()}
        self._context = multiprocessing.get_context("spawn")
        self._process: Optional[BaseProcess] = None
        self._conn: Optional[Connection] = None
        self._lock = threading.Lock()

    def run(self, call: Union[ToolCall, str], context: Optional[dict[str, Any]] = None) -> ToolResult:
        """The result of ``call``; a str (a malformed call's reason, from ``parse_tool_call``) fails as is.
        ``context``: values of :data:`~easytrain.tools.registry.CONTEXT_ARGS` (the sample's ``images``), passed
        to a tool that declares them."""
        with self._lock:
            started = time.monotonic()
            result = self._run(call, context or {})
            result.seconds = time.monotonic() - started
        if not result.ok:
            logger.debug("tools: %s", result.error)
        return result

    def close(self) -> None:
        """Stop the tool process (a later call starts a new one)."""
        with self._lock:
            if self._conn is not None and self._process is not None and self._process.is_alive():
                with contextlib.suppress(OSError, ValueError):
                    self._conn.send(None)
                self._process.join(1.0)
            self._stop()

    def __enter__(self) -> "ToolRunner":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, call: Union[ToolCall, str], context: dict[str, Any]) -> ToolResult:
        if isinstance(call, str):
            return _failed(call)
        tool = self.tools.get(call.name)
        if tool is None:
            return _failed(f"unknown tool {call.name!r}; tools: {', '.join(self.tools) or '(none)'}")
        filled = [name for name in CONTEXT_ARGS if name in call.arguments]
        if filled:
            return _failed(f"bad arguments for {call.name}: {filled[0]!r} is filled by easytrain, not by the call")
        declared = inspect.signature(tool.fn).parameters
        arguments = {**call.arguments, **{k: v for k, v in context.items() if k in declared}}
        try:
            inspect.signature(tool.fn).bind(**arguments)
        except TypeError as err:
            return _failed(f"bad arguments for {call.name}: {err}")
        try:
            conn = self._child()
        except Exception as err:  # it died or hung while starting, e.g. in a tool module's import
            self._stop()
            logger.warning("tools: the tool process did not start: %s: %s", type(err).__name__, err)
            return _failed(f"{call.name} could not run: the tool process did not start ({type(err).__name__})")
        try:
            conn.send((call.name, arguments))
            if not conn.poll(self.timeout_s):
                self._stop(grace_s=0.0)
                logger.warning("tools: %s ran past %s s; its process was killed", call.name, self.timeout_s)
                return _failed(f"{call.name} timed out after {self.timeout_s} s")
            reply = conn.recv()
        except (EOFError, OSError) as err:
            code = self._stop()
            logger.warning("tools: the tool process died during %s (exit code %s, %s)", call.name, code,
                           type(err).__name__)
            return _failed(f"{call.name} crashed its tool process (exit code {code})")
        if reply[0] == "ok":
            return ToolResult(text=reply[1], ok=True, images=list(reply[2]))
        return _failed(reply[1])

    def _child(self) -> Connection:
        """The live tool process's end of the pipe, starting a process (and waiting until it is ready) first
        when there is none."""
        if self._conn is not None and self._process is not None and self._process.is_alive():
            return self._conn
        self._stop()
        parent, child = self._context.Pipe()
        process = self._context.Process(target=serve, args=(child, self._specs, self.max_output_chars),
                                        name="easytrain-tools", daemon=True)
        with _bare_main():
            process.start()
        child.close()  # the parent's copy: without closing it, the child's death would never read as EOF
        self._process, self._conn = process, parent
        if not parent.poll(self.start_timeout_s):
            raise TimeoutError(f"not ready within {self.start_timeout_s} s")
        parent.recv()
        return parent

    def _stop(self, grace_s: float = 2.0) -> Optional[int]:
        """End the tool process (killed after ``grace_s``); its exit code, None without one."""
        process, conn = self._process, self._conn
        self._process = self._conn = None
        if conn is not None:
            conn.close()
        if process is None:
            return None
        process.join(grace_s)
        if process.is_alive():
            process.kill()
            process.join(5.0)
        return process.exitcode


def _spec_of(tool: Tool) -> str:
    """How the tool process loads ``tool.fn``: ``file.py:name`` for a function loaded from a file (or the main
    script), else ``module:name``."""
    fn = tool.fn
    module, name = getattr(fn, "__module__", None), getattr(fn, "__name__", None)
    if not module or not name or getattr(fn, "__qualname__", name) != name:
        raise ToolLoadError(f"tool {tool.name!r}: {fn!r} is not a module-level function, so the tool process "
                            "cannot load it; define it at the top level of a module or file")
    if module == "__main__" or module.startswith(USER_MODULE_PREFIX):
        return f"{os.path.abspath(inspect.getfile(fn))}:{name}"
    return f"{module}:{name}"


@contextlib.contextmanager
def _bare_main() -> Iterator[None]:
    """While the tool process starts, hide the parent's ``__main__``: "spawn" would run the main script or
    module again in the child (a console script, or Ray's worker, importing easytrain's heavy modules there)."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main
