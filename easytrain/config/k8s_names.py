"""Kubernetes naming rules that ``launch.*`` values must follow (KubeRay and the API server refuse other names).

Validation checks the config against them; :mod:`easytrain.launch.kuberay` derives names that satisfy them.
"""

from __future__ import annotations

import re

DNS_LABEL = re.compile(r"[a-z]([-a-z0-9]*[a-z0-9])?")
"""A Kubernetes DNS-1035 label (names of RayJobs and RayClusters; KubeRay refuses other names)."""
DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
"""A Kubernetes DNS-1123 subdomain (names of Secrets and PersistentVolumeClaims)."""
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
SECRET_KEY = re.compile(r"[-._a-zA-Z0-9]+")
RAYJOB_NAME_MAX = 47
"""KubeRay appends '-xxxxx' to a RayJob's name for its cluster and '-serve-svc' style suffixes to that."""
SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIALS")


def looks_secret(name: str) -> bool:
    """Whether an environment variable name looks like it holds a credential (HF_TOKEN, WANDB_API_KEY, ...)."""
    words = name.upper().split("_")
    return any(w in SECRET_WORDS for w in words) or words[-1] == "KEY"
