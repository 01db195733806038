"""The ``easytrain`` command.

    easytrain config [overrides...]     print the composed, validated config (exit 2 if it cannot work)
    easytrain run [overrides...]        same as python -m easytrain.main [overrides...]
    easytrain plan [--fit] [--format table|json] [overrides...]
                                        memory per role and phase, per GPU and node; what to change

Overrides are Hydra's: ``+exp=qwen25vl_7b worker.rollout.n=8``.
"""

from __future__ import annotations

import argparse
import sys
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

    config = to_config(compose(with_default_preset(args.overrides)))  # the plan itself reports what does not fit
    sys.stdout.write(plan_command(config, args.format, args.fit) + "\n")
    return 0


COMMANDS = {"config": _config, "run": _run}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="easytrain", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
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
        code = _plan(args) if args.command == "plan" else COMMANDS[args.command](args.overrides)
    except ConfigError as err:
        sys.stderr.write(f"easytrain {args.command}: config error: {err}\n")
        code = 2
    sys.exit(code)


if __name__ == "__main__":
    main()
