"""Multi-turn RL with a tool against the same pipeline without it: ``+exp=tiny_tools``, measured.

    .venv/bin/python bench/tool_use.py        # writes bench/results/tool_use.json (~15 min here)

The task is ``synthetic:shapes/dot`` ("What colour is the dot?", a 5x5 px dot on 112x112 px;
chance 1/4). Two pipelines of ``python -m easytrain.main`` runs in fresh processes:

- with the tool: ``+exp=tiny_tools_sft`` (SFT on the rows' conversations: the call of
  ``zoom``, its turn with the enlarged dot, the boxed colour), then ``+exp=tiny_tools`` from
  that model (GRPO whose rollouts call the tool, which finds the dot in the image);
- with the tool on vLLM: the same SFT model, then the same GRPO with ``worker.rollout.engine=vllm``;
- without: the same SFT on the rows' question, image and answer alone
  (``data.messages_key=none data.image_key=images``), then the same GRPO with
  ``worker.rollout.multi_turn.enable=false``: the model must read the dot's colour itself.

Held-out accuracy is greedy answers to the 64 validation prompts, scored by the ``answer``
reward (the boxed colour, over the whole conversation).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import write_result  # noqa: E402
from bench.sft_then_rl import curve, run  # noqa: E402

ARMS = {
    "with_tool": ((), ()),
    "with_tool_vllm": ((), ("worker.rollout.engine=vllm",)),
    "without_tool": (("data.messages_key=none", "data.image_key=images", "data.limit_images=1"),
                     ("worker.rollout.multi_turn.enable=false",)),
}
"""Each arm's SFT and GRPO overrides. ``with_tool_vllm``: the tool pipeline with vLLM generating the GRPO rollouts
(the conversation continues on vLLM with the tool's images; issue 48), from the same SFT model as ``with_tool``."""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rl-epochs", type=int, default=1)
    args = parser.parse_args()
    record: dict = {"benchmark": "tool_use", "chance_accuracy": 0.25, "arms": {}}
    sfts: dict[tuple[str, ...], tuple] = {}  # arms with the same SFT overrides share its run
    for arm, (sft_extra, rl_extra) in ARMS.items():
        if sft_extra not in sfts:
            sfts[sft_extra] = run(f"tools-sft-{arm}", "+exp=tiny_tools_sft", *sft_extra)
        sft, sft_s, folder = sfts[sft_extra]
        rl, rl_s, _ = run(f"tools-rl-{arm}", "+exp=tiny_tools", f"model.path={folder}/hf",
                          f"trainer.total_epochs={args.rl_epochs}", *rl_extra)
        steps = sorted(r["time/step"] for r in rl if "time/step" in r)
        record["arms"][arm] = {
            "commands": [" ".join(["python -m easytrain.main +exp=tiny_tools_sft", *sft_extra]),
                         " ".join(["python -m easytrain.main +exp=tiny_tools model.path=<sft run>/hf",
                                   f"trainer.total_epochs={args.rl_epochs}", *rl_extra])],
            "sft_wall_s": round(sft_s, 1), "sft_val_accuracy": curve(sft, "val/reward/mean"),
            "rl_wall_s": round(rl_s, 1), "rl_val_accuracy": curve(rl, "val/reward/mean"),
            "rl_median_step_s": steps[len(steps) // 2] if steps else None,
            "rl_tool_calls": curve(rl, "rollout/tool_calls"), "rl_tool_errors": curve(rl, "rollout/tool_errors"),
        }
        print(f"{arm}: SFT ({sft_s:.0f} s) then GRPO ({rl_s:.0f} s): held-out accuracy "
              f"{' '.join(f'{s}:{a}' for s, a in record['arms'][arm]['rl_val_accuracy'])}")
    out = ROOT / "bench" / "results" / "tool_use.json"
    write_result(out, record)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
