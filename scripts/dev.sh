#!/usr/bin/env bash
# One entry point for a fresh machine with only Python 3.11+:
#   bash scripts/dev.sh demo   - set up .venv, run the end-to-end demo on a local root
#   bash scripts/dev.sh test   - set up .venv, run ruff, mypy and the whole test suite
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

setup() {
  if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
  fi
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e ".[dev]"
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
    .venv/bin/ruff format --check jaxckpt tests scripts
    .venv/bin/ruff check jaxckpt tests scripts
    .venv/bin/mypy
    .venv/bin/python -m pytest -p no:cacheprovider "$@"
    ;;
  *)
    echo "usage: bash scripts/dev.sh {demo|test} [args]" >&2
    exit 2
    ;;
esac
