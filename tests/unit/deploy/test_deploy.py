"""Deployment recipes: a real `ray job submit` against a local head, and the cluster files checked."""

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import yaml

from orchestrator.load_config import load_config
from rollout.weight_sync import free_port

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))


def configs_named_in(text: str) -> list[str]:
    return sorted(set(re.findall(r"configs/[\w.\-]+\.yaml", text)))


@pytest.mark.parametrize("name", ["README.md", "kuberay-rayjob.yaml", "slurm.sbatch"])
def test_every_config_a_recipe_names_exists_and_loads(name):
    found = configs_named_in((REPO / "deploy" / name).read_text())
    assert found, name
    for path in found:
        assert load_config(REPO / path, ["cluster.address=auto"]).cluster.address == "auto"


def test_kuberay_manifest_is_a_rayjob():
    job = yaml.safe_load((REPO / "deploy" / "kuberay-rayjob.yaml").read_text())
    assert job["kind"] == "RayJob" and job["apiVersion"].startswith("ray.io/")
    assert job["spec"]["entrypoint"].startswith("relay train configs/")
    workers = job["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    assert workers[0]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"]


def test_slurm_script_parses():
    assert subprocess.run(["bash", "-n", str(REPO / "deploy" / "slurm.sbatch")]).returncode == 0


@pytest.mark.e2e
def test_ray_job_submit_runs_two_steps_on_a_local_head(policy, tmp_path):
    env = dict(os.environ, RAY_AUTH_MODE="disabled", PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    port, dash = free_port(), free_port()
    ray_tmp = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    start = subprocess.run(
        [
            RAY,
            "start",
            "--head",
            f"--port={port}",
            f"--dashboard-port={dash}",
            "--num-cpus=2",
            f"--temp-dir={ray_tmp}",
            "--include-dashboard=true",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert start.returncode == 0, start.stderr
    try:
        entry = (
            f"{sys.executable} -m orchestrator.cli train configs/grpo_tiny_cpu.yaml cluster.address=auto "
            f"total_steps=2 learner.model_path={policy} run_root={tmp_path / 'runs'} logging.wandb.mode=disabled "
            "data.rollout_batch_size=16 algorithm.mini_batch_size=64 algorithm.micro_batch_size=64 data.eval_size=16"
        )
        job = subprocess.run(
            [
                RAY,
                "job",
                "submit",
                f"--address=http://127.0.0.1:{dash}",
                "--working-dir",
                str(REPO),
                "--",
                *entry.split(),
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            cwd=REPO,
        )
        assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
        assert "succeeded" in job.stdout
        assert "step 2/2" in job.stdout and "held-out" in job.stdout
        assert (tmp_path / "runs" / "grpo_tiny_cpu" / "checkpoints" / "step_2" / "orchestrator.json").exists()
    finally:
        subprocess.run([RAY, "stop", "--force"], env=env, capture_output=True, timeout=120)
