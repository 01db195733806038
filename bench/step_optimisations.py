"""The GRPO step with and without the step-rate switches, side by side on this machine.

    .venv/bin/python bench/step_optimisations.py [--sizes tiny small] [--repeats 3] [--steps 4]

Runs ``bench/grpo_step.py`` (the real trainer: local Ray, 2 CPU workers,
colocated roles, HF engine, 8 prompts x 4 responses, 32 new tokens, KL
reference, fp32) alternately with every switch off ("plain") and on
("optimised"), ``--repeats`` times each per model size, and reports the
medians of the runs' median step times and phase times, generated tokens/s,
and the ratio. The switches (each tested for equal results in tests/):

- ``model.dedupe_images``: each distinct image through the vision tower once
  per forward (rollout prefill, reference, actor), not once per response;
- ``worker.actor.share_prompt``: the reference and actor forward passes run
  each prompt once with its responses after it;
- ``worker.actor.reuse_log_probs_on_policy`` (on in both: it was already the
  default) skips the old-log-prob pass when the update is exactly on-policy.

Not switches, so in both variants: the HF engine's decode loop (each prompt prefilled once for its n
samples, finished rows leaving the batch: ``worker.rollout.share_prefill`` and ``drop_finished`` were
switches when results/step_optimisations.json was recorded, and the one path since), a Batch carries each prompt's images once
and its tensors as numpy arrays in transit (``easytrain/distributed/batch.py``),
and worker processes use their share of the cores (``trainer.threads_per_worker``).

Writes ``bench/results/step_optimisations.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.provenance import write_result  # noqa: E402

SWITCHES = ["model.dedupe_images", "worker.actor.share_prompt"]
VARIANTS = {"plain": [f"{s}=false" for s in SWITCHES], "optimised": [f"{s}=true" for s in SWITCHES]}


def run_once(size: str, steps: int, overrides: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [sys.executable, str(ROOT / "bench" / "grpo_step.py"), "--size", size, "--steps", str(steps),
                   "--out", str(out), *[f"--override={o}" for o in overrides]]
        subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=["tiny", "small"], choices=["tiny", "small"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    median = statistics.median
    table: dict[str, dict] = {}
    for size in args.sizes:
        runs: dict[str, list[dict]] = {name: [] for name in VARIANTS}
        for repeat in range(args.repeats):
            for name, overrides in VARIANTS.items():  # alternated, so drift hits both alike
                result = run_once(size, args.steps, overrides)
                runs[name].append(result)
                print(f"{size} {name} run {repeat + 1}: {result['median_step_s']:.3f} s/step", flush=True)
        table[size] = {}
        for name, results in runs.items():
            phases = results[0]["median_phase_s"].keys()
            table[size][name] = {
                "median_step_s": round(median(r["median_step_s"] for r in results), 3),
                "runs_step_s": [r["median_step_s"] for r in results],
                "median_phase_s": {p: round(median(r["median_phase_s"][p] for r in results), 4) for p in phases},
                "generated_tokens_per_s": round(median(r["median_generated_tokens_per_s"] for r in results), 1),
            }
        plain, fast = table[size]["plain"], table[size]["optimised"]
        table[size]["speedup_step"] = round(plain["median_step_s"] / fast["median_step_s"], 3)
        table[size]["speedup_generate"] = round(plain["median_phase_s"]["generate"]
                                                / fast["median_phase_s"]["generate"], 3)
    result = {"benchmark": "step_optimisations",
              "variants": VARIANTS, "settings": {"repeats": args.repeats, "steps_per_run": args.steps,
                                                 "per_run": "bench/grpo_step.py settings"},
              "results": table}
    path = ROOT / "bench" / "results" / "step_optimisations.json"
    write_result(path, result)
    for size, rows in table.items():
        for name in VARIANTS:
            r = rows[name]
            phases = " ".join(f"{p} {s:.3f}" for p, s in r["median_phase_s"].items() if s >= 0.001)
            print(f"{size:5s} {name:9s} {r['median_step_s']:.3f} s/step  {r['generated_tokens_per_s']:.0f} tok/s  "
                  f"[{phases}]")
        print(f"{size:5s} step speed-up {rows['speedup_step']}x, generate phase {rows['speedup_generate']}x")
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
