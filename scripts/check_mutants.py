"""Break the trainer on purpose, one way at a time, and check that the tests notice.

    .venv/bin/python scripts/check_mutants.py                 # every mutant, ~25 minutes on 2 cores
    .venv/bin/python scripts/check_mutants.py --only clip_low kl_sign
    .venv/bin/python scripts/check_mutants.py --list

Each mutant is one textual edit of the library (a clip bound swapped, the KL
sign flipped, the DAPO filter opened, ...) and the tests that are meant to
catch it. The edit is applied in place, the tests run, and the file is
restored (also on Ctrl-C); a mutant is *caught* when pytest fails. An edit
whose text is no longer in the file is reported as stale, so the list cannot
silently stop checking anything. Run it on a clean tree with no other test
run in the same checkout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


OFFPOLICY = "tests/test_grpo_offpolicy.py"
LOSS = "tests/test_actor_loss_modes.py"
MUTANTS = [
    Mutant("schedule_shape", "easytrain/distributed/strategy.py",
           "0.5 * (1 + math.cos(math.pi * progress)) if kind == \"cosine\" else 1.0 - progress",
           "1.0 - progress", ("tests/test_schedules.py",)),
    Mutant("warmup", "easytrain/distributed/strategy.py", "if warmup and step < warmup:", "if False:",
           ("tests/test_schedules.py",)),
    Mutant("clip_low", "easytrain/algorithms/losses.py", "ratio.clamp(1.0 - clip_low, 1.0 + clip_high)",
           "ratio.clamp(1.0 - clip_high, 1.0 + clip_high)", (LOSS, OFFPOLICY)),
    Mutant("clip_high", "easytrain/algorithms/losses.py", "ratio.clamp(1.0 - clip_low, 1.0 + clip_high)",
           "ratio.clamp(1.0 - clip_low, 1.0 + clip_low)", (LOSS, OFFPOLICY)),
    Mutant("kl_sign", "easytrain/workers/actor.py", "loss = loss + kl_coef * aggregate(kl, mask, mode, scale)",
           "loss = loss - kl_coef * aggregate(kl, mask, mode, scale)", (LOSS, OFFPOLICY)),
    Mutant("kl_estimator_sign", "easytrain/algorithms/kl.py", "diff = log_probs - ref_log_probs",
           "diff = ref_log_probs - log_probs", ("tests/test_algorithms.py", "tests/test_rl_switches.py")),
    Mutant("kl_coef", "easytrain/workers/actor.py", "loss = loss + kl_coef * aggregate(kl, mask, mode, scale)",
           "loss = loss + 2 * kl_coef * aggregate(kl, mask, mode, scale)", (LOSS, OFFPOLICY)),
    Mutant("kl_in_reward_coef", "easytrain/algorithms/kl.py", "return rewards - coef * kl.sum(-1)",
           "return rewards - 0.5 * coef * kl.sum(-1)", ("tests/test_rl_switches.py",)),
    Mutant("loss_agg_mode", "easytrain/algorithms/losses.py",
           "per_seq = (token_losses * mask).sum(-1) / mask.sum(-1).clamp(min=1)",
           "per_seq = (token_losses * mask).sum(-1) / mask.shape[-1]", (LOSS, OFFPOLICY)),
    Mutant("response_mask", "easytrain/workers/actor.py",
           "mask = micro[\"response_mask\"].to(self.device, torch.float32)",
           "mask = torch.ones_like(micro[\"response_mask\"], dtype=torch.float32, device=self.device)", (LOSS, OFFPOLICY)),
    Mutant("old_log_prob_recompute", "easytrain/trainer/rl.py",
           "self.on_policy = config.worker.actor.ppo_epochs == 1 and steps_per_rollout == 1",
           "self.on_policy = True", (OFFPOLICY,)),
    Mutant("dapo_filter", "easytrain/algorithms/advantages.py", "return std > EPS", "return std >= 0",
           ("tests/test_algorithms.py", "tests/test_rl_switches.py")),
    Mutant("resumed_data_position", "easytrain/trainer/base.py", "self.loader.load_state_dict(state[\"data\"])",
           "self.loader.load_state_dict(self.fresh_data_state)", ("tests/test_resume.py",)),
    Mutant("watchdog_soft_threshold", "easytrain/memory/watchdog.py",
           "level(fraction, self.cfg.ram_warn, self.cfg.ram_soft, self.cfg.ram_hard)",
           "level(fraction, self.cfg.ram_warn, self.cfg.ram_hard, self.cfg.ram_hard)",
           ("tests/test_watchdog.py", "tests/test_watchdog_pressure.py")),
    Mutant("planner_logits_term", "easytrain/memory/planner.py",
           "return {\"activations\": acts, \"logits\": logits,",
           "return {\"activations\": acts, \"logits\": 0,", ("tests/test_memory_planner.py",)),
    Mutant("image_max_pixels", "easytrain/data/images.py", "if h_bar * w_bar > max_pixels:",
           "if h_bar * w_bar > 4 * max_pixels:", ("tests/test_data_images.py",)),
    Mutant("last_sync_bucket", "easytrain/workers/weight_sync.py",
           "    if current:\n        buckets.append(current)\n    return buckets",
           "    return buckets", ("tests/test_weight_sync.py",)),
]


def run_tests(tests: tuple[str, ...], timeout_s: int) -> tuple[int, float, str]:
    start = time.perf_counter()
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    try:
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return -1, time.perf_counter() - start, "timed out"
    lines = [line for line in done.stdout.splitlines() if line.strip()]
    return done.returncode, time.perf_counter() - start, lines[-1] if lines else done.stderr[-300:]


def check(mutant: Mutant, timeout_s: int) -> dict[str, object]:
    path = ROOT / mutant.path
    original = path.read_text()
    count = original.count(mutant.old)
    if count != 1:
        return {"mutant": mutant.name, "verdict": "stale", "detail": f"edit text found {count} times in {mutant.path}"}
    try:
        path.write_text(original.replace(mutant.old, mutant.new))
        rc, seconds, last = run_tests(mutant.tests, timeout_s)
    finally:
        path.write_text(original)
    verdict = "caught" if rc not in (0, 5, -1) else {0: "MISSED", 5: "no tests ran", -1: "timed out"}[rc]
    return {"mutant": mutant.name, "verdict": verdict, "tests": list(mutant.tests), "seconds": round(seconds, 1),
            "pytest": last}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", nargs="*", help="mutant names (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per mutant's test run")
    parser.add_argument("--out", type=Path, help="also write the verdicts as JSON here")
    parser.add_argument("--tests", nargs="*", help="run these test files for every chosen mutant instead of its own "
                                                   "(e.g. to see that a second test catches it too)")
    args = parser.parse_args()
    chosen = [m for m in MUTANTS if not args.only or m.name in args.only]
    unknown = set(args.only or ()) - {m.name for m in MUTANTS}
    if unknown:
        raise SystemExit(f"unknown mutant(s): {', '.join(sorted(unknown))}; --list shows them")
    if args.list:
        for m in chosen:
            print(f"{m.name:26} {m.path:40} {' '.join(m.tests)}")
        return
    verdicts = []
    for mutant in chosen:
        if args.tests:
            mutant = Mutant(mutant.name, mutant.path, mutant.old, mutant.new, tuple(args.tests))
        verdict = check(mutant, args.timeout)
        verdicts.append(verdict)
        print(f"{verdict['mutant']:26} {verdict['verdict']:8} {verdict.get('seconds', '')!s:>7}  "
              f"{verdict.get('pytest') or verdict.get('detail')}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(verdicts, indent=1) + "\n")
    missed = [v["mutant"] for v in verdicts if v["verdict"] != "caught"]
    print(f"{len(verdicts) - len(missed)} of {len(verdicts)} caught" + (f"; not caught: {', '.join(missed)}" if missed
                                                                         else ""))
    raise SystemExit(1 if missed else 0)


if __name__ == "__main__":
    main()
