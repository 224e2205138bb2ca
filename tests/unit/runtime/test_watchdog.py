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
