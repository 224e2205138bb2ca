"""Which run a run folder's checkpoints and records belong to (its lineage), and, when a run starts, setting
aside what belongs to another run or to a branch this run leaves, so that retention, checkpoint.resume=auto,
a learner recovery and the end-of-run line only ever see this run's. Nothing is deleted: what is set aside
moves to runs/<name>/set_aside/<lineage>/, laid out as a run folder, and the run says so in one line."""

from __future__ import annotations

import json
import secrets
import shutil
import time
from pathlib import Path

from learner.checkpoint import recover
from orchestrator.loop.tracking import say

LEGACY = "unrecorded"  # the lineage of checkpoints written before relay recorded one: one lineage of their own
LINEAGE_FILE = "lineage"  # runs/<name>/lineage: the lineage of the run the folder holds now
# runs/<name>/resumed_from: the checkpoint outside the folder's checkpoints/ that its run resumed from (another
# name's, or a set-aside run's): one of the run's own, what resume=auto and the end line go back to before
# the run has written one here
ORIGIN_FILE = "resumed_from"
# what a run writes into its folder besides checkpoints/ (relay.log, config.yaml, incidents/ and the wandb
# folder, which keeps each wandb run apart, are shared by every run of the name)
RECORDS = (
    "metrics.jsonl",
    "samples.jsonl",
    "eval_before.json",
    "eval_after.json",
    "eval_reference_samples.json",
    "pipeline.png",
    "wandb_id",
    ORIGIN_FILE,
)
RESUMED_RECORDS = ("eval_before.json", "eval_reference_samples.json", "metrics.jsonl", "samples.jsonl")


def new_lineage() -> str:
    """A fresh run's id: when it started, readable in a set-aside folder's name, and a random tail."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(3)


def lineage_of(checkpoint: Path) -> str:
    """The lineage recorded in a checkpoint's orchestrator.json (LEGACY: one from before relay recorded it)."""
    path = Path(checkpoint) / "orchestrator.json"
    if not path.exists():
        raise FileNotFoundError(f"checkpoint.resume: {checkpoint} is not a checkpoint (it has no orchestrator.json)")
    return json.loads(path.read_text()).get("lineage", LEGACY)


def checkpoints(root: Path, lineage: str | None = None) -> list[tuple[int, Path]]:
    """Complete checkpoints under `root` by step (of `lineage` only, if given); one a crash left set aside
    mid-publish is restored first."""
    if not root.exists():
        return []
    for old in root.glob("step_*.old"):
        recover(old.with_suffix(""))
    found = [
        (int(p.name.removeprefix("step_")), p)
        for p in root.glob("step_*")
        if p.name.removeprefix("step_").isdigit() and (p / "orchestrator.json").exists()
    ]
    return sorted((s, p) for s, p in found if lineage is None or lineage_of(p) == lineage)


def folder_lineage(run_dir: Path) -> str | None:
    """The run the folder holds: the one its lineage file names; in a folder from before the file, its newest
    checkpoint's, or LEGACY if it holds only records; None: it holds no run."""
    named = run_dir / LINEAGE_FILE
    if named.exists():
        return named.read_text().strip()
    found = checkpoints(run_dir / "checkpoints")
    if found:
        return lineage_of(found[-1][1])
    return LEGACY if any((run_dir / r).exists() for r in RECORDS) else None


def run_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """The checkpoints of the run the folder holds (folder_lineage), by step: its own under checkpoints/, and
    the one it resumed from outside them, if it did (origin)."""
    lineage = folder_lineage(run_dir)
    if lineage is None:
        return []
    start = origin(run_dir, lineage)
    return sorted(checkpoints(run_dir / "checkpoints", lineage) + ([(step_of(start), start)] if start else []))


def origin(run_dir: Path, lineage: str) -> Path | None:
    """The checkpoint outside checkpoints/ that the folder's run (`lineage`) resumed from, while it is there."""
    named = run_dir / ORIGIN_FILE
    start = Path(named.read_text().strip()) if named.exists() else None
    if start is None or not (start / "orchestrator.json").exists() or lineage_of(start) != lineage:
        return None
    return start


def step_of(checkpoint: Path) -> int:
    """The step a checkpoint holds (its orchestrator.json's)."""
    return int(json.loads((Path(checkpoint) / "orchestrator.json").read_text())["step"])


def resume_path(resume: str, run_dir: Path) -> Path | None:
    """checkpoint.resume: never -> None; auto -> the newest checkpoint of the run the folder holds, if any;
    else that path."""
    if resume == "never":
        return None
    if resume == "auto":
        found = run_checkpoints(run_dir)
        return found[-1][1] if found else None
    return Path(resume)


