"""Each way a failed run ends: its exit status, one line with the cause and, where it can go on, the
command that continues it; the traceback in the run folder's relay.log."""

import ray

from orchestrator.loop.endings import cause, ending
from orchestrator.loop.recovery import LearnerLost

COMMAND = "relay train configs/grpo_tiny_cpu.yaml checkpoint.resume=auto"


def a_checkpoint(run_dir, step):
    (run_dir / "checkpoints" / f"step_{step}").mkdir(parents=True)
    (run_dir / "checkpoints" / f"step_{step}" / "orchestrator.json").write_text("{}")


def raised(error):
    try:
        raise error
    except Exception as e:  # noqa: BLE001
        return e


def test_a_lost_process_ends_resumable_with_the_checkpoint_and_the_command_and_the_traceback_in_relay_log(tmp_path):
    a_checkpoint(tmp_path, 4)
    lost = raised(LearnerLost(2, 6, tmp_path / "checkpoints" / "step_4", ray.exceptions.ActorDiedError()))
    status, line = ending(lost, tmp_path, COMMAND)
    assert status == 3 and "\n" not in line
    assert line.startswith("relay: run ended: LearnerLost: a learner rank died in step 7")
    assert line.endswith(f"to continue from checkpoint step 4: {COMMAND}")
    assert f"traceback in {tmp_path / 'relay.log'}" in line
    assert "Traceback (most recent call last)" in (tmp_path / "relay.log").read_text()


def test_an_engine_gone_for_good_is_resumable_too_and_without_a_checkpoint_the_run_starts_again(tmp_path):
    status, line = ending(raised(ray.exceptions.ActorDiedError()), tmp_path, COMMAND)
    assert status == 3 and line.endswith(f"no checkpoint was written; to start again: {COMMAND}")


def test_any_other_error_is_a_training_failure_in_one_line_naming_the_last_checkpoint(tmp_path):
    a_checkpoint(tmp_path, 2)
    a_checkpoint(tmp_path, 6)
    status, line = ending(raised(ValueError("a bad value\nwith a second line")), tmp_path, COMMAND)
    assert status == 1
    assert line == (
        f"relay: training failed: ValueError: a bad value (traceback in {tmp_path / 'relay.log'}); "
        "the last checkpoint is step 6"
    )


def test_a_remote_error_is_named_by_its_own_type_and_the_call():
    inner = raised(ZeroDivisionError("division by zero"))
    remote = ray.exceptions.RayTaskError("Learner.train", "Traceback ...", inner)
    assert cause(remote) == "ZeroDivisionError in Learner.train: division by zero"


def test_a_remote_error_whose_type_ray_wraps_names_its_type_and_message():
    """Ray raises a remote torch DistNetworkError as RayTaskError(DistNetworkError), whose attributes come from the
    cause: the run's last line said AttributeError ('function_name') instead of the port in use (CI, 2026-12-06)."""
    import ray
    import torch

    from orchestrator.loop.endings import cause

    try:
        raise torch.distributed.DistNetworkError("failed to listen on port 25865: EADDRINUSE")
    except torch.distributed.DistNetworkError as e:
        error = ray.exceptions.RayTaskError("Learner.init_weight_sync", "traceback", e).as_instanceof_cause()
    said = cause(error)
    assert said.startswith("DistNetworkError in ") and "EADDRINUSE" in said, said
