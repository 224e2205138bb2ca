"""Where metrics go: a JSONL file in the run directory (always), wandb (offline by default), and
one console line per step with the numbers a practitioner watches."""

from __future__ import annotations

import json
import math
import time
import uuid
from pathlib import Path

from orchestrator.config.schema import LoggingConfig, WandbMode


class Tracker:
    """Owns where a run's metrics go: metrics.jsonl (one row per step, rewound on resume and on a learner
    recovery), wandb (each step once: WandbSteps) and the console line."""

    def __init__(
        self,
        cfg: LoggingConfig,
        run_dir: Path,
        name: str,
        config: dict,
        resumed_at: int | None,
        finished: bool = False,
        total_steps: int | None = None,
    ):
        """resumed_at: the step of the checkpoint a resumed run starts from (None: a fresh run);
        finished: it resumes a run that had also evaluated after its last step (its rows are kept);
        total_steps: the run's last step (resumed at it, unfinished, the run evaluates it again)."""
        self.cfg, self.path = cfg, run_dir / "metrics.jsonl"
        run_dir.mkdir(parents=True, exist_ok=True)
        # a resumed run redoes the steps after its checkpoint, and the final evaluation at it
        # (unless it finished); a fresh run starts anew
        step = -1 if resumed_at is None else resumed_at
        final = keep_until(self.path, step, redo_final=not finished)
        keep_until(run_dir / "samples.jsonl", step, redo_final=final)
        self.file = self.path.open("a")
        self.wandb, self.wandb_has = None, WandbSteps()
        if cfg.wandb.mode != WandbMode.disabled:
            # wandb's next step after a rewind to N is N + 1: the final evaluation redone at N needs N - 1
            redo = resumed_at is not None and not finished and total_steps is not None and resumed_at >= total_steps
            self.wandb = start_wandb(cfg, run_dir, name, config, resumed_at, redo)
        self.start = time.time()

    def log(self, step: int, metrics: dict[str, float], total_steps: int) -> None:
        row = {
            "step": step,
            **{k: (v if isinstance(v, (int, float)) and math.isfinite(v) else None) for k, v in metrics.items()},
        }
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        self._to_wandb(metrics, step)
        if self.cfg.progress_bar and step % self.cfg.log_every == 0 and "timing/total" in metrics:
            print(self.line(step, metrics, total_steps), flush=True)

    def line(self, step: int, m: dict[str, float], total_steps: int) -> str:
        def f(key, fmt):
            return format(m[key], fmt) if key in m and m[key] is not None else "-"

        done = int(20 * step / max(total_steps, 1))
        return (
            f"[{'#' * done}{'.' * (20 - done)}] step {step}/{total_steps}  reward {f('reward/mean', '.3f')}  "
            f"acc {f('reward/accuracy', '.2f')}  kl {f('kl/ref', '.4f')}  entropy {f('learner/entropy', '.3f')}  "
            f"len {f('response/length_mean', '.1f')}  {f('timing/total', '.1f')}s/step"
        )

    def log_table(self, name: str, step: int, rows: list[dict]) -> None:
        """To samples.jsonl in the run directory (a line per table), and to wandb as a Table."""
        with (self.path.parent / "samples.jsonl").open("a") as f:
            f.write(json.dumps({"step": step, "table": name, "rows": rows}) + "\n")
        if self.wandb is not None and rows and self.wandb_has.new(step):
            import wandb

            # with its step: a log without one moves wandb's step on, and it then drops this step's later logs
            self._to_wandb({name: wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])}, step)

    def log_image(self, name: str, step: int, path: Path | None) -> None:
        """A figure already written to the run directory (`path`; None: there was none), to wandb too."""
        if self.wandb is not None and path is not None and self.wandb_has.new(step):
            import wandb

            self._to_wandb({name: wandb.Image(str(path))}, step)

    def _to_wandb(self, data: dict, step: int) -> None:
        if self.wandb is not None and self.wandb_has.new(step, "timing/total" in data):
            self.wandb.log(data, step=step)
            self.wandb_has.logged(step)

    def rewind(self, step: int) -> None:
        """Back to `step` in process (a learner recovery restored its checkpoint, the loop replays the
        steps after it): metrics.jsonl and samples.jsonl keep their rows up to `step`, as a resumed run's
        do; wandb keeps the steps it has (it cannot be rewound in process, and would drop or merge a log
        to a step it has: WandbSteps), so the replayed steps go to it only beyond them."""
        self.file.close()
        keep_until(self.path, step)
        keep_until(self.path.parent / "samples.jsonl", step)
        self.file = self.path.open("a")
        self.wandb_has.replaying()

    def close(self) -> None:
        if self.file.closed:
            return  # closed already (a run that gave up closes it before it raises)
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


