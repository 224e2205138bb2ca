#!/usr/bin/env bash
# GPU checks: the paths that need neither vLLM nor Ray (scripts/gpu_check.py), then, with --full and
# the GPU install (scripts/install.sh gpu), the default run on GPUs. Figures go to docs/gpu.md.
# (`pytest tests/gpu`, the gpu tier, runs the same script and checks each section's figures.)
#   bash scripts/gpu_check.sh            # learner, chunked logprobs, scoring, weight broadcast
#   bash scripts/gpu_check.sh --full     # and relay train on one GPU per role
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
"$py" scripts/gpu_check.py --device cuda
if [ "${1:-}" = "--full" ]; then
  "$py" -m orchestrator.cli train configs/grpo_tiny_cpu.yaml name=gpu_check rollout.dtype=bfloat16 \
    learner.dtype=bfloat16 cluster.gpus_per_rollout_worker=0.3 cluster.gpus_per_learner=0.3 \
    cluster.gpus_per_scoring=0.3 logging.wandb.mode=disabled
fi
