"""Where metrics go: a JSONL file in the run directory (always), wandb (offline by default), and
one console line per step with the numbers a practitioner watches."""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

from orchestrator.config import LoggingConfig, WandbMode


class Tracker:
    def __init__(self, cfg: LoggingConfig, run_dir: Path, name: str, config: dict, resumed_at: int | None):
        """resumed_at: the step of the checkpoint a resumed run starts from (None: a fresh run)."""
        self.cfg, self.path = cfg, run_dir / "metrics.jsonl"
        run_dir.mkdir(parents=True, exist_ok=True)
        for path in (self.path, run_dir / "samples.jsonl"):  # a resumed run redoes the steps after its checkpoint
            keep_until(path, -1 if resumed_at is None else resumed_at)  # a fresh run starts anew
        self.file = self.path.open("a")
        self.wandb = None
        if cfg.wandb.mode != WandbMode.disabled:
            import wandb

            self.wandb = wandb.init(project=cfg.wandb.project, entity=cfg.wandb.entity or None, name=name,
                                    config=config, mode=cfg.wandb.mode.value, dir=str(run_dir), resume="allow",
                                    id=name.replace("/", "_"))
        self.start = time.time()

    def log(self, step: int, metrics: dict[str, float], total_steps: int) -> None:
        row = {"step": step, **{k: (v if isinstance(v, (int, float)) and math.isfinite(v) else None) for k, v in metrics.items()}}
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self.wandb is not None:
            self.wandb.log(metrics, step=step)
        if self.cfg.progress_bar and step % self.cfg.log_every == 0 and "timing/total" in metrics:
            print(self.line(step, metrics, total_steps), flush=True)

    def line(self, step: int, m: dict[str, float], total_steps: int) -> str:
        def f(key, fmt):
            return format(m[key], fmt) if key in m and m[key] is not None else "-"

        done = int(20 * step / max(total_steps, 1))
        return (f"[{'#' * done}{'.' * (20 - done)}] step {step}/{total_steps}  reward {f('reward/mean', '.3f')}  "
                f"acc {f('reward/accuracy', '.2f')}  kl {f('kl/ref', '.4f')}  entropy {f('learner/entropy', '.3f')}  "
                f"len {f('response/length_mean', '.1f')}  {f('timing/total', '.1f')}s/step")

    def log_table(self, name: str, step: int, rows: list[dict]) -> None:
        """To samples.jsonl in the run directory (a line per table), and to wandb as a Table."""
        with (self.path.parent / "samples.jsonl").open("a") as f:
            f.write(json.dumps({"step": step, "table": name, "rows": rows}) + "\n")
        if self.wandb is not None and rows:
            import wandb

            # with its step: a log without one moves wandb's step on, and it then drops this step's later logs
            self.wandb.log({name: wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])}, step=step)

    def log_image(self, name: str, step: int, path: Path | None) -> None:
        """A figure already written to the run directory (`path`; None: there was none), to wandb too."""
        if self.wandb is not None and path is not None:
            import wandb

            self.wandb.log({name: wandb.Image(str(path))}, step=step)

    def close(self) -> None:
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


def keep_until(path: Path, step: int) -> None:
    """Drop the lines of a JSONL log (metrics.jsonl, samples.jsonl) whose step is after `step`, and a
    torn last line (the process died writing it)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row["step"] <= step:
            kept.append(line + "\n")
    path.write_text("".join(kept))
