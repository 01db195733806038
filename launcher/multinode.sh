#!/usr/bin/env bash
# A multi-node Ray cluster started by hand (no Kubernetes), with Ray's token authentication on, and a run on it.
#
#   on the head node:     bash launcher/multinode.sh head
#   on every other node:  RAY_AUTH_TOKEN=... bash launcher/multinode.sh worker HEAD_IP
#   on the head node:     bash launcher/multinode.sh run +exp=qwen25vl_7b trainer.nnodes=2
#   anywhere:             bash launcher/multinode.sh status | stop
#
# Every node runs the same easytrain checkout and environment (bash scripts/install.sh gpu, or the
# docker/ image). The head also trains: trainer.nnodes counts it. Token authentication: `head` creates a
# token (~/.ray/auth_token) if there is none and prints how to hand it to the workers; workers read it from
# RAY_AUTH_TOKEN or their own ~/.ray/auth_token. Submitting from another machine instead of `run` (through
# a tunnel: easytrain refuses to send the token over plain http to another machine):
#   ssh -N -L 8265:localhost:8265 HEAD_IP &
#   RAY_AUTH_TOKEN=... easytrain submit --address http://127.0.0.1:8265 +exp=qwen25vl_7b trainer.nnodes=2
#
# Ray's memory monitor kills workers above RAY_memory_usage_threshold of a node's RAM; the watchdog's
# watchdog.ram_hard is validated against the same variable, so this script exports the value easytrain
# assumes (this environment's, else Ray's 0.95) on every node it starts.
#
# Environment: EASYTRAIN_PYTHON (default ./.venv/bin/python, else python3), RAY_PORT (6379),
# RAY_DASHBOARD_PORT (8265), NUM_GPUS (default: Ray detects them).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
py="${EASYTRAIN_PYTHON:-$here/.venv/bin/python}"
[ -x "$py" ] || py="$(command -v python3)"
ray_bin="$(dirname "$py")/ray"
[ -x "$ray_bin" ] || ray_bin="$(command -v ray)"
ray_cli() { "$ray_bin" "$@"; }
port="${RAY_PORT:-6379}"
dashboard_port="${RAY_DASHBOARD_PORT:-8265}"
gpus=()
[ -n "${NUM_GPUS:-}" ] && gpus=(--num-gpus "$NUM_GPUS")

export RAY_AUTH_MODE=token
RAY_memory_usage_threshold="$("$py" -c 'from easytrain.config.derived import ray_kill_threshold as t; print(t())')"
export RAY_memory_usage_threshold

usage() {
  sed -n '2,7p' "${BASH_SOURCE[0]}" >&2
  exit 2
}

have_token() {
  [ -n "${RAY_AUTH_TOKEN:-}" ] || [ -n "${RAY_AUTH_TOKEN_PATH:-}" ] || [ -s "$HOME/.ray/auth_token" ]
}

cmd="${1:-}"
shift || true
case "$cmd" in
  head)
    have_token || ray_cli get-auth-token --generate >/dev/null
    ray_cli start --head --port="$port" --dashboard-host=0.0.0.0 --dashboard-port="$dashboard_port" \
      "${gpus[@]}" "$@"
    ip="$("$py" -c 'from ray.util import get_node_ip_address; print(get_node_ip_address())')"
    cat >&2 <<EOF

Ray head up at $ip:$port (dashboard http://$ip:$dashboard_port), token authentication on,
RAY_memory_usage_threshold=$RAY_memory_usage_threshold. On every other node:
  copy ~/.ray/auth_token from this node to the same place there (or export RAY_AUTH_TOKEN), then
  bash launcher/multinode.sh worker $ip
Then here: bash launcher/multinode.sh run +exp=... trainer.nnodes=N
EOF
    ;;
  worker)
    [ "$#" -ge 1 ] || usage
    head="$1"
    shift
    case "$head" in *:*) ;; *) head="$head:$port" ;; esac
    if ! have_token; then
      echo "multinode.sh: no Ray token: copy ~/.ray/auth_token from the head, or export RAY_AUTH_TOKEN" \
           "(on the head: ray get-auth-token)" >&2
      exit 2
    fi
    ray_cli start --address="$head" "${gpus[@]}" "$@"
    ;;
  run)
    export RAY_ADDRESS="${RAY_ADDRESS:-auto}"  # the cluster this node belongs to, not a new local Ray
    cd "$here"
    exec "$py" -m easytrain.main "$@"
    ;;
  status)
    ray_cli status "$@"
    ;;
  stop)
    ray_cli stop "$@"
    ;;
  *)
    usage
    ;;
esac