def say(run_dir: Path, line: str) -> None:
    """A line for the user: the terminal, and the run folder's relay.log."""
    print(line, flush=True)
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "relay.log").open("a") as log:
        log.write(line + "\n")


class WandbSteps:
    """Which steps the wandb run holds, so each step goes to it once: wandb drops a log to a step below
    its current one (with a warning) and merges one to its current step into that step's row. After an
    in-process rewind (Tracker.rewind), the replayed steps up to the last one logged are its already:
    they are not logged again (their numbers are the same but for the clock readings), but for what
    only comes after the training row at the last one (wandb's current step, which takes logs merged
    into its row): the final evaluation, when the replay ended at the last step. A resumed run's
    wandb run starts after its checkpoint's step (start_wandb rewinds it; offline too: wandb 0.31 sets
    its starting step to the rewind's step + 1), and nothing of the resumed run is logged at or below it."""

    def __init__(self) -> None:
        self.last = -1  # the last step logged
        self.held = -1  # steps up to this one are the wandb run's already (replayed ones are not logged)

    def new(self, step: int, training_row: bool = False) -> bool:
        # the last step wandb holds is its current one, which still takes logs (merged into its row): the
        # final evaluation after a replay that ended at the last step gets there, its training row once
        return step > self.held or (step == self.held and not training_row)

    def logged(self, step: int) -> None:
        self.last = max(self.last, step)

    def replaying(self) -> None:
        self.held = max(self.held, self.last)


def start_wandb(
    cfg: LoggingConfig, run_dir: Path, name: str, config: dict, resumed_at: int | None, redo_final: bool = False
):
    """A fresh run gets a new wandb run (its id kept in the run directory: a later run of the same
    name is another wandb run). A resumed one rewinds that wandb run to its checkpoint's step, so
    the redone steps replace the first run's rather than being dropped as "less than the current
    step" (wandb's resume_from; offline, wandb records the rewind and applies it at `wandb sync`).
    redo_final: the resumed run evaluates its checkpoint's (last) step again, which a rewind to that
    step would drop: it rewinds one step further and logs that step's training row (metrics.jsonl's)
    again. Where the rewind is refused (online without the feature), or no id was kept, the resumed
    run logs to a new wandb run, and says so."""
    import wandb

    id_file = run_dir / "wandb_id"
    init = dict(
        project=cfg.wandb.project,
        entity=cfg.wandb.entity or None,
        name=name,
        config=config,
        mode=cfg.wandb.mode.value,
        dir=str(run_dir),
    )
    if resumed_at is not None and id_file.exists():
        old, rewind = id_file.read_text().strip(), resumed_at - 1 if redo_final else resumed_at
        try:
            run = wandb.init(id=old, resume_from=f"{old}?_step={rewind}", **init)
        except Exception as e:  # noqa: BLE001 (wandb raises its own errors for a refused rewind)
            why = f"wandb could not rewind run {old} to step {rewind} ({type(e).__name__}: {e})"
        else:
            for row in jsonl_rows_at(run_dir / "metrics.jsonl", resumed_at) if redo_final else []:
                run.log({k: math.nan if v is None else v for k, v in row.items() if k != "step"}, step=resumed_at)
            return run
    else:
        why = "no wandb id was kept in the run directory" if resumed_at is not None else ""
    new = uuid.uuid4().hex[:12]
    id_file.write_text(new + "\n")
    if why:
        print(f"relay: {why}; the resumed run logs to a new wandb run {new}", flush=True)
    return wandb.init(id=new, **init)


def jsonl_rows_at(path: Path, step: int) -> list[dict]:
    """The rows of a JSONL log at `step`."""
    rows = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [r for r in rows if r["step"] == step]


def keep_until(path: Path, step: int, redo_final: bool = False) -> bool:
    """Drop the lines of a JSONL log (metrics.jsonl, samples.jsonl) whose step is after `step`, a
    torn last line (the process died writing it) and, with redo_final, the lines at `step` that a
    final evaluation wrote (metrics: rows without timing/total; samples: any, as only a final
    evaluation writes them beside such a row). True if a line at `step` was dropped."""
    if not path.exists():
        return False
    kept, dropped = [], False
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        final = redo_final and row["step"] == step and "timing/total" not in row
        if row["step"] <= step and not final:
            kept.append(line + "\n")
        dropped = dropped or final
    path.write_text("".join(kept))
    return dropped
