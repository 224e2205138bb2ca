"""The quiet terminal: the libraries' notices go to the run folder's relay.log (--verbose: the terminal)."""

import os
import subprocess
import sys

import torch

from tests.helpers import REPO, foreign_lines

PROBE = """
import logging, sys, warnings
from pathlib import Path
from runtime.quiet import quiet_libraries
print(quiet_libraries(Path(sys.argv[1]), verbose=sys.argv[2] == "1"))
logging.getLogger("ray").warning("a ray notice")
logging.getLogger("DeepSpeed").warning("a deepspeed notice")
logging.getLogger("math_verify.parser").warning("a math-verify notice")
warnings.warn("a python warning")
"""


def run_probe(tmp_path, verbose: bool, env=None):
    return subprocess.run(
        [sys.executable, "-c", PROBE, str(tmp_path), "1" if verbose else "0"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )


def test_the_libraries_notices_go_to_relay_log_and_verbose_keeps_them_on_the_terminal(tmp_path):
    # without DS_ACCELERATOR (conftest names it), DeepSpeed's import logs the accelerator it found at once,
    # on a handler made then: that line lands in relay.log too
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    quiet = run_probe(tmp_path / "quiet", verbose=False, env=env)
    assert quiet.returncode == 0, quiet.stderr
    assert quiet.stdout.strip() == str(tmp_path / "quiet" / "relay.log") and quiet.stderr == ""
    log = (tmp_path / "quiet" / "relay.log").read_text()
    for notice in ("a ray notice", "a deepspeed notice", "a math-verify notice", "a python warning"):
        assert notice in log, log
    assert "Setting accelerator to CPU" in log or torch.cuda.is_available()
    loud = run_probe(tmp_path / "loud", verbose=True)
    assert loud.stdout.splitlines()[-1:] == ["None"] and not (tmp_path / "loud" / "relay.log").exists()
    assert all(n in loud.stdout + loud.stderr for n in ("a ray notice", "a deepspeed notice", "a python warning"))


def test_the_terminal_check_tells_relays_lines_from_a_librarys():
    own = [
        "relay train",
        "  run folder  runs/x",
        "[####................] step 1/5  reward 0.363  acc 0.36  kl 0.0000  entropy 0.436  len 3.6  4.6s/step",
        "greedy accuracy                     0.766      0.953",
        "'26+26='                   '53'                           0.00  '52'                           1.00",
        "relay health: step 15: kl_band: the per-token KL ...",
    ]
    foreign = [
        "2026-12-04 13:23:46,505\tWARNING authentication_token_setup.py:85 -- Token authentication is enabled",
        "wandb: Tracking run with wandb version 0.31.0",
        "[2026-12-04 13:26:01,333] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.",
        "Writing model shards: 100%|██████████| 1/1 [00:00<00:00, 327.71it/s]",
        "  ax.legend(fontsize=7, loc='best')",
    ]
    assert foreign_lines("\n".join(own + foreign)) == foreign
