"""scripts/gpu_check.py on the CPU (gloo, float32, small shapes): the script a GPU machine runs is
itself tested here, so a lent GPU is spent on figures, not on fixing the script."""

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.e2e


def test_gpu_check_runs_every_section_on_the_cpu():
    out = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--device", "cpu", "--quick"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    by = {(r["section"], r.get("zero_stage")): r for r in rows}
    # the entropy (~6.9 nats here) is p log p over x - lse where the unchunked core uses log_softmax: float32 rounding
    assert by[("logprobs", None)]["max_diff_logprobs"] < 1e-6 and by[("logprobs", None)]["max_diff_entropy"] < 1e-5
    assert by[("scoring", None)]["max_diff_vs_cpu_float32"] < 1e-5
    assert by[("sync", None)]["backend"] == "gloo" and by[("sync", None)]["arrived"]
    for zero in (0, 2):
        learner = by[("learner", zero)]
        assert learner["tokens_per_s"] > 0 and learner["surrogate_after"] > learner["surrogate_before"], learner
    scale = by[("scale", None)]  # the realistic-size learner, small here: it runs, and counts what it timed
    assert scale["tokens_per_s"] > 0 and scale["tokens_per_sequence"] == 32 and scale["sequences"] == 8, scale
    yard = by[("yardstick", None)]  # relay beside the plain loop, on the same small model and batch
    assert yard["shape"] == "small" and yard["sequences"] == 8 and yard["tokens"] > 8 * 12, yard
    assert yard["update_ratio"] > 0 and yard["reference_ratio"] > 0, yard
