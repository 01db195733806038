"""Run as a script: a ToolRunner started here must not run this file again in its tool process."""

import os
import sys

with open(os.environ["EASYTRAIN_TEST_MARKS"], "a") as marks:
    marks.write(f"{__name__}\n")

if __name__ == "__main__":
    from easytrain.tools.calls import ToolCall
    from easytrain.tools.registry import load_tools
    from easytrain.tools.runner import ToolRunner

    with ToolRunner(load_tools([sys.argv[1]]), timeout_s=60, max_output_chars=100) as runner:
        print(runner.run(ToolCall("pid", {})).ok)
