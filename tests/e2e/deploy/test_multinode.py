"""relay on a real two-node Ray cluster on one machine: roles pinned to nodes by custom resources,
weights crossing nodes. (The placement knobs alone: tests/unit/orchestrator/test_placement.py.)"""

import json
import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from runtime.ports import free_port
from tests.helpers import RAY, REPO, RayNode


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


@pytest.mark.e2e
def test_train_on_two_nodes_rollout_on_one_learner_on_the_other(policy, tmp_path):
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH_")} | {"RAY_ADDRESS": "", "PATH": path}
    env |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}  # deploy/README.md's token auth
    port, dash = free_port(), free_port()
    ray_tmp = tempfile.mkdtemp(prefix="mn", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    small = ["--num-cpus=2", "--object-store-memory=300000000", f"--dashboard-agent-listen-port={free_port()}"]
    nodes = []
    try:
        nodes.append(
            RayNode(
                [
                    "--head",
                    "--node-ip-address=127.0.0.1",
                    f"--port={port}",
                    f"--dashboard-port={dash}",
                    "--include-dashboard=true",
                    f"--ray-client-server-port={free_port()}",
                    f"--temp-dir={ray_tmp}",
                    '--resources={"rollout_node": 4}',
                    *small,
                ],
                env,
                tmp_path / "head.log",
            )
        )
        small[-1] = f"--dashboard-agent-listen-port={free_port()}"
        # 127.0.0.2 is loopback too, but another address: a rendezvous at the wrong node's IP fails
        nodes.append(
            RayNode(
                [
                    f"--address=127.0.0.1:{port}",
                    "--node-ip-address=127.0.0.2",
                    '--resources={"learner_node": 4}',
                    *small,
                ],
                env,
                tmp_path / "worker.log",
            )
        )
        cmd = [
            sys.executable,
            "-m",
            "orchestrator.cli",
            "train",
            "configs/grpo_tiny_cpu.yaml",
            "cluster.address=auto",
            "cluster.rollout_resource=rollout_node",
            "cluster.learner_resource=learner_node",
            "total_steps=3",
            f"learner.model_path={policy}",
            f"run_root={tmp_path / 'runs'}",
            "logging.wandb.mode=disabled",
            "data.rollout_batch_size=16",
            "data.eval_size=16",
            "algorithm.mini_batch_size=64",
            "algorithm.micro_batch_size=64",
        ]
        run = subprocess.run(
            cmd, env=dict(env, RAY_ADDRESS=f"127.0.0.1:{port}"), capture_output=True, text=True, timeout=900, cwd=REPO
        )
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

        by_id = {n["node_id"]: n for n in ray_list("nodes", env, dash)}
        head = next(i for i, n in by_id.items() if "rollout_node" in n["resources_total"])
        other = next(i for i, n in by_id.items() if "learner_node" in n["resources_total"])
        assert head != other and by_id[other]["node_ip"] == "127.0.0.2"
        actors = ray_list("actors", env, dash)
        placed = {(a["class_name"], a["node_id"]) for a in actors if a["class_name"] in ("RolloutWorker", "Learner")}
        assert placed == {("RolloutWorker", head), ("Learner", other)}

        rows = [
            json.loads(line)
            for line in (tmp_path / "runs" / "grpo_tiny_cpu" / "metrics.jsonl").read_text().splitlines()
        ]
        steps = [r for r in rows if "rollout/logprob_gap" in r]
        assert len(steps) == 3
        # the engines' logprobs match the learner's after every sync: the weights crossed the nodes
        assert all(r["rollout/logprob_gap"] < 1e-3 for r in steps)
        assert steps[-1]["kl/ref"] > 0  # and the policy moved
    finally:
        for node in reversed(nodes):
            node.stop()
