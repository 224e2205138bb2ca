"""A quiet terminal: the terminal shows relay's own lines (the launch summary, the progress bar, health
signs, the held-out tables); what the libraries relay starts print there on their own (Ray's notices,
DeepSpeed's accelerator line, vLLM's and transformers' logs and progress bars, wandb's run banner and
history, Python warnings) goes to the run folder's relay.log instead. `--verbose` leaves them on the
terminal. The actors' own output never reaches it (ray.init(log_to_driver=False)): Ray keeps it in its
session logs.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

# the loggers of the libraries the driver process imports, each of which writes to the terminal by default
LIBRARIES = (
    "ray",
    "deepspeed",
    "DeepSpeed",
    "vllm",
    "transformers",
    "huggingface_hub",
    "torch",
    "math_verify",
    "matplotlib",
    "urllib3",
    "filelock",
    "py.warnings",
)


def quiet_libraries(run_dir: Path, verbose: bool = False) -> Path | None:
    """Send the libraries' terminal output to run_dir/relay.log (returned); nothing changes if verbose.
    Call it before the run starts Ray or wandb (the CLI does, after importing Ray: Ray sets up its own
    terminal handler at import)."""
    if verbose:
        return None
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "relay.log"
    # each library below installs a terminal handler when first imported or used: done here, to replace it.
    # DeepSpeed's is made on the sys.stdout of that moment and logs the accelerator it found at once; the
    # driver imports it whenever transformers saves a model (a builtin policy, the pipeline's stages)
    with path.open("a") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        import deepspeed  # noqa: F401
        import ray  # noqa: F401
        from transformers.utils import logging as hf_logging

        hf_logging.get_logger()
    hf_logging.disable_progress_bar()  # save_pretrained's shard-writing bars

    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    for name in LIBRARIES:
        logger = logging.getLogger(name)
        logger.handlers, logger.propagate = [handler], False
    logging.captureWarnings(True)  # warnings.warn -> the py.warnings logger -> relay.log
    # wandb prints its banner and run history itself, not through logging: its own debug log in the run
    # folder's wandb/ keeps them (the tracker's line says where the run is)
    os.environ.setdefault("WANDB_SILENT", "true")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    return path
