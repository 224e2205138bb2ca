#!/usr/bin/env bash
# relay's tests, tier by tier, each timed (what .ci/run runs; the README's full test command):
#   tests/unit  CPU, no Ray: math, config, data, sweeps, pure logic (under 2 minutes)
#   tests/e2e   real Ray, vLLM and DeepSpeed on tiny models
#   tests/gpu   scripts/gpu_check.py's checks on CUDA (skipped without a device)
# A failing tier stops the run. Extra arguments go to every tier's pytest (e.g. -x).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
start=$SECONDS
tier() {
  local name=$1 began=$SECONDS rc=0
  shift
  "$py" -m pytest -q --durations=15 "tests/$name" "$@" || rc=$?
  echo "tests/$name: $((SECONDS - began)) s"
  return $rc
}
tier unit "$@"
tier e2e "$@"
tier gpu "$@"
echo "tests: $((SECONDS - start)) s in all"
