#!/usr/bin/env bash
# Runs a command while busy processes compete with it for the CPUs, as on a loaded machine or
# a shared CI runner: tests that race a signal, a timeout or another process must still pass.
#   bash scripts/underload.sh CMD [ARGS...]
# UNDER_LOAD_PROCS busy processes (default 2), each stopped after UNDER_LOAD_MAX_S seconds at
# the latest (default 3600) and in any case when CMD ends, fails or is interrupted (Ctrl-C).
# The exit status is CMD's.
set -uo pipefail
procs=${UNDER_LOAD_PROCS:-2}
max_s=${UNDER_LOAD_MAX_S:-3600}
busy=()

stop_busy() {
  local pid
  for pid in "${busy[@]}"; do
    kill "$pid" 2>/dev/null
  done
  for pid in "${busy[@]}"; do
    wait "$pid" 2>/dev/null
  done
  busy=()
}
trap stop_busy EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

for _ in $(seq "$procs"); do
  timeout "$max_s" bash -c 'while :; do :; done' &
  busy+=("$!")
done
echo "under load: ${#busy[@]} busy processes (pids ${busy[*]}), at most ${max_s}s" >&2
"$@"
