"""The run seed reaches every random stream (runtime/seeds.py): another seed, another stream."""

import os
import subprocess
import sys

from orchestrator.config.schema import DataConfig
from orchestrator.data.prompts import PromptSampler, load_split
from rollout.config import SamplingConfig
from runtime.seeds import SEED_RANGE, request_seed, stream_seed
from tests.helpers import REPO

STREAMS = ["sampling", "engine", "data_order", "task", "held_out", "learner", "mini_batches"]


def test_request_seeds_follow_the_run_seed():
    # the first step's requests: with the old `sampling.seed * A + step * B + index`, sampling.seed
    # (0 by default) and not the run seed went in, so every run seed drew these same numbers
    grid = [(step, index) for step in range(3) for index in range(64)]
    runs = {seed: [request_seed(seed, step, index) for step, index in grid] for seed in (0, 1, 2)}
    assert runs[0] == [request_seed(0, step, index) for step, index in grid]  # the same seed: the same seeds
    for a, b in ((0, 1), (0, 2), (1, 2)):
        assert not set(runs[a]) & set(runs[b])  # no request of one run shares its seed with one of another
    assert len(set(runs[0])) == len(grid) and all(0 <= s < SEED_RANGE for s in runs[0])


def test_every_stream_is_its_own_and_changes_with_the_run_seed():
    seeds = {(run, stream): stream_seed(run, stream) for run in (0, 1, 2) for stream in STREAMS}
    assert len(set(seeds.values())) == len(seeds)
    assert stream_seed(0, "learner", 1) != stream_seed(1, "learner", 0)  # the old seed + rank made these equal


def test_stream_seeds_are_the_same_in_every_process():
    code = "from runtime.seeds import stream_seed; print(stream_seed(3, 'sampling', 5, 7))"
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": str(h)},
        ).stdout
        for h in (1, 2)
    }
    assert outs == {f"{stream_seed(3, 'sampling', 5, 7)}\n"}


def test_the_worker_samples_from_the_run_seed_unless_sampling_seed_overrides_it():
    from rollout.worker import RolloutWorker  # imports vLLM: only here

    workers = {}
    for run_seed in (0, 1):
        workers[run_seed] = object.__new__(RolloutWorker)
        workers[run_seed].seed = run_seed
    follow, pinned = SamplingConfig(), SamplingConfig(seed=7)
    assert follow.seed is None  # the default: follow the run seed
    assert workers[0]._request_seed(follow, (0, 0), 0) == request_seed(0, 0, 0)
    assert workers[0]._request_seed(follow, (0, 0), 0) != workers[1]._request_seed(follow, (0, 0), 0)
    assert (
        workers[0]._request_seed(pinned, (0, 0), 0)
        == workers[1]._request_seed(pinned, (0, 0), 0)
        == request_seed(7, 0, 0)
    )


def test_data_order_and_generated_data_follow_the_run_seed():
    orders = [PromptSampler(100, seed, shuffle=True).next(100) for seed in (0, 1, 0)]
    assert orders[0] == orders[2] and orders[0] != orders[1]
    cfg = DataConfig(task="addition_2digit", task_size=50, eval_size=10)
    (t0, h0, _), (t1, h1, _) = load_split(cfg, seed=0), load_split(cfg, seed=1)
    assert t0 != t1 and h0 != h1 and load_split(cfg, seed=0)[:2] == (t0, h0)
