"""`relay train --profile` (logging.profile_step): one step profiled in every role, files written
where the run keeps them; and the trainer profiles that step only."""

import json
from contextlib import contextmanager

import torch

from orchestrator.cli import _parser
from orchestrator.loop.profiling import profiled
from runtime.profiling import Profiled


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


def test_the_trainer_profiles_only_the_configured_step_and_the_cli_flag_sets_it(tmp_path, monkeypatch):
    from orchestrator.loop import trainer as trainer_module
    from tests.small_loop import small_trainer

    profiled_steps = []

    @contextmanager
    def recording(roles, out_dir, timings):  # the real one profiles Ray actors (the test above)
        yield
        profiled_steps.append((sorted(roles), out_dir, "timing/generate" in timings))

    monkeypatch.setattr(trainer_module, "profiled", recording)
    trainer, _ = small_trainer(tmp_path, "logging.profile_step=2")
    trainer.run()
    assert profiled_steps == [(["learner_0", "scoring"], trainer.run_dir / "profile", True)]  # step 2 only
    assert _parser().parse_args(["train", "--profile"]).profile


def test_a_busy_actor_computes_on_its_threads_in_the_threads_ray_runs_its_methods_in(ray_cluster):
    """Actors with a concurrency group (busy_seconds answers mid-call) run methods in Ray's threads,
    where OpenMP would use OMP_NUM_THREADS (1 under Ray): measured, the scoring service's reference
    forward on SmolLM2 took 3.7 s instead of 1.8 s. working() sets the actor's threads again there."""
    import threading

    from runtime.profiling import Busy

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
