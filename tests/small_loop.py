"""Small stand-ins for the remote roles (engines, scoring service, learner, weight channel) that record
their calls, and a real Trainer built on them (real Roles, PromptBatches, Evaluator, Checkpointer and
Tracker), so unit tests drive the real loop without Ray."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

from orchestrator.config.load import load_config
from orchestrator.loop.batches import EndpointBatches, PromptBatches
from orchestrator.loop.evaluator import Evaluator
from orchestrator.loop.parts import LoopParts
from orchestrator.loop.roles import Roles
from orchestrator.loop.trainer import Trainer
from reward_service.types import ScoredBatch
from rollout.types import RolloutBatch
from tests.helpers import REPO

DEFAULT = REPO / "configs" / "grpo_tiny_cpu.yaml"
STATS = {"kl/ref_seq": 0.0, "learner/skipped_steps": 0.0, "learner/nonfinite_losses": 0.0}


def samples(prompts: int, per_prompt: int, version: int) -> RolloutBatch:
    n = prompts * per_prompt
    return RolloutBatch(
        [i // per_prompt for i in range(n)],
        [[1]] * n,
        [[2, 3]] * n,
        [[-0.5, -0.5]] * n,
        ["x"] * n,
        ["stop"] * n,
        version_first=[version] * n,
        version_last=[version] * n,
    )


def scores(rewards: list[float], valid: list[bool] | None = None) -> ScoredBatch:
    n, valid = len(rewards), valid or [True] * len(rewards)
    return ScoredBatch(list(rewards), {}, valid, [not v for v in valid], [[-0.5, -0.5]] * n, raw=list(rewards))


class Engines:
    """The rollout pool: every launch generates `per_prompt` samples per prompt at the step it was
    launched for (so never stale); `asleep` records the sleep and wake."""

    def __init__(self, calls: list, per_prompt: int = 2):
        self.calls, self.per_prompt, self.workers = calls, per_prompt, []
        self.members = SimpleNamespace(joined=0, left=0)
        self.evaluations: list[tuple[int, int]] = []  # (step, draw) of each evaluation's generate call

    def submit(self, prompts, step, greedy=False, sampling=None, tasks=None, draw=0) -> list:
        self.calls.append(("submit", step, draw))
        return [(len(prompts), step)]

    def collect(self, pending: list) -> RolloutBatch:
        self.calls.append("generate")
        return RolloutBatch.concat([samples(n, self.per_prompt, step) for n, step in pending])

    def generate(self, prompts, step, greedy=False, sampling=None, tasks=None, draw=0) -> RolloutBatch:
        self.evaluations.append((step, draw))
        return samples(len(prompts), 1 if greedy else self.per_prompt, step)

    def busy_seconds(self) -> dict[str, float]:
        return {"engine": 0.0}

    def restart_counts(self) -> list[int]:
        return [0]

    def __len__(self) -> int:
        return 1

    def prune(self) -> int:  # a fixed pool: no engine leaves with its node, none joins
        return 0

    def admit(self) -> int:
        return 0

    def lost(self, error) -> bool:
        return False

    @contextmanager
    def asleep(self, enabled: bool):
        if enabled:
            self.calls.append("sleep")
        yield
        if enabled:
            self.calls.append("wake_up")


class Scoring:
    """The scoring pool: `judge(batch, k)` gives the scores of the k-th training batch scored;
    evaluation scores 1."""

    def __init__(self, calls: list, judge):
        self.calls, self.judge, self.restarts, self.actor, self.scored = calls, judge, 0, None, 0

    def score(self, batch, metadata, temperature, judged=None) -> ScoredBatch:
        self.calls.append("score")
        self.scored += 1
        return self.judge(batch, self.scored - 1)

    def reference(self, batch, temperature, ahead=None) -> list[list[float]]:
        self.calls.append("reference")
        return [[-0.5] * len(r) for r in batch.response_ids]

    def judge_ahead(self, pending, metadata, temperature):
        self.calls.append(("judge_ahead", list(pending), [m["answer"] for m in metadata]))
        return len(self.calls)

    def evaluate(self, batch, metadata, temperature, with_reference, suite="") -> ScoredBatch:
        return scores([1.0] * len(batch))

    def busy_seconds(self) -> float:
        return 0.0

    def state_dict(self) -> dict:
        return {"running": "state"}

    def load_state_dict(self, state: dict) -> None:
        self.loaded = state


class Learner:
    """The learner group: `experience` then `train`, which returns `stats`; checkpoints are a file each,
    holding `tag` (which run wrote it); `restored`: the tag of the checkpoint last loaded."""

    def __init__(self, calls: list, stats: dict | None = None, tag: str = "learner"):
        self.calls, self.stats, self.ranks, self.tag, self.restored = calls, stats or STATS, ["rank 0"], tag, None

    def experience(self, batch, scored) -> None:
        self.calls.append("experience")

    def train(self, step) -> dict:
        self.calls.append("train")
        return dict(self.stats)

    def update_kl(self, current_kl: float, n_samples: int) -> float:
        self.calls.append(("update_kl", current_kl, n_samples))
        return 0.01

    def policy_logprobs(self, batch, reference: bool = False) -> list[list[float]]:
        """-0.5 a token; reference (the LoRA policy's base, its adapter off): -0.8."""
        return [[-0.8 if reference else -0.5] * len(r) for r in batch.response_ids]

    def save(self, path: Path) -> None:
        self.calls.append(("save", path.parent.name))
        path.mkdir(parents=True)
        (path / "weights").write_text(self.tag)

    def load(self, path: Path) -> None:
        self.calls.append(("load", path.parent.name))
        weights = path / "weights"
        self.restored = weights.read_text() if weights.exists() else None  # none in one a test wrote by hand

    def lost(self, error) -> bool:
        return getattr(error, "actor_id", None) == "rank 0"

    def raise_if_lost(self, error) -> None:
        """No stand-in rank dies behind a peer's failure."""

    def restart(self) -> None:
        self.calls.append("restart learner")


class Channel:
    def __init__(self, calls: list):
        self.calls = calls

    metrics = {"sync/probe_gap": 0.0, "sync/bytes": 0}

    def send(self, version: int, wait: bool = True) -> None:
        self.calls.append(("sync", version))

    def wait_sent(self) -> None:
        pass

    def connect(self) -> None:
        self.calls.append("connect")


def examples(n: int) -> list[dict]:
    return [{"prompt": f"{i}+1=", "answer": str(i + 1), "metadata": {}} for i in range(n)]


def small_trainer(
    tmp_path: Path, *overrides: str, judge=None, stats=None, sleep_engines=False, gateway=None, run_dir=None, tag=None
):
    """A real Trainer (2 prompts x 2 samples a step, 3 steps) on the stand-ins above, and the list
    that records every call they get, in order. `judge(batch, k)`: the k-th scored batch's scores
    (default: rewards 0, 1, ...); `gateway`: batches from the agent endpoint instead of prompts;
    `run_dir`: the run's folder (default tmp_path/small); `tag`: what the learner's checkpoints hold."""
    calls = []
    run_dir = run_dir or tmp_path / "small"
    base = [f"run_root={run_dir.parent}", f"name={run_dir.name}", "logging.wandb.mode=disabled"]
    base += ["data.rollout_batch_size=2", "checkpoint.resume=never"]
    base += ["rollout.sampling.n_samples_per_prompt=2", "total_steps=3", "eval.every_n_steps=0", "data.shuffle=false"]
    base += ["algorithm.mini_batch_size=4", "algorithm.micro_batch_size=4", "checkpoint.every_n_steps=0"]
    cfg = load_config(DEFAULT, base + list(overrides))
    judge = judge or (lambda batch, k: scores([float(i % 2) for i in range(len(batch))]))
    engines, scoring, learner = Engines(calls), Scoring(calls, judge), Learner(calls, stats, tag or "learner")
    roles = Roles(engines, scoring, learner, Channel(calls), sleep_engines=sleep_engines)
    if gateway is not None:
        batches = EndpointBatches(cfg, gateway)
    else:
        batches = PromptBatches(cfg, examples(20), engines, scoring, roles.restart_rollout)
    evaluator = Evaluator(cfg, examples(3), Path(cfg.run_root) / cfg.name, engines, scoring, learner)
    trainer = Trainer(cfg, LoopParts(roles, batches, evaluator, skipped_lines=0))
    return trainer, calls
