"""Runs on a Ray cluster you already have, through Ray's Job Submission SDK.

    easytrain submit [--address http://HEAD:8265] [--working-dir .] [--follow] [--no-wait] [overrides...]
    easytrain status JOB_ID | logs JOB_ID [--follow] | stop JOB_ID      [--address ...]

``submit`` composes and validates the config here first (a bad override is
reported before anything reaches the cluster), then submits
``python -m easytrain.main <overrides>`` with a runtime environment: the
working directory (uploaded by Ray, without virtualenvs, run outputs and
caches), ``launch.env_vars`` and ``launch.pip``. It prints the job id and the
dashboard URL and, with ``--follow``, streams the driver's log until the job
ends (exit 0 only when it SUCCEEDED).

The address is ``--address``, else ``RAY_ADDRESS``, else the local head's
dashboard (``http://127.0.0.1:8265``). Ray's token authentication stays on:
every request carries the cluster token from ``RAY_AUTH_TOKEN``,
``RAY_AUTH_TOKEN_PATH`` or ``~/.ray/auth_token`` (what ``ray start`` and
``ray get-auth-token`` use); a refused request says so. The token is a
bearer credential: it goes only to ``https://`` or to this machine (loopback:
``localhost``, ``127.0.0.0/8``, ``::1``, e.g. an SSH tunnel), else the
command stops before anything is sent, unless ``--insecure-http`` (or
``EASYTRAIN_INSECURE_HTTP=1``) says the network is trusted
(:mod:`easytrain.distributed.token`, which the driver's join of a Ray Client
address follows too).

The upload leaves out :data:`EXCLUDES`, the same list as the repository's
``.dockerignore`` (tests/test_upload_excludes.py checks both, and what Ray's
own packer leaves out).
"""

from __future__ import annotations

import asyncio
import os
import shlex
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence, TextIO

from easytrain.distributed.token import auth_token, check_token_transport


DEFAULT_ADDRESS = "http://127.0.0.1:8265"
SDK_ADDRESS_VARS = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")
EXCLUDES = [
    # local state, run outputs and caches (Ray caps a working_dir at a few hundred MB)
    ".venv", "venv", ".git", ".gitignore", ".ci", "outputs", "multirun", "runs", "checkpoints", "**/__pycache__",
    "**/*.pyc", "*.egg-info", "build", "dist", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".cache", ".ray",
    "**/*.safetensors", "**/*.pt", "**/*.bin", "**/*.ckpt", "bench/results/*.png", "**/events.out.tfevents.*",
    "**/wandb", "**/mlruns",
    # credentials
    ".env", "*.env", "**/auth_token",
]
"""What the upload of the working directory leaves out: exactly the patterns of the repository's .dockerignore
(tests/test_upload_excludes.py compares them line by line), read by Ray as gitignore patterns: one without a
``/`` (``.env``, ``runs``) matches at any depth, which leaves out more than Docker does, never less."""
UPLOAD_ONLY_EXCLUDES = [".gpu", ".probe"]
"""Left out of the upload only: scratch folders of local tools that the Docker build never sees."""
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
AGENT_WAIT_S = 120.0
"""How long ``submit`` waits for a just-started head's job agent (the dashboard answers first)."""


def address_of(address: Optional[str]) -> str:
    return address or os.environ.get("RAY_ADDRESS") or DEFAULT_ADDRESS


def address_source(address: Optional[str]) -> str:
    """Where :func:`address_of` takes the address from, as the user would name it."""
    if address:
        return "--address"
    return "RAY_ADDRESS" if os.environ.get("RAY_ADDRESS") else "the default"


