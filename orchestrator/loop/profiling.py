"""One training step profiled in every role (logging.profile_step, `relay train --profile`):
runs/<name>/profile/ gets phases.txt (the step's seconds by phase), driver.txt (the orchestrator's
own Python time), <role>.txt (torch ops and Python time of the role's calls) and <role>.trace.json
(a Chrome/Perfetto trace, written on the role's own node)."""

from __future__ import annotations

import cProfile
import io
import pstats
from contextlib import contextmanager
from pathlib import Path

from runtime import watchdog


@contextmanager
def profiled(roles: dict, out_dir: Path, timings: dict[str, float]):
    """Profile every actor in `roles` (name -> actor with runtime.profiling.Profiled) and this process
    around the block; afterwards write the files above, with `timings` (filled by the block) as the phases."""
    out_dir.mkdir(parents=True, exist_ok=True)
    watchdog.get([actor.profile.remote(True) for actor in roles.values()])
    driver = cProfile.Profile()
    driver.enable()
    try:
        yield
    finally:
        driver.disable()
        texts = watchdog.get(
            [actor.profile.remote(False, str(out_dir / f"{name}.trace.json")) for name, actor in roles.items()]
        )
    for name, text in zip(roles, texts):
        (out_dir / f"{name}.txt").write_text(text)
    out = io.StringIO()
    pstats.Stats(driver, stream=out).sort_stats("tottime").print_stats(25)
    (out_dir / "driver.txt").write_text(out.getvalue())
    (out_dir / "phases.txt").write_text(phase_table(timings))
    print(f"relay: profile of this step in {out_dir}", flush=True)


def phase_table(timings: dict[str, float]) -> str:
    """'timing/<phase>' seconds as a table with each phase's share of timing/total."""
    total = timings["timing/total"]
    rows = [f"{'phase':18s} {'s':>8s} {'share':>7s}"]
    for key, value in timings.items():
        if key != "timing/total":
            rows.append(f"{key.removeprefix('timing/'):18s} {value:8.3f} {value / total:7.1%}")
    rows.append(f"{'total':18s} {total:8.3f}")
    return "\n".join(rows) + "\n"
