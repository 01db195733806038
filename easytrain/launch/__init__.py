"""Launching a run on a cluster.

- :mod:`easytrain.launch.jobs`: a Ray cluster you already have, through Ray's Job Submission SDK
  (``easytrain submit``, ``status``, ``logs``, ``stop``).
- :mod:`easytrain.launch.kuberay`: Kubernetes through KubeRay: RayJob and RayCluster manifests rendered from
  the composed config (``easytrain submit --kuberay [--dry-run]``).

``launcher/`` holds the rendered manifests for the ``qwen25vl_7b`` preset and the multi-node script for
clusters started by hand (``ray start``).
"""
