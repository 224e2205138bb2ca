"""The README's default run (`relay train`, seed 0), run once for two checks: it learns, syncs every step and logs
everything (the checks of test_train_e2e.py's runs), and its figures stay in the bands that seeds 1-10 of the same
run drew (the metric-history gate: tests/metric_bands/grpo_tiny_cpu.json, scripts/metric_gate.py). A change that
moves what the default run learns, how far it drifts from the reference, or how exactly the engines hold the
learner's weights fails the gate, naming the figure, the steps, the band and the value."""

import shutil
import subprocess
import sys

import pytest

from orchestrator.config.load import load_config
from orchestrator.data.builtin_models import builtin_folder
from tests.e2e.orchestrator.test_train_e2e import learned_synced_and_logged
from tests.helpers import REPO, relay

pytestmark = pytest.mark.e2e
BANDS = REPO / "tests" / "metric_bands" / "grpo_tiny_cpu.json"


@pytest.fixture(scope="module")
def default_run(policy, tmp_path_factory):
    """The README's main command, in a run root of its own: its run folder and its saved config."""
    root = tmp_path_factory.mktemp("default")
    # the starting policy the default builds under run_root/models: the tests' copy, which the bands started from
    shutil.copytree(policy, builtin_folder("builtin://tiny-addition-gpt", str(root)))
    out = relay("train", f"run_root={root}", "logging.progress_bar=false", "logging.wandb.mode=disabled", timeout=1800)
    assert out.returncode == 0, out.stderr[-3000:]
    run = root / "grpo_tiny_cpu"
    return run, load_config(run / "config.yaml")


def test_the_default_run_learns_syncs_every_step_and_logs_everything(default_run):
    run, cfg = default_run
    assert cfg.name == "grpo_tiny_cpu" and cfg.total_steps == 25 and cfg.algorithm.estimator.value == "grpo"
    assert [(s.name, s.size) for s in cfg.eval.suites] == [("addition_3digit", 32)]  # reported apart: checked below
    learned_synced_and_logged(run, cfg)


def test_the_default_run_stays_in_the_bands_its_seeds_drew(default_run):
    run, _ = default_run
    gate = subprocess.run(
        [sys.executable, "scripts/metric_gate.py", "check", str(BANDS), str(run)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert gate.returncode == 0, gate.stderr
