#!/usr/bin/env bash
# relay's tests, tier by tier, each timed (what .ci/run runs; the README's full test command):
#   tests/unit  CPU, no Ray: math, config, data, sweeps, pure logic (under 2 minutes)
#   tests/e2e   real Ray, vLLM and DeepSpeed on tiny models (each worker has its own Ray cluster, and a
#               file's tests share one worker and its module's runs: --dist loadfile)
#   tests/gpu   scripts/gpu_check.py's checks on CUDA (skipped without a device)
# unit and e2e run in RELAY_TEST_WORKERS pytest-xdist workers (default 2, one per core of the smallest machine).
# A failing tier stops the run. Extra arguments go to every tier's pytest (e.g. -x).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
start=$SECONDS
# the machine's float32 matmul rate first, so test times from machines of this kind can be compared
"$py" -c 'from bench.learner import matmul_peak_flops as f; print(f"float32 matmul: {f() / 1e9:.0f} GFLOP/s")'
tier() {
  local name=$1 began=$SECONDS rc=0
  shift
  "$py" -m pytest -q --durations=15 "tests/$name" "$@" || rc=$?
  echo "tests/$name: $((SECONDS - began)) s"
  return $rc
}
workers=${RELAY_TEST_WORKERS:-2}
tier unit -n "$workers" "$@"
tier e2e -n "$workers" --dist loadfile "$@"
tier gpu "$@"
echo "tests: $((SECONDS - start)) s in all"
