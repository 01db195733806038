"""Issue 28: multi-turn tools (easytrain/tools/): JSON schemas from signatures and docstrings, loading named like
reward functions with errors naming the config key, parsing the Qwen/Hermes <tool_call> format, and running
calls in a separate process where a tool that raises, hangs, crashes its process, floods its output or is
called wrongly gives a failed result (and the next call works), never an exception."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator

import pytest

from easytrain.tools.calls import CALL_END, CALL_START, ToolCall, call_end, parse_tool_call
from easytrain.tools.registry import ToolLoadError, load_tools, schema_of
from easytrain.tools.runner import ToolResult, ToolRunner

ROOT = Path(__file__).resolve().parents[1]
ASSETS = ROOT / "tests" / "assets"
DEMO = ASSETS / "demo_tools.py"
NAMES = ["zoom", "fails", "sleeps", "big", "table", "picture", "crash", "pid", "heavy_modules", "run_id",
         "run_id_again", "exits"]


@pytest.fixture(scope="module")
def runner() -> Iterator[ToolRunner]:
    with ToolRunner(load_tools([f"{DEMO}:{name}" for name in NAMES]), timeout_s=30.0,
                    max_output_chars=50) as tools:
        yield tools


def test_schema_from_signature_and_docstring() -> None:
    tools = load_tools([f"{DEMO}:zoom"])
    assert tools["zoom"].schema == {
        "type": "function",
        "function": {
            "name": "zoom",
            "description": "Zoom into the image around a point.",
            "parameters": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "description": "column of the centre, in pixels."},
                    "y": {"type": "integer", "description": "row of the centre, in pixels."},
                    "scale": {"type": "number", "description": "how much to enlarge."},
                    "label": {"type": "string"},
                    "tags": {"type": "array"},
                },
                "required": ["x", "y"],
            },
        },
    }


def test_schema_without_docstring_or_annotations() -> None:
    tools = load_tools([f"{DEMO}:undocumented"])
    assert tools["undocumented"].schema["function"] == {
        "name": "undocumented", "description": "",
        "parameters": {"type": "object", "required": ["a"],
                       "properties": {"a": {}, "b": {}, "c": {"type": "object"}, "flag": {"type": "boolean"}}},
    }


def test_schema_of_a_plain_function() -> None:
    def measure(length: float, unit: str = "cm") -> str:
        """Measure a length.

        Args:
            length: the length.
        """
        return f"{length} {unit}"

    parameters = schema_of(measure)["function"]["parameters"]
    assert parameters == {"type": "object", "required": ["length"],
                          "properties": {"length": {"type": "number", "description": "the length."},
                                         "unit": {"type": "string"}}}


def test_star_arguments_are_refused() -> None:
    with pytest.raises(ToolLoadError, match=r"worker\.rollout\.multi_turn\.tools\[0\].*\*values"):
        load_tools([f"{DEMO}:spread"])


def test_loading_from_a_file_and_a_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ASSETS))
    tools = load_tools([f"{DEMO}:big", "demo_tools:table"])
    assert list(tools) == ["big", "table"]
    assert tools["big"].name == "big" and tools["big"].fn(3) == "xxx"
    assert tools["table"].fn() == {"shapes": ["circle", "square"], "n": 2}
    assert tools["table"].schema["function"]["name"] == "table"
    assert load_tools([]) == {}
    one_file = load_tools([f"{DEMO}:pid", f"{DEMO}:run_id"])
    assert one_file["pid"].fn.__globals__ is one_file["run_id"].fn.__globals__  # the file ran once


@pytest.mark.parametrize("spec,match", [
    ("zoom", "not of the form path/to/file.py:name"),
    ("/nowhere/tools.py:zoom", "no such file '/nowhere/tools.py'"),
    ("easytrain.no_such_module:zoom", "cannot import 'easytrain.no_such_module'"),
    (f"{DEMO}:no_such_tool", "has no function 'no_such_tool'"),
])
def test_load_errors_name_the_key_the_spec_and_the_fix(spec: str, match: str) -> None:
    with pytest.raises(ToolLoadError) as caught:
        load_tools([f"{DEMO}:pid", spec])
    message = str(caught.value)
    assert message.startswith(f"worker.rollout.multi_turn.tools[1]={spec!r}: ")
    assert match in message and "path/to/file.py:function or package.module:function" in message
    assert isinstance(caught.value, ValueError)


def test_two_tools_of_one_name_are_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ASSETS))
    with pytest.raises(ToolLoadError, match=r"my\.tools\[1\]='demo_tools:pid': a tool named 'pid' is already"):
        load_tools([f"{DEMO}:pid", "demo_tools:pid"], key="my.tools")


def test_parsing_calls() -> None:
    good = f'I will zoom.\n{CALL_START}\n{{"name": "zoom", "arguments": {{"x": 1, "y": 2}}}}\n{CALL_END} after'
    assert parse_tool_call(good) == ToolCall("zoom", {"x": 1, "y": 2})
    assert call_end(good) == good.index(CALL_END) + len(CALL_END)
    as_string = f'{CALL_START}{{"name": "zoom", "arguments": "{{\\"x\\": 1}}"}}{CALL_END}'
    assert parse_tool_call(as_string) == ToolCall("zoom", {"x": 1})
    assert parse_tool_call(f'{CALL_START}{{"name": "pid"}}{CALL_END}') == ToolCall("pid", {})
    two = f'{CALL_START}{{"name": "a", "arguments": {{}}}}{CALL_END}{CALL_START}{{"name": "b"}}{CALL_END}'
    assert parse_tool_call(two) == ToolCall("a", {})
    assert call_end(two) == two.index(CALL_END) + len(CALL_END)


def test_text_without_a_call() -> None:
    assert parse_tool_call("The answer is 3.") is None
    assert call_end("The answer is 3.") is None
    assert call_end(f"stray {CALL_END} then {CALL_START} unclosed") is None
    assert call_end(f"{CALL_END}{CALL_START}{{}}{CALL_END}") == len(f"{CALL_END}{CALL_START}{{}}{CALL_END}")


@pytest.mark.parametrize("text,why", [
    (f'{CALL_START}{{"name": "zoom", "arguments": {{}}}}', "unclosed"),
    (f"{CALL_START}zoom(x=1){CALL_END}", "not JSON"),
    (f'{CALL_START}["zoom"]{CALL_END}', "not a JSON object"),
    (f'{CALL_START}{{"arguments": {{"x": 1}}}}{CALL_END}', 'no "name"'),
    (f'{CALL_START}{{"name": "zoom", "arguments": [1, 2]}}{CALL_END}', "not a JSON object"),
    (f'{CALL_START}{{"name": "zoom", "arguments": "x=1"}}{CALL_END}', "not JSON"),
])
def test_malformed_calls_say_why(text: str, why: str) -> None:
    parsed = parse_tool_call(text)
    assert isinstance(parsed, str) and why in parsed and "\n" not in parsed


def _failed(result: ToolResult, error: str) -> None:
    assert not result.ok and result.error == error and result.text == f"error: {error}" and not result.images


def test_a_call_runs_and_the_process_is_reused(runner: ToolRunner) -> None:
    result = runner.run(ToolCall("zoom", {"x": 3, "y": 4, "label": "cat"}))
    assert result == ToolResult(text="zoomed 2.0x at (3, 4) [cat]", ok=True, seconds=result.seconds)
    assert result.seconds > 0
    first, second = runner.run(ToolCall("pid", {})), runner.run(ToolCall("pid", {}))
    assert first.ok and first.text == second.text and int(first.text) != os.getpid()
    table = runner.run(ToolCall("table", {}))
    assert table.ok and table.text == '{"shapes": ["circle", "square"], "n": 2}'


def test_the_tool_process_imports_nothing_heavy(runner: ToolRunner) -> None:
    result = runner.run(ToolCall("heavy_modules", {}))
    assert result.ok and result.text == "[]"
    run = runner.run(ToolCall("run_id", {}))
    assert run.ok and len(run.text) == 32
    assert run.text != runner.tools["run_id"].fn()  # the tool process loaded the file itself, once for all tools
    assert runner.run(ToolCall("run_id_again", {})).text == run.text


def test_failures_are_results(runner: ToolRunner) -> None:
    _failed(runner.run(ToolCall("fails", {"message": "bad region\nsecond line"})),
            "fails raised ValueError: bad region second line")
    pid = runner.run(ToolCall("pid", {}))
    _failed(runner.run(ToolCall("exits", {"code": 2})), "exits raised SystemExit: 2")
    assert runner.run(ToolCall("pid", {})).text == pid.text  # sys.exit() in a tool does not end the process
    _failed(runner.run(ToolCall("zom", {})), f"unknown tool 'zom'; tools: {', '.join(NAMES)}")
    _failed(runner.run(ToolCall("zoom", {"x": 1})), "bad arguments for zoom: missing a required argument: 'y'")
    _failed(runner.run(ToolCall("zoom", {"x": 1, "y": 2, "z": 3})),
            "bad arguments for zoom: got an unexpected keyword argument 'z'")
    reason = parse_tool_call(f"{CALL_START}zoom{CALL_END}")
    assert isinstance(reason, str)
    _failed(runner.run(reason), reason)
    assert runner.run(ToolCall("zoom", {"x": 1, "y": 2})).ok


def test_long_output_is_cut(runner: ToolRunner) -> None:
    result = runner.run(ToolCall("big", {"n": 1050}))
    assert result.ok and result.text == "x" * 50 + "… [cut 1000 characters]"
    assert runner.run(ToolCall("big", {"n": 50})).text == "x" * 50


def test_an_image_result(runner: ToolRunner) -> None:
    result = runner.run(ToolCall("picture", {"size": 6}))
    assert result.ok and result.text == "a red square" and len(result.images) == 1
    image = result.images[0]
    assert image.size == (6, 6) and image.getpixel((2, 3)) == (255, 0, 0)


def test_a_crashed_process_is_replaced(runner: ToolRunner) -> None:
    before = runner.run(ToolCall("pid", {}))
    _failed(runner.run(ToolCall("crash", {"code": 3})), "crash crashed its tool process (exit code 3)")
    after = runner.run(ToolCall("pid", {}))
    assert before.ok and after.ok and after.text != before.text


def test_a_hanging_tool_times_out_and_the_next_call_works(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(ASSETS))  # tools loaded by module name, in the tool process too
    # 2 s: room for a quick call's reply on a loaded machine, short enough for the hang to cost little
    with ToolRunner(load_tools(["demo_tools:sleeps", "demo_tools:pid"]), timeout_s=2.0,
                    max_output_chars=100) as runner:
        before = runner.run(ToolCall("pid", {}))
        started = time.monotonic()
        _failed(runner.run(ToolCall("sleeps", {})), "sleeps timed out after 2.0 s")
        assert time.monotonic() - started < 12.0
        after = runner.run(ToolCall("pid", {}))
        assert before.ok and after.ok and after.text != before.text


def test_the_tool_process_does_not_rerun_the_main_script(tmp_path: Path) -> None:
    marks = tmp_path / "marks"
    done = subprocess.run([sys.executable, str(ASSETS / "tool_main.py"), f"{DEMO}:pid"], capture_output=True,
                          text=True, timeout=120, cwd=ROOT, env={**os.environ, "EASYTRAIN_TEST_MARKS": str(marks)})
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr
    assert marks.read_text() == "__main__\n"
