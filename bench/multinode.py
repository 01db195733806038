"""Step time and driver overhead on 1, 2 and 4 Ray nodes at fixed total work, and a node lost mid-run.

    .venv/bin/python bench/multinode.py [--nodes 1 2 4] [--steps 4] [--warmup 1]

Each setting starts a Ray cluster on this machine (``ray.cluster_utils.Cluster``: a head and N-1 more
node processes, 8 logical CPUs split evenly) and runs the tiny GRPO step (8 prompts x 4 responses, 16 new
tokens, KL reference, fp32) with 4 workers per role in total: ``trainer.nnodes=N`` and
``trainer.workers_per_node=4/N``, roles colocated. The work per step is the same in every setting; what
changes is how many node processes the ranks, the object store traffic and the collectives span. It reports
the median step time and the driver's overhead (step time minus the slowest rank's busy time in each
phase and the reward wait, as bench/grpo_step.py measures it).

Then, on the largest setting, a run with ``trainer.max_failures=1`` loses a worker node after step 2
(the node process is removed and a fresh one added, as KubeRay replaces a pod); the run must recover from
its latest checkpoint and finish. All on one 2-core machine: absolute times are not a cluster's, the
trend across settings is the figure. Writes ``bench/results/multinode.json``.
"""

from __future__ import annotations

import argparse
import os
import json
import logging
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("EASYTRAIN_DEBUG_METHODS", "1")  # the workers' busy_times (easytrain.workers.debug)

from bench.provenance import write_result  # noqa: E402

PHASES = {"generate": [("rollout", "generate")], "ref": [("ref", "compute_ref_log_probs")],
          "update": [("actor", "update")], "sync": [("actor", "push_weights")]}
TOTAL_WORKERS, TOTAL_CPUS = 4, 8


def overrides(out: str, nodes: int, steps: int, *extra: str) -> list[str]:
    return [f"trainer.output_dir={out}", "data.num_workers=0", "data.synthetic_size=64",
            "data.rollout_batch_size=8", "worker.rollout.n=4", "worker.actor.global_batch_size=8",
            "worker.actor.micro_batch_size_per_device_for_update=8", "data.max_response_length=16",
            "algorithm.kl_coef=0.04", "trainer.loggers=[jsonl]", f"trainer.nnodes={nodes}",
            f"trainer.workers_per_node={TOTAL_WORKERS // nodes}", f"trainer.max_steps={steps}",
            "watchdog.plot=false", *extra]


def start_cluster(nodes: int) -> Any:
    import ray
    from ray.cluster_utils import Cluster

    per_node = TOTAL_CPUS // nodes
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": per_node, "include_dashboard": False})
    for _ in range(nodes - 1):
        cluster.add_node(num_cpus=per_node)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace="easytrain-bench", log_to_driver=False)
    return cluster


def measure(nodes: int, steps: int, warmup: int) -> dict[str, Any]:
    import ray

    from easytrain.config import load
    from easytrain.trainer.rl import RLTrainer

    cluster = start_cluster(nodes)
    try:
        with tempfile.TemporaryDirectory() as out:
            trainer = RLTrainer(load(overrides(out, nodes, warmup + steps)))
            groups = {"actor": trainer.roles.actor, "ref": trainer.roles.ref, "rollout": trainer.roles.rollout}
            prompts, records = trainer.data.train_batches(), []
            for step in range(warmup + steps):
                trainer.step = step + 1
                for group in groups.values():
                    group.call("busy_times")
                metrics = trainer.train_step(prompts).metrics
                busy = {name: group.call("busy_times") for name, group in groups.items() if group is not None}
                work = sum(max(b.get(method, 0.0) for b in busy[role]) for phase in PHASES.values()
                           for role, method in phase if role in busy)
                if step >= warmup:
                    records.append({"step_s": metrics["time/step"],
                                    "overhead_s": metrics["time/step"] - work - metrics["time/reward"],
                                    "phases_s": {k[5:]: v for k, v in metrics.items() if k.startswith("time/")}})
            trainer.close()
    finally:
        ray.shutdown()
        cluster.shutdown()
    median = statistics.median
    return {"nodes": nodes, "workers_per_node": TOTAL_WORKERS // nodes,
            "median_step_s": round(median(r["step_s"] for r in records), 3),
            "median_overhead_s": round(median(r["overhead_s"] for r in records), 3),
            "median_overhead_pct": round(100 * median(r["overhead_s"] / r["step_s"] for r in records), 1),
            "steps": records}


