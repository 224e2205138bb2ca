"""The loop's side of a checkpoint (orchestrator.json, beside the learner's files), and putting it back:
on a resume, and after a learner recovery (orchestrator/loop/recovery.py)."""

from __future__ import annotations

from collections.abc import Callable

# the counts of what happened to the roles (restarts, engines that joined or left), which no restore undoes
HAPPENED = ("restarts/", "rollout/engines_")


def restored_counters(now: dict, saved: dict, in_process: bool) -> dict:
    """The counts to go on with after restoring a checkpoint whose counts are `saved`, `now` being the
    loop's current ones: the checkpoint's (a count it lacks, as an older relay's checkpoint lacks a newer
    one, keeps its current value), except, `in_process` (a learner recovery), the restarts: the
    replayed steps do not undo the restarts that happened. A resumed run takes the checkpoint's restarts."""
    kept = {k: v for k, v in now.items() if k not in saved or (in_process and k.startswith(HAPPENED))}
    return saved | kept


class LoopState:
    """Owns the loop's own counts, and turns the loop into a checkpoint's state and back: the step, every
    count (the loop's, the roles' restarts, the batch source's), the scoring state, the health signs
    and the batches launched ahead (collected first: PromptBatches.collect_launched)."""

    def __init__(self, roles, batches, health, skipped_lines: int, set_step: Callable[[int], None]):
        """set_step: moves the loop to a restored checkpoint's step, before the weights go to the engines
        (a death or a stall in that sync is then reported at the restored step)."""
        self.roles, self.batches, self.health, self.set_step = roles, batches, health, set_step
        self.counters = {"data/skipped_lines": skipped_lines, "rollout/dropped_groups": 0}
        self.counters |= {"learner/skipped_updates_in_a_row": 0, "reward/unjudged_steps_in_a_row": 0}

    def counts(self) -> dict:
        """Every count the loop reports and checkpoints: its own, the roles' restarts, the batch source's."""
        r = self.roles
        restarts = {"restarts/rollout": r.rollout_restarts, "restarts/scoring": r.scoring.restarts}
        restarts["restarts/learner"] = r.learner_restarts
        members = {"rollout/engines_joined": r.rollout.members.joined, "rollout/engines_left": r.rollout.members.left}
        return restarts | members | self.counters | self.batches.counts()

    def state_dict(self, step: int) -> dict:
        """The loop at `step` as a checkpoint keeps it (JSON-ready)."""
        counts, scoring = self.counts(), self.roles.scoring.state_dict()
        health = self.health.state_dict()
        return {"step": step, "counters": counts, "scoring": scoring, "health": health} | self.batches.state_dict()

    def resume(self, checkpointer) -> int:
        """The checkpoint a resumed run starts from back (Checkpointer.resume_from): the learner's files,
        then the loop's state. Returns its step."""
        state = checkpointer.load(self.roles.learner, checkpointer.resume_from)
        step = self.load_state_dict(state, in_process=False)
        print(f"relay: resumed from {checkpointer.resume_from} at step {step}", flush=True)
        return step

    def load_state_dict(self, state: dict, in_process: bool) -> int:
        """A checkpoint's loop `state` back (the learner restored already), its counts as restored_counters
        says, and the restored learner's weights to the engines (fresh ones hold the initial model, live
        ones a later policy). Returns the checkpoint's step."""
        counts = restored_counters(self.counts(), state["counters"], in_process)
        self.roles.scoring.load_state_dict(state["scoring"])
        step = state["step"]
        self.set_step(step)
        self.counters |= {k: counts[k] for k in self.counters}
        self.roles.rollout_restarts = counts["restarts/rollout"]
        self.roles.scoring.restarts = counts["restarts/scoring"]
        self.roles.learner_restarts = counts["restarts/learner"]
        members = self.roles.rollout.members
        members.joined, members.left = counts["rollout/engines_joined"], counts["rollout/engines_left"]
        self.batches.load_state_dict(state, counts)
        self.health.load_state_dict(state.get("health"))  # none in a checkpoint from before health existed
        self.roles.channel.send(step)
        return step
