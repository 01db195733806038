"""A Ray pod's preStop hook on KubeRay: stop the run so it saves, and keep the pod alive while it does.

Kubernetes stops a RayJob's pods together: SIGTERM to each pod's first process (``ray start``), SIGKILL after
``terminationGracePeriodSeconds``. Without a hook the Ray node would go down under the driver and the workers
before the current step is saved. The head's hook (``python -m easytrain.launch.prestop``) asks Ray's job
supervisor to stop every running job: the driver gets SIGTERM, saves its current step and exits
(:mod:`easytrain.trainer.signals`); the worker pods' hook (``--wait-only``) keeps their Ray nodes up until no job
runs. Both give up ``EASYTRAIN_STOP_GRACE_S`` (``launch.stop_grace_s``) after they started, before the kubelet
would kill the pod.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import Any, Optional, Sequence

from easytrain.launch.jobs import TERMINAL, client

logger = logging.getLogger("easytrain.prestop")
DASHBOARD_PORT = 8265


def running(jobs: Any) -> list[Any]:
    return [j for j in jobs.list_jobs() if str(getattr(j.status, "value", j.status)) not in TERMINAL]


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--wait-only", action="store_true", help="a worker pod: wait for the jobs, stop none")
    parser.add_argument("--address", default=None, help="the dashboard (default: this pod's head, KubeRay's FQ_RAY_IP)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    grace = float(os.environ.get("EASYTRAIN_STOP_GRACE_S", "900"))
    deadline = time.monotonic() + max(0.0, grace - 5.0)
    head = os.environ.get("FQ_RAY_IP", "127.0.0.1") if args.wait_only else "127.0.0.1"
    address = args.address or f"http://{head}:{DASHBOARD_PORT}"
    try:
        # a worker pod asks the head over the pod network, which the Ray nodes' own traffic (with the same token)
        # already crosses unencrypted: plain http there is no new exposure
        jobs = client(address, insecure_http=True)
        active = running(jobs)
    except (SystemExit, Exception) as err:  # noqa: BLE001 - no dashboard: nothing to wait for
        logger.info("no Ray dashboard at %s (%s): nothing to stop", address, err)
        return 0
    if not args.wait_only:
        for job in active:
            logger.info("stopping job %s so that it saves its current step", job.submission_id)
            jobs.stop_job(job.submission_id)
    while active and time.monotonic() < deadline:
        time.sleep(2.0)
        active = running(jobs)
    if active:
        logger.warning("jobs still running after %.0f s: %s", grace, ", ".join(j.submission_id for j in active))
    return 0


if __name__ == "__main__":
    sys.exit(main())