def lost_node(nodes: int) -> dict[str, Any]:
    """A run that loses a worker node after step 2 and must finish from its checkpoint."""
    import ray

    from easytrain.config import load
    from easytrain.trainer.rl import RLTrainer

    cluster = start_cluster(nodes)
    outcome: dict[str, Any] = {}
    messages: list[str] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logging.getLogger("easytrain").addHandler(Catch())
    logging.getLogger("easytrain").setLevel(logging.INFO)
    try:
        with tempfile.TemporaryDirectory() as out:
            config = load(overrides(out, nodes, 5, "trainer.save_freq=1", "trainer.max_failures=1"))

            def run() -> None:
                trainer = RLTrainer(config)
                try:
                    trainer.fit()
                    outcome["finished"] = True
                except BaseException as err:  # noqa: BLE001 - reported in the results
                    outcome["error"] = f"{type(err).__name__}: {err}"
                finally:
                    trainer.close()

            thread = threading.Thread(target=run, daemon=True)
            started = time.monotonic()
            thread.start()
            metrics = Path(out) / "metrics.jsonl"
            while not (metrics.exists() and any(json.loads(line).get("step") == 2
                                                for line in metrics.read_text().splitlines())):
                if not thread.is_alive() or time.monotonic() - started > 600:
                    break
                time.sleep(0.1)
            victim = next(n for n in cluster.list_all_nodes() if n is not cluster.head_node)
            killed_at = time.monotonic() - started
            cluster.remove_node(victim)
            cluster.add_node(num_cpus=TOTAL_CPUS // nodes)
            thread.join(timeout=900)
            steps = sorted({json.loads(line)["step"] for line in metrics.read_text().splitlines()
                            if "reward/mean" in line})
    finally:
        ray.shutdown()
        cluster.shutdown()
    recovered = [m for m in messages if "recreating the worker groups" in m]
    return {"nodes": nodes, "node_removed_after_s": round(killed_at, 1), "finished": bool(outcome.get("finished")),
            "error": outcome.get("error"), "logged_steps": steps, "recovery_messages": recovered,
            "total_s": round(time.monotonic() - started, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    for n in args.nodes:
        if TOTAL_WORKERS % n:
            parser.error(f"--nodes {n}: {TOTAL_WORKERS} workers do not split over {n} nodes")
    settings = [measure(n, args.steps, args.warmup) for n in args.nodes]
    loss = lost_node(max(args.nodes)) if max(args.nodes) > 1 else None
    result = {"benchmark": "multinode",
              "cluster": "one machine; nodes are Ray node processes (ray.cluster_utils.Cluster)",
              "settings": settings, "lost_node": loss}
    path = ROOT / "bench" / "results" / "multinode.json"
    write_result(path, result)
    base = settings[0]["median_step_s"]
    print("nodes  workers/node  step s  vs 1 node  driver overhead")
    for s in settings:
        print(f"{s['nodes']:5d}  {s['workers_per_node']:12d}  {s['median_step_s']:6.2f}  "
              f"{s['median_step_s'] / base:8.2f}x  {s['median_overhead_s']:.2f} s ({s['median_overhead_pct']}%)")
    if loss is not None:
        print(f"lost node ({loss['nodes']} nodes, removed after {loss['node_removed_after_s']} s): finished="
              f"{loss['finished']}, steps {loss['logged_steps']}, {loss['recovery_messages'][:1]}")
    print(f"wrote {path.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