@contextmanager
def ray_address_env_hidden() -> Iterator[None]:
    """Hide the address variables from Ray's SDK while it resolves an address: it prefers them to the address
    it is given, so a stray ``RAY_ADDRESS`` would send ``--address``'s job elsewhere."""
    saved = {name: os.environ.pop(name) for name in SDK_ADDRESS_VARS if name in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def client(address: Optional[str], *, insecure_http: bool = False) -> Any:
    """A Job Submission client for ``address`` (see the module docstring for the order of sources); an
    :class:`~easytrain.distributed.token.InsecureAddress` before any request when the token would go unencrypted
    to another machine."""
    where = address_of(address)
    check_token_transport(where, address_source(address), insecure_http=insecure_http)
    from ray.job_submission import JobSubmissionClient

    token = auth_token()
    headers = {"Authorization": f"Bearer {token}"} if token else None
    try:
        with ray_address_env_hidden():  # Ray's SDK lets RAY_ADDRESS / RAY_API_SERVER_ADDRESS override its argument
            return JobSubmissionClient(where, headers=headers)
    except Exception as err:  # noqa: BLE001 - the SDK raises ConnectionError, RuntimeError or its own
        raise SystemExit(f"easytrain: cannot reach the Ray dashboard at {where}: {err}. Start a head with "
                         "`ray start --head` (or see launcher/README.md), or pass --address http://HEAD:8265 / "
                         "set RAY_ADDRESS") from err


def dashboard_url(address: str, job_id: str) -> str:
    base = address if address.startswith("http") else f"http://{address}"
    return f"{base.rstrip('/')}/#/jobs/{job_id}"


def runtime_env(config: Any, working_dir: str) -> dict[str, Any]:
    """The job's runtime environment: the working directory, ``launch.env_vars`` and ``launch.pip``."""
    launch = getattr(config, "launch", None)
    env_vars = {str(k): str(v) for k, v in dict(getattr(launch, "env_vars", None) or {}).items()}
    env_vars.setdefault("TOKENIZERS_PARALLELISM", "false")
    # the job supervisor reads this from the job's runtime env: SIGTERM, then SIGKILL after this many seconds
    env_vars.setdefault("RAY_JOB_STOP_WAIT_TIME_S", str(getattr(launch, "stop_grace_s", 900)))
    env: dict[str, Any] = {"working_dir": working_dir, "excludes": EXCLUDES + UPLOAD_ONLY_EXCLUDES,
                           "env_vars": env_vars}
    pip = list(getattr(launch, "pip", None) or [])
    if pip:
        env["pip"] = pip
    return env


def entrypoint(overrides: Sequence[str]) -> str:
    return " ".join(["python", "-m", "easytrain.main", *(shlex.quote(o) for o in overrides)])


def submit(overrides: Sequence[str], address: Optional[str] = None, working_dir: str = ".", follow: bool = False,
           wait: bool = False, out: TextIO = sys.stdout, *, insecure_http: bool = False) -> int:
    """Validate the config, submit the run, print its id and dashboard URL; ``follow`` streams its log and
    ``wait`` polls until it ends; both return 0 only when it SUCCEEDED."""
    from easytrain.config import compose, with_default_preset
    from easytrain.main import resolve

    # ConfigError before anything is sent; the paths are checked by the job's driver, where they must be
    config = resolve(compose(with_default_preset(list(overrides))), local_paths=False)
    if not os.path.isabs(config.trainer.output_dir):
        from easytrain.config import ConfigError

        raise ConfigError("hydra.run.dir", config.trainer.output_dir, "a relative run folder lands in the copy of "
                          "the working directory Ray unpacks for the job (which Ray may delete, and which other nodes "
                          "do not see)", "give an absolute folder on storage every node shares, e.g. "
                          "hydra.run.dir=/shared/runs/NAME")
    if not os.path.isdir(working_dir):
        raise SystemExit(f"easytrain: --working-dir {working_dir!r} is not a directory")
    where = address_of(address)
    jobs = client(address, insecure_http=insecure_http)
    deadline = time.monotonic() + AGENT_WAIT_S
    while True:
        try:
            job_id = jobs.submit_job(entrypoint=entrypoint(overrides),
                                     runtime_env=runtime_env(config, os.path.abspath(working_dir)),
                                     metadata={"easytrain": "1", "experiment": str(config.trainer.experiment_name)})
            break
        except RuntimeError as err:  # a head just started: its job agent comes up seconds after the dashboard
            if "No available agent" not in str(err) or time.monotonic() > deadline:
                raise
            out.write("waiting for the head's job agent to start...\n")
            out.flush()
            time.sleep(2.0)
    out.write(f"submitted {job_id}\ndashboard: {dashboard_url(where, job_id)}\n"
              f"follow: easytrain logs {job_id} --follow --address {where}\n")
    out.flush()
    if follow:
        return logs(job_id, where, follow=True, out=out, insecure_http=insecure_http)
    if wait:
        return 0 if wait_for(job_id, where, insecure_http=insecure_http) == "SUCCEEDED" else 1
    return 0


def wait_for(job_id: str, address: Optional[str] = None, timeout: float = 24 * 3600.0,
             poll: float = 2.0, *, insecure_http: bool = False) -> str:
    """Poll until the job is SUCCEEDED, FAILED or STOPPED (or ``timeout``); returns the last status."""
    jobs, deadline = client(address, insecure_http=insecure_http), time.monotonic() + timeout
    while True:
        state = str(jobs.get_job_status(job_id).value)
        if state in TERMINAL or time.monotonic() > deadline:
            return state
        time.sleep(poll)


def status(job_id: str, address: Optional[str] = None, out: TextIO = sys.stdout, *,
           insecure_http: bool = False) -> int:
    info = client(address, insecure_http=insecure_http).get_job_info(job_id)
    out.write(f"{job_id}: {info.status.value}")
    if info.message:
        out.write(f" ({info.message})")
    out.write("\n")
    return 0


def logs(job_id: str, address: Optional[str] = None, follow: bool = False, out: TextIO = sys.stdout, *,
         insecure_http: bool = False) -> int:
    """The driver's log so far, or streamed until the job ends (``follow``; exit 0 only when it SUCCEEDED)."""
    jobs = client(address, insecure_http=insecure_http)
    if not follow:
        out.write(jobs.get_job_logs(job_id))
        return 0

    async def stream() -> None:
        async for chunk in jobs.tail_job_logs(job_id):
            out.write(chunk)
            out.flush()

    asyncio.run(stream())
    # the log ends a moment before the status flips
    state = wait_for(job_id, address, timeout=60.0, poll=0.5, insecure_http=insecure_http)
    out.write(f"{job_id}: {state}\n")
    return 0 if state == "SUCCEEDED" else 1


def stop(job_id: str, address: Optional[str] = None, out: TextIO = sys.stdout, *,
         insecure_http: bool = False) -> int:
    stopped = client(address, insecure_http=insecure_http).stop_job(job_id)
    out.write(f"{job_id}: {'stop requested' if stopped else 'already finished'}\n")
    return 0
