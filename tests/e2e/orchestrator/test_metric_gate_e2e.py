"""The metric-history gate: the README's default run (`relay train`, seed 0) against the bands that seeds 1-10 of
the same run drew (tests/metric_bands/grpo_tiny_cpu.json, scripts/metric_gate.py). A change that moves what the
default run learns, how far it drifts from the reference, or how exactly the engines hold the learner's weights
fails here, naming the figure, the steps, the band and the value."""

import shutil
import subprocess
import sys

import pytest

from orchestrator.data.builtin_models import builtin_folder
from tests.helpers import REPO, relay

pytestmark = pytest.mark.e2e
BANDS = REPO / "tests" / "metric_bands" / "grpo_tiny_cpu.json"


def test_the_default_run_stays_in_the_bands_its_seeds_drew(policy, tmp_path):
    # the starting policy the default builds under run_root/models: the tests' copy, which the bands started from
    shutil.copytree(policy, builtin_folder("builtin://tiny-addition-gpt", str(tmp_path)))
    out = relay(
        "train", f"run_root={tmp_path}", "logging.progress_bar=false", "logging.wandb.mode=disabled", timeout=1800
    )
    assert out.returncode == 0, out.stderr[-3000:]
    gate = subprocess.run(
        [sys.executable, "scripts/metric_gate.py", "check", str(BANDS), str(tmp_path / "grpo_tiny_cpu")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert gate.returncode == 0, gate.stderr
