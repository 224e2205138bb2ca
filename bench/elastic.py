"""An elastic rollout pool on a two-node Ray cluster on one machine, against a fixed one (docs/benchmarks.md:
"Elastic rollout pool"; tests/e2e/rollout/test_elastic_e2e.py runs one elastic run through it).

    python -m bench.elastic ROOT [--policy PATH] [--seeds 0 1 2] [--steps 8] [--join-at 2] [--leave-at 5]
                                 [--set KEY=VALUE ...]

The head (127.0.0.1) holds one unit of the rollout resource, so the run starts with one engine. Elastic
(cluster.rollout_workers 1..2): after step --join-at, a second node with a unit (127.0.0.2) joins, and the
loop waits there until the engine Ray started on it is up; the next step admits it first and generates on both.
After step --leave-at, that node stops; the next step's start finds its engine gone, drops it, and launches again
on the head's engine what it held.
Fixed (rollout_workers 1): the same cluster, no node joins. Per seed, both runs' held-out figures, and the path
of rollout/engines.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HELD_OUT = ("eval/greedy/reward/accuracy", "eval/sampled/reward/accuracy", "eval/sampled/kl_ref")
REPO = Path(__file__).resolve().parent.parent
PATH = os.environ.get("PATH", "")


def node(args: list[str], log: Path):
    from tests.helpers import RayNode  # `ray start --block` in its own process group

    temp = tempfile.mkdtemp(prefix="el", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {
        "PATH": f"{Path(sys.executable).parent}:{PATH}"
    }
    return RayNode([*args, "--num-cpus=2", "--object-store-memory=300000000", f"--temp-dir={temp}"], env, log)


def config(root: Path, name: str, seed: int, steps: int, elastic: bool, address: str, policy: str, extra=()):
    from orchestrator.config.load import load_config

    over = {
        "cluster.address": address,
        "cluster.rollout_resource": "rollout_node",
        "cluster.rollout_workers": "1..2" if elastic else 1,
        "learner.model_path": policy,
        "run_root": root,
        "name": name,
        "seed": seed,
        "total_steps": steps,
        "checkpoint.every_n_steps": 0,
        "logging.wandb.mode": "disabled",
        "logging.progress_bar": "false",
        "data.rollout_batch_size": 16,
        "algorithm.mini_batch_size": 64,
        "algorithm.micro_batch_size": 64,
        "learner.lr": 2e-4,
    }
    return load_config(REPO / "configs" / "grpo_tiny_cpu.yaml", [f"{k}={v}" for k, v in over.items()] + list(extra))


def run(root: Path, seed: int, steps: int, join_at: int, leave_at: int, elastic: bool, policy: str, extra=()) -> dict:
    """One run on a fresh two-node cluster (the second node only when elastic). Returns the run's folder."""
    import ray

    from runtime.ports import free_port

    port, name = free_port(), f"{'elastic' if elastic else 'fixed'}_seed{seed}"
    root.mkdir(parents=True, exist_ok=True)
    head = ["--head", "--node-ip-address=127.0.0.1", f"--port={port}", "--include-dashboard=false"]
    nodes = [node([*head, '--resources={"rollout_node": 1}'], root / f"{name}.head.log")]
    try:
        cfg = config(root, name, seed, steps, elastic, f"127.0.0.1:{port}", policy, extra)
        ray.init(address=cfg.cluster.address, log_to_driver=False)
        from orchestrator.loop.trainer import Trainer

        trainer = Trainer(cfg)

        def on_step(step: int, metrics: dict) -> bool:
            if elastic and step == join_at:
                worker = [f"--address=127.0.0.1:{port}", "--node-ip-address=127.0.0.2"]
                nodes.append(node([*worker, '--resources={"rollout_node": 1}'], root / f"{name}.worker.log"))
                joining = [ref for _, ref in trainer.roles.rollout.members.joining]
                ray.wait(joining, num_returns=len(joining), timeout=600)  # its engine up: the next step admits it
            if elastic and step == leave_at:
                nodes.pop().stop()
                wait_for_nodes(1)
            return False

        try:
            trainer.run(on_step=on_step)
        finally:
            trainer.shutdown()
        return {"run_dir": str(trainer.run_dir)}
    finally:
        ray.shutdown()
        for n in reversed(nodes):
            n.stop()


def wait_for_nodes(alive: int, timeout_s: float = 120.0) -> None:
    """Until Ray counts `alive` nodes alive (a stopped node's raylet has told the cluster it left)."""
    from runtime.actors import alive_nodes

    deadline = time.monotonic() + timeout_s
    while len(alive_nodes()) != alive:
        if time.monotonic() > deadline:
            raise TimeoutError(f"Ray still counts {len(alive_nodes())} nodes alive, not {alive}")
        time.sleep(0.5)


def summary(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "rollout/engines" in r]
    after = json.loads((run_dir / "eval_after.json").read_text())
    sampled = [(r["reward/mean"], r["response/length_mean"]) for r in steps]  # what each step's batch sampled
    return {"engines": [r["rollout/engines"] for r in steps], "sampled": sampled} | {k: after[k] for k in HELD_OUT}


def first_difference(a: list, b: list) -> int | None:
    """The first step (1-based) whose batch differs between two runs, None if none does."""
    return next((i + 1 for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", type=Path)
    p.add_argument("--policy", default="builtin://tiny-addition-gpt")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--join-at", type=int, default=2)
    p.add_argument("--leave-at", type=int, default=5)
    p.add_argument("--set", nargs="*", default=[], help="more overrides, KEY=VALUE, for every run")
    p.add_argument("--one", choices=["elastic", "fixed"], help="one run, in this process (the others call this)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    # Ray's token authentication, as deploy/README.md starts a cluster: the nodes and this driver share the token
    # (set before Ray is imported, which reads it then)
    os.environ |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    if a.one:
        print(json.dumps(run(a.root, a.seed, a.steps, a.join_at, a.leave_at, a.one == "elastic", a.policy, a.set)))
        return
    table = []
    for seed in a.seeds:
        for kind in ("fixed", "elastic"):  # each in a process of its own: one Ray driver per process
            args = ["--one", kind, "--seed", str(seed), "--steps", str(a.steps), "--policy", a.policy]
            args += ["--join-at", str(a.join_at), "--leave-at", str(a.leave_at), "--set", *a.set]
            out = subprocess.run(
                [sys.executable, "-m", "bench.elastic", str(a.root), *args],
                check=True,
                capture_output=True,
                text=True,
                cwd=REPO,
            ).stdout
            table.append({"seed": seed, "kind": kind} | summary(Path(json.loads(out.splitlines()[-1])["run_dir"])))
            print(json.dumps({k: v for k, v in table[-1].items() if k != "sampled"}), flush=True)
    print(render(table))


def render(table: list[dict]) -> str:
    """One row per run; the elastic run's last column: the first step whose batch differs from the fixed run's."""
    lines = ["| seed | pool | rollout/engines by step | " + " | ".join(HELD_OUT) + " | first step sampled apart |"]
    lines.append("|---" * (4 + len(HELD_OUT)) + "|")
    fixed = {r["seed"]: r for r in table if r["kind"] == "fixed"}
    for r in table:
        cells = [str(r["seed"]), r["kind"], "→".join(map(str, r["engines"]))] + [f"{r[k]:.4f}" for k in HELD_OUT]
        apart = first_difference(r["sampled"], fixed[r["seed"]]["sampled"]) if r["kind"] == "elastic" else ""
        lines.append("| " + " | ".join([*cells, "none" if apart is None else str(apart)]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
