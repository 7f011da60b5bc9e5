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
export RLHF_SUITE_TIMES=$cache/suite-times.txt
: > "$RLHF_SUITE_TIMES"

timed() { # timed NAME COMMAND...: run it, append "NAME seconds" to RLHF_SUITE_TIMES
  local name=$1 start=$SECONDS status
  shift
  "$@"; status=$?
  echo "$name $((SECONDS - start))" >> "$RLHF_SUITE_TIMES"
  return $status
}

# On a fresh machine the install and the control plane's build are the critical path (everything waits
# for the install, the e2e tests for the build, and the other tests end well before it): both run at
# normal priority, what only some tests use (Kueue, helm, promtool) and the tests themselves niced.
echo "control plane build (if needed) in the background: $cache/build.log" >&2
{ NICE= timed "control-plane build" e2e/build/build.sh control-plane
  timed "tools build (kueue, helm, promtool)" e2e/build/build.sh tools; } > "$cache/build.log" 2>&1 &
build=$!
timed install bash requirements/install.sh >&2 || exit
nice -n 10 .venv/bin/python -m pytest -n "${RLHF_TEST_WORKERS:-4}" --dist loadscope "$@"
status=$?
wait "$build"
exit $status
