#!/usr/bin/env bash
# The whole suite as `make test` runs it (CI runs exactly that): the control plane's Go build (many
# minutes on a fresh machine, a no-op when cached) in the background beside the Python install and the
# tests that need no control plane; then pytest over RLHF_TEST_WORKERS workers (default 4: most tests
# wait on processes, controllers and pods more than they compute; e2e/parallel.py says what runs where).
# Each phase's wall time goes to $RLHF_SUITE_TIMES, which the suite's report (e2e/report.py) prints.
# Arguments go to pytest: tests/run.sh -k multipod
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
cache=${RLHF_CACHE:-$HOME/.cache/rlhf-operator}
mkdir -p "$cache"
# A fresh machine's run keeps about 20 GB here (the venv ~7.5, the images ~8, models and binaries ~1) and Go's
# modules ~3 GB in GOPATH; one that fills the disk errors everywhere at once (the report's last lines say how low
# free space went).
free_gb=$(df -P -BG "$cache" | awk 'NR == 2 { print int($4) }')
(( free_gb >= 30 )) || echo "warning: ${free_gb} GB free where $cache is; a run with empty caches needs about 30 GB (free some, or set RLHF_CACHE to a roomier disk)" >&2
export RLHF_SUITE_TIMES=$cache/suite-times.txt
: > "$RLHF_SUITE_TIMES"

timed() { # timed NAME COMMAND...: run it, append "NAME seconds" to RLHF_SUITE_TIMES
  local name=$1 start=$SECONDS status
  shift
  "$@"; status=$?
  echo "$name $((SECONDS - start))" >> "$RLHF_SUITE_TIMES"
  return $status
}

# On a fresh machine the install, the control plane's build and the images' are the critical path
# (everything waits for the install, the e2e tests for the control plane, the longest unit, the pod
# runtime's group, for the images too): all three start at once at normal priority; what only some tests
# use (Kueue, helm, promtool) and the tests themselves niced. The images need nothing of the venv (the
# system's Python runs e2e.images; its RUN steps have a pip cache of their own); the tests' own build of
# them then finds them made, or waits for this one.
echo "control plane build (if needed) in the background: $cache/build.log" >&2
{ NICE= timed "control-plane build" e2e/build/build.sh control-plane
  timed "tools build (kueue, helm, promtool)" e2e/build/build.sh tools; } > "$cache/build.log" 2>&1 &
build=$!
echo "images build (if needed) in the background: $cache/images-build.log" >&2
timed "images build" python3 -m e2e.images > "$cache/images-build.log" 2>&1 &
images=$!
timed install bash requirements/install.sh >&2 || exit
nice -n 10 .venv/bin/python -m pytest -n "${RLHF_TEST_WORKERS:-4}" --dist loadscope "$@"
status=$?
wait "$build" "$images"
exit $status
