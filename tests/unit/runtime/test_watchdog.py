"""The watchdog's pure parts: each phase's deadline from its measured durations, which stuck actors it
acts on, which phases it measures, and the one line an incident prints."""

import json

import pytest

from runtime import watchdog
from runtime.incidents import ActorProcess, Incident
from runtime.watchdog import PhaseClock, Watchdog, WatchdogConfig, blame


def test_a_phase_deadline_is_factor_times_its_p99_above_the_floor_and_first_s_until_measured():
    clock = PhaseClock(WatchdogConfig(factor=5.0, floor_s=10.0, first_s=600.0, phases_s={"sync": 42.0}))
    assert clock.deadline("generate") == 600.0  # not measured yet: start-up and warm-up get first_s
    for s in [1.0] * 98 + [3.0, 4.0]:
        clock.record("generate", s)
    # p99 of 100 durations is the 99th smallest (index 98 of 0..99): 3.0 -> 5 x 3.0
    assert clock.deadline("generate") == 15.0
    clock.record("score", 0.5)
    assert clock.deadline("score") == 10.0  # 5 x 0.5 = 2.5 is under the floor
    clock.record("sync", 100.0)
    assert clock.deadline("sync") == 42.0  # a fixed deadline replaces the measured one


def test_only_the_last_100_durations_count():
    clock = PhaseClock(WatchdogConfig(factor=2.0, floor_s=0.0))
    clock.record("update", 50.0)
    for _ in range(100):
        clock.record("update", 1.0)
    assert clock.deadline("update") == 2.0


def process(role, stopped=False):
    return ActorProcess(role, None, role, role.title(), "10.0.0.7", "node", 100 + len(role), "ALIVE", stopped)


@pytest.mark.parametrize(
    "stuck, chosen",
    [
        (["learner_0", "rollout_0"], ["rollout_0"]),  # a sender in a weight sync waits for its receivers
        (["learner_0", "learner_1"], ["learner_0", "learner_1"]),  # the ranks restart together
        (["learner_0", "scoring"], ["scoring"]),
        ([], []),
    ],
)
def test_blame_acts_on_the_receivers_before_the_learner(stuck, chosen):
    assert [p.role for p in blame([process(r) for r in stuck])] == chosen


def test_blame_acts_on_a_stopped_process_first():
    stuck = [process("rollout_0"), process("learner_1", stopped=True), process("learner_0")]
    assert [p.role for p in blame(stuck)] == ["learner_1"]


def test_an_incident_line_names_phase_call_wait_deadline_role_class_node_pid_and_the_action(tmp_path):
    incident = Incident("sync", "weight sync", 95.4, 90.0, [process("rollout_0", stopped=True)], 1)
    assert incident.line() == (
        "watchdog: phase sync in weight sync waited 95 s (deadline 90 s) on "
        "rollout_0 (Rollout_0, node 10.0.0.7, pid 109, stopped)"
    )
    assert "Ray restarts it" in incident.action()
    assert "rebuilds" in Incident("update", "", 9, 8, [process("learner_0")], 2).action()
    folder = incident.write(tmp_path, [], {"step": 7, "last_metrics": {"reward/mean": 0.5}, "config": {}}, False)
    assert folder == tmp_path / "incidents" / "1_sync"
    summary = json.loads((folder / "incident.json").read_text())
    assert summary["step"] == 7 and summary["stuck"][0] == {
        "role": "rollout_0",
        "class": "Rollout_0",
        "node": "10.0.0.7",
        "pid": 109,
        "stopped": True,
    }
    assert json.loads((folder / "last_metrics.json").read_text()) == {"reward/mean": 0.5}
    assert (folder / "ray_status.txt").exists()


def test_a_phase_is_measured_unless_a_recovery_disturbed_it_and_a_recovery_restarts_every_enclosing_deadline():
    dog = Watchdog(WatchdogConfig(), "unused", dict, dict)
    with watchdog.watching(dog):
        with dog.phase("step"):
            with dog.phase("generate"):
                outer_start = dog.stack[0].started
                watchdog.restart_deadline()  # an engine restarted inside generate
                assert all(w.disturbed for w in dog.stack) and dog.stack[0].started > outer_start
            with dog.phase("update"):
                pass
    assert set(dog.clock.seconds) == {"update"}  # generate and its step said nothing of their next deadline
    watchdog.restart_deadline()  # without an active watchdog: nothing to do


def test_no_phase_deadline_is_under_factor_times_the_step_p99_so_waits_for_work_launched_ahead_are_no_alarm():
    # one_step async: generate waits ~0 s for a batch generated during the last update; after a shorter
    # update it waits for most of a generation, which a step's duration bounds
    clock = PhaseClock(WatchdogConfig(factor=4.0, floor_s=1.0))
    for _ in range(10):
        clock.record("generate", 0.01)
        clock.record("step", 30.0)
    assert clock.deadline("generate") == 120.0


def test_after_a_recovery_a_phase_waits_first_s_and_no_deadline_reaches_the_collective_timeout():
    clock = PhaseClock(WatchdogConfig(factor=5.0, floor_s=10.0, first_s=900.0, collective_timeout_s=1000.0))
    clock.record("generate", 1.0)
    assert clock.deadline("generate") == 10.0
    assert clock.deadline("generate", disturbed=True) == 900.0  # batches generated again after a restart
    clock.record("update", 400.0)
    # 5 x 400 s would outwait the learner's collectives, which would then fail first, unnamed
    assert clock.deadline("update") == 900.0
    assert clock.deadline("never measured") == 900.0


def test_incident_folders_are_numbered_on_from_an_earlier_run_of_the_same_folder(tmp_path):
    from runtime.incidents import incident_number

    assert incident_number(tmp_path) == 1
    (tmp_path / "incidents" / "1_generate").mkdir(parents=True)
    (tmp_path / "incidents" / "2_sync").mkdir()
    assert incident_number(tmp_path) == 3


def test_a_fixed_phase_deadline_must_name_a_phase_and_be_positive(tmp_path):
    from orchestrator.config.load import ConfigError, load_config
    from tests.helpers import REPO

    preset = REPO / "configs" / "grpo_tiny_cpu.yaml"
    with pytest.raises(ConfigError, match="watchdog.phases_s.generation: no such phase"):
        load_config(preset, ["watchdog.phases_s.generation=30"])
    with pytest.raises(ConfigError, match="watchdog.phases_s.sync: must be > 0"):
        load_config(preset, ["watchdog.phases_s.sync=0"])
    assert load_config(preset, ["watchdog.phases_s.sync=300"]).watchdog.phases_s == {"sync": 300.0}
