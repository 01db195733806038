#!/usr/bin/env bash
# Re-render rayjob.yaml and raycluster.yaml in this folder from the config (tests/test_kuberay.py checks
# the checked-in files equal what the code renders now):
#
#   bash launcher/kuberay/render.sh                    # the qwen25vl_7b preset, as checked in
#   bash launcher/kuberay/render.sh +exp=qwen25vl_7b trainer.nnodes=2 launch.image=REGISTRY/easytrain:TAG
#
# For a one-off run prefer `easytrain submit --kuberay --dry-run [overrides]` (prints the RayJob) or
# `easytrain submit --kuberay [overrides]` (creates it).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
py="${EASYTRAIN_PYTHON:-$here/.venv/bin/python}"
[ -x "$py" ] || py="$(command -v python3)"
if [ "$#" -eq 0 ]; then
  set -- +exp=qwen25vl_7b
  # Ray's kill threshold comes from the environment the manifests are rendered in (the one the watchdog's
  # thresholds are checked against); the checked-in files use Ray's default.
  unset RAY_memory_usage_threshold
fi
cd "$here"
exec "$py" -m easytrain.launch.kuberay --out launcher/kuberay "$@"
