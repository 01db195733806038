"""Preemption and the way back: SIGTERM asks the trainer to save and stop; a failed run says how to resume.

Kubernetes stops a pod with SIGTERM and kills it after the grace period
(``terminationGracePeriodSeconds``), so the trainer saves at the end of the
current step and exits with 143 (128 + SIGTERM). The grace period must cover
one step plus one checkpoint write; a second SIGTERM exits at once.
"""

from __future__ import annotations

import logging
import shlex
import signal
import sys
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from easytrain.config.schema import Config

logger = logging.getLogger(__name__)

EXIT_STOPPED = 128 + signal.SIGTERM
"""Exit code after a SIGTERM-requested save: what a killed process reports, so a RayJob retries it."""


@contextmanager
def stop_on_sigterm(request_stop: Callable[[str], None]) -> Iterator[None]:
    """While inside, the first SIGTERM calls ``request_stop("SIGTERM")``; a second one exits at once."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be installed from the main thread
        return
    previous = signal.getsignal(signal.SIGTERM)
    received = []

    def handler(signum: int, frame: Any) -> None:
        if received:
            logger.error("second SIGTERM: exiting without waiting for the checkpoint")
            sys.exit(EXIT_STOPPED)
        received.append(signum)
        request_stop("SIGTERM")

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def resume_hint(config: Config) -> str:
    """The command that continues this run from its latest checkpoint."""
    args = [a for a in sys.argv[1:] if not a.startswith(("hydra.run.dir=", "trainer.resume=",
                                                         "trainer.output_dir="))]
    command = ["python", "-m", "easytrain.main", *args, f"hydra.run.dir={config.trainer.output_dir}"]
    return "Resume with: " + " ".join(shlex.quote(a) for a in command)
