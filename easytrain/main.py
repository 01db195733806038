"""Run easytrain: compose the config with Hydra, validate it, start or join Ray, run.

    python -m easytrain.main                        # a tiny VL model, synthetic task, local Ray, CPU
    python -m easytrain.main +exp=qwen25vl_7b       # GRPO with the 7B preset (on a Ray cluster)
    python -m easytrain.main +exp=tiny_sft          # SFT of the tiny model on the synthetic task (CPU)
    python -m easytrain.main +exp=tiny hydra.run.dir=/tmp/run trainer.max_steps=2

Everything of a run lands in Hydra's run folder (``hydra.run.dir``):
``metrics.jsonl``, ``checkpoints/``, the composed config in ``.hydra/``.
A config that cannot work is reported in one line before anything starts
(exit code 2); ``easytrain config [overrides]`` prints the validated config.
Running the same command with the same ``hydra.run.dir`` resumes from the
latest checkpoint (``trainer.resume=auto``). Exit codes: 0 done, 2 bad config
or checkpoint, 3 workers died (the message gives the command to resume),
143 stopped by SIGTERM after saving.
"""

from __future__ import annotations

import errno
import logging
import sys
from typing import TYPE_CHECKING, Sequence

import hydra
from omegaconf import DictConfig

from easytrain.config import (CONF_DIR, Config, ConfigError, compose, register_schema, to_config, validate,
                              with_default_preset)
from easytrain.config.paths import check_local_paths
from easytrain.models.families.checks import check_family
from easytrain.models.shapes import hf_config_for, resolve_shape

if TYPE_CHECKING:
    from easytrain.trainer.base import Trainer

logger = logging.getLogger("easytrain")
EXIT_CONFIG_ERROR = 2
EXIT_RUN_FAILED = 3
"""Workers died more often than trainer.max_failures allows; the message gives the command to resume."""
EXIT_MEMORY = 4
"""The memory watchdog saw its hard threshold: a checkpoint was saved and the run stopped."""

register_schema()


def resolve(cfg: DictConfig, local_paths: bool = True) -> Config:
    """Typed, validated config, including the checks that need the model's shape and (``local_paths``) that the
    files and folders it names are on this machine (off where the run starts elsewhere: ``easytrain submit``)."""
    config = to_config(cfg)
    if local_paths:
        check_local_paths(config)
    validate(config, resolve_shape(config.model))
    check_family(config, hf_config_for(config.model))
    return config


def fail(err: ConfigError, prog: str = "easytrain") -> None:
    """Report a config error in one line and exit 2."""
    sys.stderr.write(f"{prog}: config error: {err}\n")
    sys.exit(EXIT_CONFIG_ERROR)


def run(config: Config) -> dict[str, float]:
    """Start or join Ray and run the trainer for ``trainer.task``; returns the final validation metrics."""
    from easytrain.distributed.cluster import check_cluster_fits, check_local_gpus, init_ray
    from easytrain.memory.report import check_before_launch
    from easytrain.trainer.checkpoint import check_resume
    from easytrain.trainer.data import launch_profile

    logger.info("run folder: %s", config.trainer.output_dir)
    check_local_gpus(config)
    check_before_launch(config, launch_profile(config))
    check_resume(config)
    init_ray(config.ray)
    check_cluster_fits(config)
    if config.trainer.task == "sft":
        from easytrain.trainer.sft import SFTTrainer

        trainer: Trainer = SFTTrainer(config)
    else:
        from easytrain.trainer.rl import RLTrainer

        trainer = RLTrainer(config)
    try:
        result = trainer.fit()
    except BaseException:
        try:  # what failed is what the user must read: a close that fails after it (a full disk) only logs
            trainer.close()
        except Exception:  # noqa: BLE001
            logger.exception("closing the run after its failure failed too")
        raise
    trainer.close()
    return result


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def _hydra_main(cfg: DictConfig) -> None:
    from easytrain.data.sources import DataError
    from easytrain.memory.report import PlanDoesNotFit
    from easytrain.distributed.group import WorkerError
    from easytrain.distributed.resources import ResourceError
    from easytrain.trainer.checkpoint import CheckpointError
    from easytrain.trainer.base import RunFailed, Stopped
    from easytrain.trainer.signals import EXIT_STOPPED, resume_hint

    try:
        config = resolve(cfg)
        run(config)
    except ConfigError as err:
        fail(err)
    except Stopped as err:
        logger.warning("%s. %s", err, resume_hint(config))
        sys.exit(EXIT_MEMORY if err.reason.startswith("memory") else EXIT_STOPPED)
    except RunFailed as err:
        sys.stderr.write(f"easytrain: run failed: {err}\n")
        sys.exit(EXIT_RUN_FAILED)
    except OSError as err:
        if err.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        sys.stderr.write(f"easytrain: run failed: no space left writing {err.filename or 'a file'}: free space "
                         f"there and resume. {resume_hint(config)}\n")
        sys.exit(EXIT_RUN_FAILED)
    except CheckpointError as err:
        sys.stderr.write(f"easytrain: checkpoint error: {err}\n")
        sys.exit(EXIT_CONFIG_ERROR)
    except WorkerError as err:  # a worker raised (not a death, which fit() handles)
        logger.exception("worker error")
        sys.stderr.write(f"easytrain: {err}\n")
        sys.exit(1)
    except ResourceError as err:  # the cluster cannot hold the worker groups' bundles
        sys.stderr.write(f"easytrain: {err}\n")
        sys.exit(EXIT_CONFIG_ERROR)
    except PlanDoesNotFit as err:
        sys.stderr.write(f"easytrain: {err}\n")
        sys.exit(EXIT_CONFIG_ERROR)
    except DataError as err:
        sys.stderr.write(f"easytrain: data error: {err}\n")
        sys.exit(EXIT_CONFIG_ERROR)


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    flags = [a for a in args if a.startswith("-")]
    args = flags + with_default_preset([a for a in args if not a.startswith("-")])
    if not flags:
        # Hydra reports composition errors as multi-line text with exit code 1;
        # compose once here so a bad config is one line and exit code 2.
        try:
            resolve(compose(args))
        except ConfigError as err:
            fail(err)
    sys.argv = [sys.argv[0], *args]
    _hydra_main()


if __name__ == "__main__":
    main()
