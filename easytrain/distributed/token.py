"""Where Ray's auth token may travel: only encrypted, or to this machine.

The token is a bearer credential: whoever has it can run code on the cluster. The
job commands (:mod:`easytrain.launch.jobs`: ``easytrain submit``, ``status``,
``logs``, ``stop``) and the driver joining a Ray Client address
(:func:`easytrain.distributed.cluster.check_client_address`) refuse, before
anything is sent, to send it unencrypted to another host unless the user says
the network is trusted (``--insecure-http`` or ``EASYTRAIN_INSECURE_HTTP=1``).
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path
from typing import Optional
from urllib.parse import urlsplit

INSECURE_ENV = "EASYTRAIN_INSECURE_HTTP"
"""Set to 1 to send the token over plain http to a host that is not this machine (as ``--insecure-http``)."""


class InsecureAddress(ValueError):
    """The Ray token would travel unencrypted to another machine; one line naming the address and its source."""


def is_loopback(host: str) -> bool:
    """``localhost``, ``127.0.0.0/8``, ``::1`` (also IPv4-mapped): traffic that never leaves this machine."""
    host = host.strip("[]").lower()
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    mapped = getattr(ip, "ipv4_mapped", None)
    return bool(ip.is_loopback or (mapped is not None and mapped.is_loopback))


def auth_token() -> Optional[str]:
    """The cluster token, from where Ray's own tools read it: ``RAY_AUTH_TOKEN``, the file
    ``RAY_AUTH_TOKEN_PATH`` names, or ``~/.ray/auth_token`` (``ray start`` and ``ray get-auth-token --generate``
    write it there). The SDK sends it only in a process started with ``RAY_AUTH_MODE=token``; easytrain sends it
    whenever it is found (a cluster without authentication ignores the header)."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if path.is_file():
        return path.read_text().strip() or None
    if os.environ.get("RAY_AUTH_TOKEN_PATH"):
        raise SystemExit(f"easytrain: RAY_AUTH_TOKEN_PATH={path} is not a readable file")
    return None


def check_token_transport(address: str, source: str, *, insecure_http: bool = False, encrypted: bool = False,
                          opt_in: str = f"pass --insecure-http (or set {INSECURE_ENV}=1)") -> None:
    """Refuse, before anything is sent, to send the Ray token unencrypted (not ``https://``, and not
    ``encrypted`` by other means) to a host that is not this machine, unless ``insecure_http`` or
    ``EASYTRAIN_INSECURE_HTTP=1`` says the network is trusted (``opt_in`` tells the user how). No token found:
    nothing to protect."""
    if insecure_http or encrypted or os.environ.get(INSECURE_ENV, "").lower() in ("1", "true", "yes"):
        return
    parsed = urlsplit(address if "://" in address else f"http://{address}")
    host, port = parsed.hostname or "", parsed.port or (10001 if parsed.scheme == "ray" else 8265)
    if parsed.scheme == "https" or address in ("auto", "local") or is_loopback(host) or not auth_token():
        return
    local = f"{parsed.scheme}://127.0.0.1:{port}"
    raise InsecureAddress(
        f"refusing to send the Ray auth token in the clear to {address} (from {source}): {host} is not this "
        f"machine and {parsed.scheme}:// is unencrypted, so anyone on the path could take the token and run code "
        f"on the cluster; use {'' if parsed.scheme == 'ray' else 'an https:// address, or '}an SSH tunnel "
        f"(ssh -N -L {port}:localhost:{port} {host}, then {local}), or {opt_in} if you trust the network")
