"""Deployment recipes run: a real `ray job submit` of two training steps against a local head, with Ray's
token authentication on as deploy/README.md starts it (a submit without the token is refused)."""

import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from runtime.ports import free_port
from tests.helpers import RAY, REPO, RayNode

AGENT_TRIES = 10
NO_AGENT_YET = "No available agent to submit job"


def test_ray_job_submit_runs_two_steps_on_a_local_head(policy, tmp_path):
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    bare = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")} | {"RAY_ADDRESS": "", "PATH": path}
    env = bare | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}  # the recipe's token auth
    port, dash = free_port(), free_port()
    ray_tmp = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    head = RayNode(
        [
            "--head",
            f"--port={port}",
            f"--dashboard-port={dash}",
            "--num-cpus=2",
            f"--temp-dir={ray_tmp}",
            "--include-dashboard=true",
            # ports of its own: Ray's defaults (the job agent's 52365, the client server's 10001) may be held by
            # another cluster on the machine (a parallel test worker's), and a job agent without its port never
            # comes up
            f"--dashboard-agent-listen-port={free_port()}",
            f"--ray-client-server-port={free_port()}",
        ],
        env,
        tmp_path / "head.log",
    )
    try:
        entry = (
            f"{sys.executable} -m orchestrator.cli train configs/grpo_tiny_cpu.yaml cluster.address=auto "
            f"total_steps=2 learner.model_path={policy} run_root={tmp_path / 'runs'} logging.wandb.mode=disabled "
            "data.rollout_batch_size=16 algorithm.mini_batch_size=64 algorithm.micro_batch_size=64 data.eval_size=16"
        )
        submit = [RAY, "job", "submit", f"--address=http://127.0.0.1:{dash}", "--working-dir", str(REPO), "--"]
        for _ in range(AGENT_TRIES):  # `ray start --block` says it started before the head's job agent is up
            job = subprocess.run(
                [*submit, *entry.split()], env=env, capture_output=True, text=True, timeout=600, cwd=REPO
            )
            if NO_AGENT_YET not in job.stdout + job.stderr:
                break
            time.sleep(2)
        assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
        wrong = bare | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}
        for client in (bare, wrong):  # without the token or with another: refused, nothing runs
            refused = subprocess.run(
                [*submit, "python", "-c", "print(1)"], env=client, capture_output=True, text=True, timeout=120, cwd=REPO
            )
            assert refused.returncode != 0 and "authentication" in (refused.stdout + refused.stderr).lower()
        assert "succeeded" in job.stdout
        assert "step 2/2" in job.stdout and "held-out" in job.stdout
        assert (tmp_path / "runs" / "grpo_tiny_cpu" / "checkpoints" / "step_2" / "orchestrator.json").exists()
    finally:
        head.stop()  # this head alone: other Ray clusters on the machine (a parallel test worker's) go on
