"""The ``easytrain`` command.

    easytrain config [overrides...]     print the composed, validated config (exit 2 if it cannot work)
    easytrain run [overrides...]        same as python -m easytrain.main [overrides...]
    easytrain plan [--fit] [--format table|json] [overrides...]
                                        memory per role and phase, per GPU and node; what to change
    easytrain export CKPT --out DIR [--merge] [--dtype bfloat16] [--force] [--trust-remote-code]
                                        a checkpoint (global_step_<N>, or a run folder = its latest) as a
                                        Hugging Face folder; with LoRA the adapter, or --merge the full model
    easytrain memory RUN_DIR [--out PNG]
                                        draw the run's memory.jsonl (RAM and GPU per node, phases, events)
                                        as a PNG (default RUN_DIR/memory.png)
    easytrain report RUN_DIR            the run's plots (reward, response length, KL, phase times) and
                                        RUN_DIR/index.html showing them with the final config
    easytrain submit [--address URL] [--working-dir DIR] [--follow | --wait] [--insecure-http] [overrides...]
                                        submit the run to a Ray cluster (Ray Jobs); prints the job id and
                                        the dashboard URL
    easytrain submit --kuberay [--dry-run] [--cluster] [overrides...]
                                        the KubeRay RayJob (or with --cluster a long-lived RayCluster) for
                                        the config: printed as YAML (--dry-run) or created with the
                                        kubernetes client
    easytrain status|logs|stop JOB_ID [--address URL] [--follow] [--insecure-http]
                                        a submitted job's status, its driver log, or stop it

Overrides are Hydra's: ``+exp=qwen25vl_7b worker.rollout.n=8``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional, Sequence

from omegaconf import OmegaConf

from easytrain.config import ConfigError, compose, with_default_preset


def _config(overrides: Sequence[str]) -> int:
    from easytrain.main import resolve

    config = resolve(compose(with_default_preset(overrides)))
    sys.stdout.write(OmegaConf.to_yaml(OmegaConf.structured(config)))
    return 0


def _run(overrides: Sequence[str]) -> int:
    from easytrain.main import main as run_main

    run_main(list(overrides))
    return 0


def _plan(args: argparse.Namespace) -> int:
    from easytrain.config import to_config
    from easytrain.memory.report import plan_command
    from easytrain.trainer.data import try_profile

    config = to_config(compose(with_default_preset(args.overrides)))  # the plan itself reports what does not fit
    profiles, note = try_profile(config)
    sys.stdout.write(plan_command(config, args.format, args.fit, profiles, note) + "\n")
    return 0


def _export(args: argparse.Namespace) -> int:
    import logging

    from easytrain.distributed.checkpoint import IncompatibleCheckpoint
    from easytrain.trainer.checkpoint import CheckpointError
    from easytrain.trainer.export import export, one_line

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        out = export(args.checkpoint, args.out, merge=args.merge, dtype=args.dtype, force=args.force,
                     trust_remote_code=args.trust_remote_code)
    except (CheckpointError, IncompatibleCheckpoint, ValueError, OSError) as err:  # ExportError is a ValueError
        sys.stderr.write(f"easytrain export: {one_line(err)}\n")
        return 2
    sys.stdout.write(f"{out}\n")
    return 0


def _report(args: argparse.Namespace) -> int:
    import logging

    from easytrain.trainer.report import write_report

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        written = write_report(args.run_dir)
    except FileNotFoundError as err:
        sys.stderr.write(f"easytrain report: {err}\n")
        return 2
    sys.stdout.write("".join(f"{path}\n" for path in written))
    return 0


def _submit(args: argparse.Namespace) -> int:
    if args.kuberay:
        from easytrain.launch.kuberay import submit_kuberay

        return submit_kuberay(list(args.overrides), dry_run=args.dry_run, cluster=args.cluster)
    if args.dry_run or args.cluster:
        sys.stderr.write("easytrain submit: --dry-run and --cluster are KubeRay options; use them with --kuberay\n")
        return 2
    from easytrain.distributed.token import InsecureAddress
    from easytrain.launch.jobs import submit

    try:
        return submit(args.overrides, args.address, args.working_dir, follow=args.follow, wait=args.wait,
                      insecure_http=args.insecure_http)
    except InsecureAddress as err:
        sys.stderr.write(f"easytrain submit: {err}\n")
        return 2


def _job(args: argparse.Namespace) -> int:
    from easytrain.distributed.token import InsecureAddress
    from easytrain.launch import jobs

    try:
        if args.command == "logs":
            return jobs.logs(args.job_id, args.address, follow=args.follow, insecure_http=args.insecure_http)
        return int(getattr(jobs, args.command)(args.job_id, args.address, insecure_http=args.insecure_http))
    except InsecureAddress as err:
        sys.stderr.write(f"easytrain {args.command}: {err}\n")
        return 2


def _memory(args: argparse.Namespace) -> int:
    import logging

    from easytrain.memory.timeline import plot_timeline

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        out = plot_timeline(args.run_dir, args.out)
    except FileNotFoundError as err:
        sys.stderr.write(f"easytrain memory: {err}\n")
        return 2
    sys.stdout.write(f"{out}\n")
    return 0


COMMANDS = {"config": _config, "run": _run}
INSECURE_HELP = ("send the Ray token over plain http:// to a host that is not this machine (a trusted network "
                 "only; else use https:// or an SSH tunnel)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="easytrain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    export = sub.add_parser("export", help="write a checkpoint as a Hugging Face folder")
    export.add_argument("checkpoint", help="a global_step_<N> folder, or a run folder (its latest checkpoint)")
    export.add_argument("--out", required=True, help="folder to write: new, empty, or an earlier export (replaced)")
    export.add_argument("--force", action="store_true", help="replace a non-empty --out that holds no earlier export")
    export.add_argument("--merge", action="store_true", help="with LoRA: merge the adapter into the weights")
    export.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="cast the weights (default: the checkpoint's fp32 master weights)")
    export.add_argument("--trust-remote-code", action="store_true",
                        help="run the base model's own Python code (transformers' trust_remote_code); never taken "
                             "from the checkpoint's config")
    memory = sub.add_parser("memory", help="draw a run's memory timeline (memory.jsonl) as a PNG")
    memory.add_argument("run_dir", type=Path, help="the run folder holding memory.jsonl")
    memory.add_argument("--out", type=Path, default=None, help="PNG to write (default: RUN_DIR/memory.png)")
    report = sub.add_parser("report", help="plots of a run's metrics and an index.html showing them")
    report.add_argument("run_dir", type=Path, help="the run folder holding metrics.jsonl")
    submit = sub.add_parser("submit", help="submit the run to a Ray cluster (Ray Jobs), or render/apply KubeRay")
    submit.add_argument("--address", default=None, help="Ray dashboard, http://HEAD:8265 (default: RAY_ADDRESS, "
                                                       "else http://127.0.0.1:8265)")
    submit.add_argument("--working-dir", default=".", help="uploaded as the job's working directory (default: .)")
    submit.add_argument("--follow", action="store_true", help="stream the driver's log until the job ends")
    submit.add_argument("--wait", action="store_true", help="wait until the job ends (exit 0 if it SUCCEEDED)")
    submit.add_argument("--kuberay", action="store_true", help="KubeRay RayJob/RayCluster manifests instead")
    submit.add_argument("--dry-run", action="store_true", help="with --kuberay: print the manifest as YAML")
    submit.add_argument("--cluster", action="store_true", help="with --kuberay: a long-lived RayCluster instead "
                                                              "of the RayJob")
    submit.add_argument("--insecure-http", action="store_true", help=INSECURE_HELP)
    submit.add_argument("overrides", nargs=argparse.REMAINDER, help="Hydra overrides, e.g. +exp=qwen25vl_7b")
    for name, help_text in (("status", "a submitted job's status"), ("logs", "a submitted job's driver log"),
                            ("stop", "stop a submitted job")):
        job = sub.add_parser(name, help=help_text)
        job.add_argument("job_id")
        job.add_argument("--address", default=None, help="Ray dashboard (default: RAY_ADDRESS, else local)")
        job.add_argument("--insecure-http", action="store_true", help=INSECURE_HELP)
        if name == "logs":
            job.add_argument("--follow", action="store_true", help="stream until the job ends")
    for name, help_text in (("config", "print the composed and validated config"),
                            ("run", "run training (python -m easytrain.main)"),
                            ("plan", "memory per role and phase, per GPU and node, checked against capacity")):
        p = sub.add_parser(name, help=help_text)
        if name == "plan":
            p.add_argument("--fit", action="store_true",
                           help="search micro batches, offload, checkpointing and gpu_memory_utilization for the "
                                "cheapest setting that fits")
            p.add_argument("--format", choices=("table", "json"), default="table")
        p.add_argument("overrides", nargs=argparse.REMAINDER, help="Hydra overrides, e.g. +exp=tiny")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "plan":
            code = _plan(args)
        elif args.command == "export":
            code = _export(args)
        elif args.command == "memory":
            code = _memory(args)
        elif args.command == "report":
            code = _report(args)
        elif args.command == "submit":
            code = _submit(args)
        elif args.command in ("status", "logs", "stop"):
            code = _job(args)
        else:
            code = COMMANDS[args.command](args.overrides)
    except ConfigError as err:
        sys.stderr.write(f"easytrain {args.command}: config error: {err}\n")
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    main()
