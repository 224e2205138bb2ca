"""`relay train --profile` (logging.profile_step): one step profiled in every role, files written
where the run keeps them; and the trainer profiles that step only."""

import json
from contextlib import nullcontext
from types import SimpleNamespace

import torch

from orchestrator.cli import _parser
from orchestrator.profiling import profiled
from orchestrator.trainer import Trainer
from reward_service.types import ScoredBatch
from rollout.profiling import Profiled
from rollout.types import RolloutBatch


def test_a_profiled_step_writes_each_roles_tables_and_trace(ray_cluster, tmp_path):
    class Role(Profiled):  # defined here: Ray ships it by value (a test module is not importable by workers)
        def work(self) -> float:
            return float((torch.ones(64, 64) @ torch.ones(64, 64)).sum())

    role = ray_cluster.remote(Role).options(num_cpus=0).remote()
    t = {}
    with profiled({"role_0": role}, tmp_path, t):
        assert ray_cluster.get(role.work.remote()) == 64.0**3
        t.update({"timing/generate": 0.25, "timing/total": 1.0})
    text = (tmp_path / "role_0.txt").read_text()
    assert "aten::mm" in text and "work" in text  # torch ops and Python functions of the role's call
    assert json.loads((tmp_path / "role_0.trace.json").read_text())["traceEvents"]
    assert "generate" in (tmp_path / "phases.txt").read_text() and "25.0%" in (tmp_path / "phases.txt").read_text()
    assert (tmp_path / "driver.txt").read_text()
    assert ray_cluster.get(role.profile.remote(False)) == ""  # switched off: a second stop is harmless


def test_the_trainer_profiles_only_the_configured_step_and_the_cli_flag_sets_it(tmp_path):
    n = 2
    batch = RolloutBatch([0, 0], [[1]] * n, [[2]] * n, [[0.0]] * n, ["x"] * n, ["stop"] * n, version_first=[0, 0])
    scored = ScoredBatch([1.0, 0.0], {}, [True] * n, [False] * n, [[0.0]] * n, raw=[1.0, 0.0])
    stats = {"kl/ref_seq": 0.0, "learner/skipped_steps": 0.0, "learner/nonfinite_losses": 0.0}
    for step in (0, 1):
        run_dir = tmp_path / f"step{step}"
        batch.version_first = [step] * n
        loop = SimpleNamespace(
            step=step,
            run_dir=run_dir,
            roles=lambda: {},
            counters={},
            sleep_engines=False,
            lead=0,
            gateway=None,
            cfg=SimpleNamespace(data=SimpleNamespace(dynamic_sampling=False), logging=SimpleNamespace(profile_step=2)),
            next_batch=lambda: (batch, [{}], None),
            score=lambda b, e, judged: scored,
            _judge_next=lambda: None,
            _busy=lambda: {"rollout": [0.0], "scoring": [0.0]},
            rollout=SimpleNamespace(asleep=lambda enabled: nullcontext()),
            scoring=SimpleNamespace(restarts=0),
            learner=SimpleNamespace(update=lambda b, s, step: stats, update_kl=lambda kl, n: 0.01),
            check_progress=lambda s, scored: None,
            push=lambda version: None,
        )
        Trainer.train_step(loop)
        profiled_here = step + 1 == 2
        assert (run_dir / "profile" / "driver.txt").exists() == profiled_here
        if profiled_here:
            assert "generate" in (run_dir / "profile" / "phases.txt").read_text()
    assert _parser().parse_args(["train", "--profile"]).profile


def test_a_busy_actor_computes_on_its_threads_in_the_threads_ray_runs_its_methods_in(ray_cluster):
    """Actors with a concurrency group (busy_seconds answers mid-call) run methods in Ray's threads,
    where OpenMP would use OMP_NUM_THREADS (1 under Ray): measured, the scoring service's reference
    forward on SmolLM2 took 3.7 s instead of 1.8 s. working() sets the actor's threads again there."""
    import threading

    from rollout.profiling import Busy

    class Role(Busy):
        def __init__(self):
            torch.set_num_threads(2)
            self.keep_threads()

        def work(self):
            calls, real = [], torch.set_num_threads
            torch.set_num_threads = lambda n: (calls.append((threading.get_ident(), n)), real(n))
            try:
                with self.working():
                    return calls, threading.get_ident(), torch.get_num_threads()
            finally:
                torch.set_num_threads = real

        @ray_cluster.method(concurrency_group="stats")
        def busy(self):
            return Busy.busy_seconds(self)

    role = ray_cluster.remote(concurrency_groups={"stats": 1})(Role).options(num_cpus=0).remote()
    calls, thread, threads = ray_cluster.get(role.work.remote())
    assert calls == [(thread, 2)] and threads == 2 and ray_cluster.get(role.busy.remote()) >= 0.0
    given = Busy()
    given.keep_threads(1)  # the role's own setting wins over what vLLM left torch set to (every core)
    assert given._threads == 1
