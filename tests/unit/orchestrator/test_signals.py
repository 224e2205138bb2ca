"""Stop signals: the handler only records the request; old handlers come back; a second Ctrl-C exits."""

import os
import signal

import pytest

from orchestrator.loop.signals import Stopped, StopRequest, stop_on_signals


def send(signum):
    os.kill(os.getpid(), signum)  # Python runs the handler before the next bytecode, in this (main) thread


@pytest.mark.parametrize("signum,name", [(signal.SIGTERM, "SIGTERM"), (signal.SIGINT, "SIGINT")])
def test_a_signal_only_records_the_stop_request(signum, name, capfd):
    with stop_on_signals(StopRequest()) as stop:
        assert not stop.requested
        send(signum)
        assert stop.requested and stop.signal == name  # and the process is still here
    assert f"relay: {name} received: finishing the current step" in capfd.readouterr().err


def test_the_old_handlers_come_back():
    def mine(signum, frame):
        pass

    old, old_int = signal.signal(signal.SIGTERM, mine), signal.getsignal(signal.SIGINT)
    try:
        with stop_on_signals(StopRequest()):
            assert signal.getsignal(signal.SIGTERM) is not mine
        assert signal.getsignal(signal.SIGTERM) is mine
        assert signal.getsignal(signal.SIGINT) is old_int  # pytest's (or SIG_IGN in a background job), as before
    finally:
        signal.signal(signal.SIGTERM, old)


def test_the_old_handlers_come_back_after_an_error():
    old_int = signal.getsignal(signal.SIGINT)
    with pytest.raises(RuntimeError):
        with stop_on_signals(StopRequest()):
            raise RuntimeError("boom")
    assert signal.getsignal(signal.SIGINT) is old_int


def test_a_second_ctrl_c_exits_at_once(capfd):
    with stop_on_signals(StopRequest()) as stop:
        send(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            send(signal.SIGINT)
    assert stop.signal == "SIGINT"
    assert "SIGINT again: exiting now, without a checkpoint" in capfd.readouterr().err


def test_ctrl_c_after_sigterm_exits_at_once_but_a_repeated_sigterm_does_not():
    # a scheduler may send SIGTERM to the job's processes and a wrapper script forward it again
    with stop_on_signals(StopRequest()) as stop:
        send(signal.SIGTERM)
        send(signal.SIGTERM)
        assert stop.signal == "SIGTERM"
        with pytest.raises(KeyboardInterrupt):
            send(signal.SIGINT)
    assert stop.signal == "SIGTERM"  # the first signal names the stop


def test_stopped_says_where_the_checkpoint_is():
    e = Stopped("SIGTERM", 3, 10, "runs/x/checkpoints/step_3")
    assert str(e) == (
        "stopped by SIGTERM after step 3/10; checkpoint runs/x/checkpoints/step_3; "
        "checkpoint.resume=auto continues from it"
    )
    assert "nothing to save" in str(Stopped("SIGINT", 0, 10, None))


def loop(tmp_path, stop_during_step, every=0, total_steps=4):
    """The real Trainer.run on stand-in roles (tests/small_loop.py); a stop is requested
    during step `stop_during_step` (0: before the first step). Returns (the Stopped raised, the steps
    checkpointed, the steps logged)."""
    import json

    from tests.small_loop import small_trainer  # imports vLLM and DeepSpeed: slow, only here

    over = (f"total_steps={total_steps}", f"checkpoint.every_n_steps={every}")
    trainer, calls = small_trainer(tmp_path, *over)
    stop = StopRequest()
    if stop_during_step == 0:
        stop.request("SIGINT")

    def during(step, metrics):  # read between steps, as a signal during step `step` would be
        if step == stop_during_step:
            stop.request("SIGTERM")

    with pytest.raises(Stopped) as e:
        trainer.run(stop, on_step=during)
    saved = [int(c[1].removeprefix("step_").removesuffix(".tmp")) for c in calls if c[0] == "save"]
    rows = (trainer.run_dir / "metrics.jsonl").read_text().splitlines()
    logged = [r["step"] for r in map(json.loads, rows) if "timing/total" in r]
    return e.value, saved, logged


def test_a_stop_during_a_step_finishes_it_then_checkpoints_it_and_does_not_evaluate(tmp_path):
    e, saved, logged = loop(tmp_path, stop_during_step=2)
    assert logged == [1, 2] and saved == [2]  # no eval-after row
    assert (e.signal_name, e.step, e.checkpoint) == ("SIGTERM", 2, tmp_path / "small" / "checkpoints" / "step_2")


def test_a_step_just_checkpointed_is_not_written_again(tmp_path):
    e, saved, _ = loop(tmp_path / "a", stop_during_step=2, every=2)
    assert saved == [2] and e.checkpoint == tmp_path / "a" / "small" / "checkpoints" / "step_2"
    e, saved, logged = loop(tmp_path / "b", stop_during_step=4)  # the last step: the resumed run only evaluates
    assert saved == [4] and logged == [1, 2, 3, 4] and e.step == 4


def test_a_stop_before_the_first_step_saves_nothing(tmp_path):
    e, saved, logged = loop(tmp_path, stop_during_step=0)
    assert saved == [] and logged == [] and e.checkpoint is None and e.step == 0
