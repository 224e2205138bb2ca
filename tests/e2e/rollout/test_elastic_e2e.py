"""An elastic rollout pool on a real two-node Ray cluster on one machine (bench/elastic.py drives it, as
docs/benchmarks.md's comparison does), in async_training one_step: cluster.rollout_workers 1..2, the head holding
room for one engine. After step 2 a node with room joins (127.0.0.2): the next step admits its engine and
generates on both. After step 4 that node stops, with the next step's batch launched ahead on both engines: the
next step drops its engine and launches that batch again on the head's. Every step once, every batch whole, the
engines path 1 -> 2 -> 1, and the staleness bound kept."""

import json
import subprocess
import sys

import pytest

from tests.helpers import REPO, jsonl_rows

pytestmark = pytest.mark.e2e
STEPS, JOIN_AT, LEAVE_AT = 7, 2, 4


def test_the_pool_grows_when_a_node_joins_and_shrinks_when_it_leaves_and_the_run_finishes(policy, tmp_path):
    args = ["--one", "elastic", "--seed", "0", "--steps", str(STEPS), "--policy", policy]
    args += [
        "--join-at",
        str(JOIN_AT),
        "--leave-at",
        str(LEAVE_AT),
        "--set",
        "async_training.mode=one_step",
        "data.eval_size=8",  # the evaluation's figures are not read here: the run only has to end with one
        "eval.suites=[]",
    ]
    out = subprocess.run(
        [sys.executable, "-m", "bench.elastic", str(tmp_path), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    run_dir = REPO / json.loads(out.stdout.splitlines()[-1])["run_dir"]
    steps = [r for r in jsonl_rows(run_dir / "metrics.jsonl") if "timing/total" in r]
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))  # every step once
    assert [r["rollout/engines"] for r in steps] == [1, 1, 2, 2, 1, 1, 1]
    last = steps[-1]
    assert last["rollout/engines_joined"] == 1 and last["rollout/engines_left"] == 1
    assert last["restarts/rollout"] == 0  # nothing died but the node's engine, which left instead
    # the batch launched ahead to both engines before the node left was launched again (once) on the head's
    assert [r["restarts/relaunched_batches"] for r in steps] == [0, 0, 0, 0, 1, 1, 1]
    assert all(round(r["throughput/samples_per_s"] * r["timing/total"]) == 16 * 8 for r in steps)  # whole batches
    # no group was beyond the bound, so none was dropped and topped up: the joining engine sampled from the
    # version it was given before its first call, not from the initial weights it started with
    assert all(r["async/dropped_stale"] == 0 and r["async/staleness_max"] <= 1 for r in steps)
    assert (run_dir / "eval_after.json").exists()
