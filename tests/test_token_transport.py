"""The Ray token goes only to https:// or to this machine (issue 25, item 11).

Before, ``easytrain submit/status/logs/stop`` put the token in the headers of whatever address it was given
(``--address``, or a stray ``RAY_ADDRESS``), plain http to another host included, and the driver joined a
``ray://`` Ray Client address the same way. Now each refuses in one line (exit 2) before any request, naming
the address, where it came from and what to do, unless the user says the network is trusted.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from easytrain.config import ConfigError
from easytrain.distributed.token import INSECURE_ENV, InsecureAddress
from easytrain.launch import jobs

ROOT = Path(__file__).resolve().parents[1]


class FakeClient:
    """Stands in for Ray's JobSubmissionClient (whose constructor already sends a request with the headers)."""

    made: list[tuple[str, Any]] = []

    def __init__(self, address: str, headers: Any = None) -> None:
        FakeClient.made.append((address, headers))

    def submit_job(self, **job: Any) -> str:
        return "raysubmit_fake"


@pytest.fixture
def token(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    import ray.job_submission

    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("RAY_AUTH_TOKEN", "tok-123")
    for name in ("RAY_ADDRESS", "RAY_AUTH_TOKEN_PATH", INSECURE_ENV, "RAY_USE_TLS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", FakeClient)
    FakeClient.made = []
    return "tok-123"


@pytest.mark.parametrize("address", ["http://10.0.0.5:8265", "http://head.example.com:8265", "10.0.0.5:8265",
                                     "http://[fd00::1]:8265", "http://128.0.0.1:8265", "http://localhost.evil.com"])
def test_the_token_is_not_sent_in_the_clear_to_another_host(token: str, address: str) -> None:
    with pytest.raises(InsecureAddress) as err:
        jobs.client(address)
    message = str(err.value)
    assert "\n" not in message and f"to {address} (from --address)" in message
    assert "https://" in message and "ssh -N -L 8265:localhost:8265" in message and "--insecure-http" in message
    assert FakeClient.made == []  # nothing was sent


@pytest.mark.parametrize("address", ["http://127.0.0.1:8265", "http://127.4.5.6:8265", "http://localhost:8265",
                                     "http://[::1]:8265", "http://[::ffff:127.0.0.1]:8265", "https://head.example.com",
                                     "https://10.0.0.5:8265"])
def test_loopback_and_https_get_the_token(token: str, address: str) -> None:
    jobs.client(address)
    assert FakeClient.made == [(address, {"Authorization": f"Bearer {token}"})]


@pytest.mark.parametrize("name", ["RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"])
def test_the_address_given_is_the_one_rays_sdk_uses(token: str, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Ray's SDK prefers RAY_API_SERVER_ADDRESS, then RAY_ADDRESS, to the address it is given (its
    get_address_for_submission_client); ``--address`` must win over a stray variable (the fresh-clone CI's
    failure: RAY_ADDRESS=local sent the submit to a GCS that does not exist)."""
    from ray.dashboard.utils import get_address_for_submission_client

    resolved: list[str] = []

    class ResolvingClient(FakeClient):
        def __init__(self, address: str, headers: Any = None) -> None:
            resolved.append(get_address_for_submission_client(address))  # what Ray's own constructor does first
            super().__init__(address, headers)

    import ray.job_submission

    monkeypatch.setattr(ray.job_submission, "JobSubmissionClient", ResolvingClient)
    monkeypatch.setenv(name, "http://127.0.0.1:1")
    jobs.client("http://127.0.0.1:8265")
    assert resolved == ["http://127.0.0.1:8265"]
    assert os.environ[name] == "http://127.0.0.1:1"  # put back for whatever runs next


def test_a_stray_ray_address_is_named(token: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RAY_ADDRESS", "http://10.9.8.7:8265")
    with pytest.raises(InsecureAddress, match=r"to http://10.9.8.7:8265 \(from RAY_ADDRESS\)"):
        jobs.client(None)
    assert FakeClient.made == []


def test_the_user_may_say_the_network_is_trusted(token: str, monkeypatch: pytest.MonkeyPatch) -> None:
    jobs.client("http://10.0.0.5:8265", insecure_http=True)
    monkeypatch.setenv(INSECURE_ENV, "1")
    jobs.client("http://10.0.0.6:8265")
    assert [a for a, _ in FakeClient.made] == ["http://10.0.0.5:8265", "http://10.0.0.6:8265"]


def test_no_token_nothing_to_protect(token: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RAY_AUTH_TOKEN")
    jobs.client("http://10.0.0.5:8265")
    assert FakeClient.made == [("http://10.0.0.5:8265", None)]


def test_the_cli_refuses_in_one_line_with_exit_2(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "RAY_AUTH_TOKEN": "tok-123"}
    done = subprocess.run([sys.executable, "-m", "easytrain.cli", "status", "raysubmit_x", "--address",
                           "http://10.0.0.5:8265"], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("easytrain status: refusing to send the Ray auth token")
    assert "--insecure-http" in lines[0] and "Traceback" not in done.stderr


def test_submit_refuses_before_anything_is_sent(token: str, capsys: pytest.CaptureFixture[str],
                                                tmp_path: Path) -> None:
    from easytrain.cli import main

    with pytest.raises(SystemExit) as code:
        main(["submit", "--address", "http://10.0.0.5:8265", "+exp=tiny", f"hydra.run.dir={tmp_path}/run"])
    assert code.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("easytrain submit: refusing to send the Ray auth token")
    assert FakeClient.made == []
    with pytest.raises(SystemExit) as code:  # the flag lets it through
        main(["submit", "--insecure-http", "--address", "http://10.0.0.5:8265", "+exp=tiny",
              f"hydra.run.dir={tmp_path}/run"])
    assert code.value.code == 0
    assert [a for a, _ in FakeClient.made] == ["http://10.0.0.5:8265"]


def test_the_driver_does_not_join_a_remote_ray_client_address_in_the_clear(token: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    import ray

    from easytrain.config.schema import RayConfig
    from easytrain.distributed.cluster import check_client_address, init_ray

    joined: list[Any] = []
    monkeypatch.setattr(ray, "init", lambda *a, **k: joined.append((a, k)))
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # an earlier test's Ray may be up in this process
    monkeypatch.setenv("RAY_ADDRESS", "ray://10.0.0.5:10001")
    with pytest.raises(ConfigError) as err:
        init_ray(RayConfig())
    assert err.value.key == "RAY_ADDRESS" and "ssh -N -L 10001:localhost:10001 10.0.0.5" in str(err.value)
    assert "RAY_USE_TLS=1" in str(err.value) and "https://" not in str(err.value) and joined == []
    with pytest.raises(ConfigError, match=r"^ray.address='ray://head:10001': refusing"):
        init_ray(RayConfig(address="ray://head:10001"))
    check_client_address("ray://127.0.0.1:10001", "ray.address")  # a tunnel
    check_client_address("10.0.0.5:6379", "RAY_ADDRESS")  # the cluster's own network (Ray Jobs' drivers)
    check_client_address("auto", "RAY_ADDRESS")
    monkeypatch.setenv("RAY_USE_TLS", "1")
    check_client_address("ray://10.0.0.5:10001", "RAY_ADDRESS")
