#!/usr/bin/env bash
# One entry point for a fresh machine with only Python 3.11+:
#   bash scripts/dev.sh demo   - set up .venv, run the end-to-end demo on a local root
#   bash scripts/dev.sh test   - set up .venv, run ruff, mypy and the whole test suite
#       [--under-load]           ... with two busy processes competing for the CPUs (scripts/underload.sh)
#       [pytest args]            ... passed on to pytest (e.g. a test file)
#   bash scripts/dev.sh lock   - re-resolve the test environment from pyproject.toml into constraints.txt
# The test environment is pinned by constraints.txt (users of the package still get the ranges in
# pyproject.toml), so CI results do not drift with the package index.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

setup() {
  if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
  fi
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -c constraints.txt -e ".[dev]"
}

lock() {
  local tmp
  tmp=$(mktemp -d)
  "$PY" -m venv "$tmp/venv"
  "$tmp/venv/bin/python" -m pip install --quiet --upgrade pip
  "$tmp/venv/bin/python" -m pip install --quiet -e ".[dev]"
  {
    echo "# Pinned test environment: every package 'bash scripts/dev.sh test' installs, at the versions CI ran."
    echo "# Users still get the ranges in pyproject.toml. Refresh deliberately with: bash scripts/dev.sh lock"
    "$tmp/venv/bin/python" -m pip freeze --exclude-editable | grep -vi '^jaxckpt' | sort -f
  } > constraints.txt
  rm -rf "$tmp"
  echo "constraints.txt: $(grep -vc '^#' constraints.txt) packages; run 'bash scripts/dev.sh test' before committing it"
}

case "${1:-}" in
  demo)
    setup
    shift
    .venv/bin/python scripts/demo.py "$@"
    ;;
  test)
    setup
    shift
    load=()
    args=()
    for arg in "$@"; do
      if [ "$arg" = --under-load ]; then
        load=(bash scripts/underload.sh)
      else
        args+=("$arg")
      fi
    done
    .venv/bin/ruff format --check jaxckpt tests scripts
    .venv/bin/ruff check jaxckpt tests scripts
    .venv/bin/mypy
    # Two workers, a test file per worker at a time (module fixtures start once per file).
    "${load[@]}" .venv/bin/python -m pytest -p no:cacheprovider -n 2 --dist loadfile "${args[@]}"
    ;;
  lock)
    lock
    ;;
  *)
    echo "usage: bash scripts/dev.sh {demo|test|lock} [args]" >&2
    exit 2
    ;;
esac