def claim(run_dir: Path, resume: str) -> tuple[str, Path | None]:
    """A starting run's lineage and the checkpoint it resumes (None: a fresh start), the folder made this
    run's first: continuing the folder's run from one of its checkpoints (run_checkpoints: the one it
    resumed from elsewhere too) sets aside the checkpoints after it (the branch it leaves); any other start
    (fresh, or from another folder's checkpoint) sets the folder's run aside, checkpoints and records, and
    brings the resumed checkpoint's records along, and the folder keeps where it came from (ORIGIN_FILE)."""
    root = run_dir / "checkpoints"
    held, start = folder_lineage(run_dir), resume_path(resume, run_dir)
    lineage = lineage_of(start) if start is not None else new_lineage()
    outside = start is not None and start.resolve().parent != root.resolve()
    came_from = origin(run_dir, held) if held is not None else None
    if start is not None and lineage == held and (not outside or start.resolve() == came_from):
        _set_aside_branch(run_dir, lineage, step_of(start))
    else:
        _set_aside_run(run_dir, held, start)
        if start is not None:
            _bring_records(start, run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / LINEAGE_FILE).write_text(lineage + "\n")
    if outside:
        (run_dir / ORIGIN_FILE).write_text(f"{start.resolve()}\n")
    return lineage, start


def _set_aside_run(run_dir: Path, held: str | None, start: Path | None) -> None:
    """The folder's run `held` (its checkpoints, complete or not, and its records) to set_aside/<held>/."""
    root = run_dir / "checkpoints"
    keep = start.resolve() if start is not None else None
    last = [p for _, p in checkpoints(root) if p.resolve() != keep]
    entries = [p for p in (root.iterdir() if root.exists() else ()) if p.resolve() != keep]
    records = [run_dir / r for r in RECORDS if (run_dir / r).exists()]
    if held is None or not (entries or records):
        return
    came_from = origin(run_dir, held)
    dest = _move_aside(run_dir / "set_aside" / held, entries, held)
    for p in records:
        p.rename(dest / p.name)
    if last:
        up_to, back = f"checkpoints up to {last[-1].name}", dest / "checkpoints" / last[-1].name
    else:
        up_to, back = (
            (f"resumed from {came_from}, no checkpoint of its own", came_from) if came_from else ("no checkpoint", None)
        )
    go_on = f" (checkpoint.resume={back} continues it here)" if back else ""
    say(
        run_dir,
        f"relay: {run_dir} held another run ({held}, {up_to}): set aside, not deleted, in {dest}{go_on}; "
        "next time, checkpoint.resume=auto continues the folder's run and name=<another> starts one beside it",
    )


def _set_aside_branch(run_dir: Path, lineage: str, step: int) -> None:
    """This run resumes its checkpoint of `step`: its later ones (the branch it leaves), with a copy of
    the records a resume reads and the branch's final evaluation, to set_aside/<lineage>.after_step_<step>/;
    a checkpoint of another run found beside them (none, unless put there by hand) to set_aside/<its lineage>/."""
    found = [(s, p, lineage_of(p)) for s, p in checkpoints(run_dir / "checkpoints")]
    for other in sorted({lin for _, _, lin in found if lin != lineage}):
        _move_aside(run_dir / "set_aside" / other, [p for _, p, lin in found if lin == other], other)
    later = [p for s, p, lin in found if lin == lineage and s > step]
    if not later:
        return
    dest = _move_aside(run_dir / "set_aside" / f"{lineage}.after_step_{step}", later, lineage)
    for name in RESUMED_RECORDS:  # copies: this run keeps its own (the Tracker trims the rows after `step`)
        if (run_dir / name).exists():
            shutil.copy2(run_dir / name, dest / name)
    for name in ("eval_after.json", "pipeline.png"):  # the branch's final evaluation, not this run's
        if (run_dir / name).exists():
            (run_dir / name).rename(dest / name)
    say(
        run_dir,
        f"relay: resuming step {step}: the checkpoints after it ({', '.join(p.name for p in later)}, a branch "
        f"this run leaves) are set aside, not deleted, in {dest}",
    )


def _move_aside(folder: Path, entries: list[Path], lineage: str) -> Path:
    """`entries` of a checkpoints folder moved to `folder`/checkpoints (`folder` new: _unique), which is
    marked as `lineage`'s; returns it."""
    dest = _unique(folder)
    (dest / "checkpoints").mkdir(parents=True)
    (dest / LINEAGE_FILE).write_text(lineage + "\n")
    # oldest first: a run killed mid-way leaves the newest in place, which resume=auto would continue
    for p in sorted(entries, key=_step_of):
        p.rename(dest / "checkpoints" / p.name)
    return dest


def _step_of(entry: Path) -> int:
    """step_N, step_N.tmp, step_N.old -> N; anything else first (-1)."""
    digits = entry.name.removeprefix("step_").split(".")[0]
    return int(digits) if digits.isdigit() else -1


def _bring_records(start: Path, run_dir: Path) -> None:
    """A run resumed from another folder's checkpoint (a set-aside run's, or another name's) takes that
    folder's records up to it (the Tracker drops the rows after it) and its evaluation before training,
    which a resumed run reads back; not its wandb id: it logs to a new wandb run, not into that folder's."""
    source = start.parent.parent
    if start.parent.name != "checkpoints" or source.resolve() == run_dir.resolve():
        return
    run_dir.mkdir(parents=True, exist_ok=True)
    for name in RESUMED_RECORDS:
        if (source / name).exists():
            shutil.copy2(source / name, run_dir / name)


def _unique(path: Path) -> Path:
    """`path`, or path.2, path.3, ... if it is taken (a run set aside twice)."""
    n, found = 1, path
    while found.exists():
        n += 1
        found = path.with_name(f"{path.name}.{n}")
    return found
