"""relay as deploy/README.md runs it: a real `ray job submit` to a two-node Ray cluster on one machine, with Ray's
token authentication on (a submit without the token, or with another, is refused). Roles are pinned to nodes by
custom resources and the weights cross nodes. (The placement knobs alone: tests/unit/orchestrator/test_placement.py;
the cluster files: tests/unit/deploy/test_deploy.py.) One cluster and one run for both: CI time."""

import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from runtime.ports import free_port
from tests.helpers import RAY, REPO, RayNode

pytestmark = pytest.mark.e2e
AGENT_TRIES = 10
NO_AGENT_YET = "No available agent to submit job"
STEPS = 3


def ray_list(kind: str, env: dict, dashboard: int) -> list[dict]:
    out = subprocess.run(
        [
            RAY,
            "list",
            kind,
            "--format",
            "json",
            "--detail",
            "--limit",
            "1000",
            f"--address=http://127.0.0.1:{dashboard}",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def two_nodes(env: dict, tmp_path: Path, port: int, dash: int, nodes: list[RayNode]) -> None:
    """Start, into `nodes` (the caller stops whatever started), a head (the dashboard and job agent; resource
    rollout_node) on 127.0.0.1 and a worker node (learner_node) on 127.0.0.2: loopback too, but another address,
    so a rendezvous at the wrong node's IP fails."""
    ray_tmp = tempfile.mkdtemp(prefix="mn", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    # ports of their own: Ray's defaults (the job agent's 52365, the client server's 10001) may be held by another
    # cluster on the machine (a parallel test worker's), and a job agent without its port never comes up
    small = ["--num-cpus=2", "--object-store-memory=300000000"]
    head = [
        "--head",
        "--node-ip-address=127.0.0.1",
        f"--port={port}",
        f"--dashboard-port={dash}",
        "--include-dashboard=true",
        f"--ray-client-server-port={free_port()}",
        f"--temp-dir={ray_tmp}",
        '--resources={"rollout_node": 4}',
        f"--dashboard-agent-listen-port={free_port()}",
    ]
    nodes.append(RayNode([*head, *small], env, tmp_path / "head.log"))
    worker = [f"--address=127.0.0.1:{port}", "--node-ip-address=127.0.0.2", '--resources={"learner_node": 4}']
    nodes.append(RayNode([*worker, *small, f"--dashboard-agent-listen-port={free_port()}"], env, tmp_path / "w.log"))


def submit(env: dict, dash: int, entry: list[str]) -> subprocess.CompletedProcess:
    cmd = [RAY, "job", "submit", f"--address=http://127.0.0.1:{dash}", "--working-dir", str(REPO), "--", *entry]
    for _ in range(AGENT_TRIES):  # `ray start --block` says it started before the head's job agent is up
        try:  # a backstop for a hang only (relay's own deadlines end a stuck run): its output says where it stood
            job = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=REPO)
        except subprocess.TimeoutExpired as e:
            pytest.fail(
                f"ray job submit still ran after {e.timeout} s; its output:\n{_tail(e.stdout)}\n{_tail(e.stderr)}"
            )
        if NO_AGENT_YET not in job.stdout + job.stderr:
            return job
        time.sleep(2)
    return job


def _tail(out: bytes | str | None) -> str:
    return (out.decode(errors="replace") if isinstance(out, bytes) else out or "")[-4000:]


def test_a_submitted_job_trains_on_two_nodes_rollout_on_one_learner_on_the_other(policy, tmp_path):
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    bare = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")} | {"RAY_ADDRESS": "", "PATH": path}
    env = bare | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}  # deploy/README.md's token auth
    port, dash = free_port(), free_port()
    nodes = []
    try:
        two_nodes(env, tmp_path, port, dash, nodes)
        entry = [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "train",
            "configs/grpo_tiny_cpu.yaml",
            "cluster.address=auto",
        ]
        entry += ["cluster.rollout_resource=rollout_node", "cluster.learner_resource=learner_node"]
        entry += [f"total_steps={STEPS}", f"learner.model_path={policy}", f"run_root={tmp_path / 'runs'}"]
        entry += ["logging.wandb.mode=disabled", "data.rollout_batch_size=16", "data.eval_size=16", "eval.suites=[]"]
        entry += ["algorithm.mini_batch_size=64", "algorithm.micro_batch_size=64"]
        job = submit(env, dash, entry)
        assert job.returncode == 0, job.stdout[-3000:] + job.stderr[-3000:]
        assert "succeeded" in job.stdout and f"step {STEPS}/{STEPS}" in job.stdout and "held-out" in job.stdout
        for client in (bare, bare | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": "0" * 64}):  # no token, another
            refused = submit(client, dash, ["python", "-c", "print(1)"])
            assert refused.returncode != 0 and "authentication" in (refused.stdout + refused.stderr).lower()

        by_id = {n["node_id"]: n for n in ray_list("nodes", env, dash)}
        head = next(i for i, n in by_id.items() if "rollout_node" in n["resources_total"])
        other = next(i for i, n in by_id.items() if "learner_node" in n["resources_total"])
        assert head != other and by_id[other]["node_ip"] == "127.0.0.2"
        actors = ray_list("actors", env, dash)
        placed = {(a["class_name"], a["node_id"]) for a in actors if a["class_name"] in ("RolloutWorker", "Learner")}
        assert placed == {("RolloutWorker", head), ("Learner", other)}

        run = tmp_path / "runs" / "grpo_tiny_cpu"
        assert (run / "checkpoints" / f"step_{STEPS}" / "orchestrator.json").exists()
        steps = [
            r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "rollout/logprob_gap" in r
        ]
        assert len(steps) == STEPS
        # the engines' logprobs match the learner's after every sync: the weights crossed the nodes
        assert all(r["rollout/logprob_gap"] < 1e-3 for r in steps)
        assert steps[-1]["kl/ref"] > 0  # and the policy moved
    finally:
        for node in reversed(nodes):
            node.stop()  # these nodes alone: other Ray clusters on the machine (a parallel test worker's) go on
