"""ScoringService: the frozen judge of a rollout batch, as a Ray actor called by method.

    rewards (sources combined, clipped, normalised) + reference logprobs -> ScoredBatch

Raw reward: the sources' weighted sum (what eval/* and reward/mean report). The trained reward adds
the DAPO overlong penalty, then clips and normalises; evaluation never does any of that.
"""

from __future__ import annotations

import dataclasses
import logging
import uuid

import ray
import torch

from reward_service.combine import SourceRun, call_counts, combine, run_source
from reward_service.config import InvalidPolicy, Normalization, RewardConfig
from reward_service.reference import ReferenceModel
from reward_service.shaping import RunningMeanStd, clipped, overlong_penalty, shape
from reward_service.sources import build_source, deadline_s
from reward_service.types import ScoredBatch
from rollout.types import RolloutBatch
from runtime.device import process_device
from runtime.forward import PolicyFunction
from runtime.profiling import Busy, Profiled

log = logging.getLogger(__name__)


def source_names(cfg: RewardConfig) -> list[str]:
    """Metric names: the source's `name`, else its kind; repeats get #2, #3."""
    names: list[str] = []
    for s in cfg.sources:
        base = s.name or s.kind.value
        names.append(base if base not in names else f"{base}#{sum(n.split('#')[0] == base for n in names) + 1}")
    return names


class RewardFunction:
    """The configured sources with their weights, without any model of the policy: what
    `relay serve-reward` serves and what ScoringService uses for rewards."""

    def __init__(
        self, cfg: RewardConfig, device: torch.device = torch.device("cpu"), function: PolicyFunction = PolicyFunction()
    ):
        """`device`, `function`: where reward models run (the scoring process's), in the learner's dtype and packing."""
        self.cfg = cfg
        self.names = source_names(cfg)
        self.sources = {
            n: build_source(s, cfg.micro_batch_size, device, function) for n, s in zip(self.names, cfg.sources)
        }
        self.weights = {n: s.weight for n, s in zip(self.names, cfg.sources)}
        # each call's deadline is the source's whole budget (a remote one's retries included)
        self.deadlines = {n: deadline_s(self.sources[n], s) for n, s in zip(self.names, cfg.sources)}

    def state_dict(self) -> dict:
        """Each stateful source's state (a judge's verdict cache), by name."""
        return {n: src.state_dict() for n, src in self.sources.items() if hasattr(src, "state_dict")}

    def load_state_dict(self, state: dict) -> None:
        for name, source_state in state.items():
            self.sources[name].load_state_dict(source_state)

    def run(self, prompts: list[str], responses: list[str], metadata: list[dict]):
        runs = {n: run_source(src, prompts, responses, metadata, self.deadlines[n]) for n, src in self.sources.items()}
        total, invalid = combine(runs, self.weights)
        return runs, total, invalid

    def __call__(self, prompts, responses, metadata) -> list[float | None]:
        _, total, invalid = self.run(prompts, responses, metadata)
        return [None if bad else t for t, bad in zip(total, invalid)]


@dataclasses.dataclass
class Judged:
    """A batch judged but not yet shaped: each source's run, the combined raw reward, which samples
    are invalid, and the overlong penalty (0s when off) shaping adds."""

    runs: dict
    total: list[float]
    invalid: list[bool]
    overlong: list[float]


def joined(parts: tuple) -> RolloutBatch:
    """The batch the parts make together, in order (one part: itself). A part may be a list of pending
    generate calls (ScoringPool.judge_ahead): waited for here, in the call's own thread, so that
    Ray need not hold this caller's later calls (busy_seconds) until the generation ends."""
    batches = [
        ray.get(b) if isinstance(b, ray.ObjectRef) else b for p in parts for b in (p if isinstance(p, list) else [p])
    ]
    return batches[0] if len(batches) == 1 else RolloutBatch.concat(batches)


class ScoringService(Profiled, Busy):
    """The frozen judge (a Ray actor): it owns the reward sources, the reference model, the reward
    shaping, the running reward normaliser and the judges' verdict caches (its state)."""

    def __init__(
        self,
        cfg: RewardConfig,
        reference_path: str,
        function: PolicyFunction = PolicyFunction(),
        threads: int = 0,
        suites: dict[str, list] | None = None,
        reference: bool = True,
    ):
        """`function`: the learner's forward (its dtype, chunking, packing, attention: the reference's logprobs
        then match the policy's; reward models run in its dtype); `suites`: the reward sources of each
        evaluation suite that has its own (evaluate's `suite`); `reference` False: the learner computes the
        reference (a LoRA policy's base, learner.lora.reference), so no copy of it is loaded here and its
        logprobs come back empty. The device is this process's (runtime.device)."""
        if threads:
            torch.set_num_threads(threads)
        self.cfg = cfg
        self.device = process_device()
        self.reward = RewardFunction(cfg, self.device, function)
        self.suite_rewards = {
            name: RewardFunction(dataclasses.replace(cfg, sources=sources), self.device, function)
            for name, sources in (suites or {}).items()
        }
        path = cfg.reference_model_path or reference_path
        self.reference = ReferenceModel(path, function, cfg.micro_batch_size, self.device) if reference else None
        self.tokenizer = self.reference.tokenizer if reference else tokenizer_of(path)
        self.running = RunningMeanStd()
        self._instance = uuid.uuid4().hex  # tells a restarted actor from the one before (ScoringPool)
        self.keep_threads(threads)

    def ready(self) -> bool:
        return True

    def instance_id(self) -> str:
        return self._instance

    def score(self, batch: RolloutBatch, metadata: list[dict], temperature: float = 1.0) -> ScoredBatch:
        """For training: raw rewards plus the overlong penalty, clipped and normalised (the running
        normaliser moves); `raw` keeps the sources' sum. The reference logprobs are the next phase
        (`reference_logprobs`): here each sample's are empty. `metadata[j]` belongs to prompt j of the
        step (answer, task entry, ...)."""
        return self.finish(self.judge(batch, metadata=metadata, temperature=temperature))

    def judge(self, *parts: RolloutBatch, metadata: list[dict], temperature: float = 1.0) -> Judged:
        """The half of `score` that reads no state (raw rewards) of the batch the parts make together,
        in order. Asynchronous training calls it with the generate calls still pending, so it runs as
        soon as they finish, while the learner trains on the batch before."""
        batch = joined(parts)
        with self.working():
            runs, total, invalid = self._judge(batch, metadata)
            penalty = self._overlong(batch)
            if self.cfg.overlong_buffer:
                runs["overlong"] = SourceRun(penalty)  # reported beside the sources
            return Judged(runs, total, invalid, penalty)

    def reference_logprobs(self, *parts: RolloutBatch, temperature: float = 1.0) -> list[list[float]]:
        """The paper's reference phase: the frozen reference policy's logprob of each sampled token of
        the batch the parts make together (pending generate calls, as for `judge`)."""
        batch = joined(parts)
        if self.reference is None:  # the learner computes it
            return [[] for _ in range(len(batch))]
        with self.working():
            return self.reference.logprobs(batch, temperature)

    def finish(self, judged: Judged) -> ScoredBatch:
        """The other half: add the overlong penalty, clip and normalise (the running normaliser moves,
        in the order of the calls). Under invalid: zero a sample that could not be judged enters as
        a raw 0, exactly like a wrong answer (normalised with the rest); under drop it is left out."""
        zero = self.cfg.invalid == InvalidPolicy.zero
        trained = [(0.0 if bad and zero else t) + p for t, bad, p in zip(judged.total, judged.invalid, judged.overlong)]
        left_out = [bad and not zero for bad in judged.invalid]
        rewards = shape(trained, left_out, self.cfg.clip, self.cfg.normalization, self.running)
        scored = self._scored(judged.runs, judged.total, judged.invalid, rewards, [[] for _ in judged.total])
        if self.cfg.normalization == Normalization.batch:  # for a batch joined from several calls
            scored.unnormalised = [0.0 if bad else r for r, bad in zip(clipped(trained, self.cfg.clip), left_out)]
        return scored

    def evaluate(
        self,
        batch: RolloutBatch,
        metadata: list[dict],
        temperature: float = 1.0,
        with_reference: bool = True,
        suite: str = "",
    ) -> ScoredBatch:
        """For evaluation, read-only: raw combined rewards (no overlong penalty, no clip, no
        normalisation; 0 where invalid), the normaliser untouched; reference logprobs only when asked for.
        `suite`: an evaluation suite with reward sources of its own scores by those."""
        with self.working():
            runs, total, invalid = self._judge(batch, metadata, self.suite_rewards.get(suite, self.reward))
            asked = with_reference and self.reference is not None  # else the learner's (Evaluator.score)
            ref = self.reference.logprobs(batch, temperature) if asked else [[] for _ in range(len(batch))]
        rewards = [0.0 if bad else t for t, bad in zip(total, invalid)]
        return self._scored(runs, total, invalid, rewards, ref)

    def _judge(self, batch: RolloutBatch, metadata: list[dict], reward: RewardFunction | None = None):
        # text for rule/function/remote sources; a reward model reads the data's own prompt from
        # metadata["prompt"] when the caller gives it (see RewardModelSource), these only without one
        prompts = self.tokenizer.batch_decode(batch.prompt_ids, skip_special_tokens=True)
        per_sample = [metadata[j] for j in batch.prompt_index]
        if batch.env_return:  # episodes: each sample's own return, for the environment source
            per_sample = [{**m, "env_return": r} for m, r in zip(per_sample, batch.env_return)]
        runs, total, invalid = (reward or self.reward).run(prompts, batch.response_text, per_sample)
        if any(batch.env_failure):  # an episode the environment broke off: judged by no source, whatever text it left
            failed = [bool(f) for f in batch.env_failure]
            for run in runs.values():
                run.scores = [None if f else x for x, f in zip(run.scores, failed)]
            invalid = [bad or f for bad, f in zip(invalid, failed)]
        return runs, total, invalid

    def _overlong(self, batch: RolloutBatch) -> list[float]:
        """DAPO's soft overlong punishment, on the model's own tokens: training shaping only."""
        c = self.cfg
        if not c.overlong_buffer:
            return [0.0] * len(batch)
        return overlong_penalty(batch.model_lengths, c.overlong_max_tokens, c.overlong_buffer, c.overlong_penalty)

    def _scored(self, runs, total, invalid, rewards, ref_logprobs) -> ScoredBatch:
        drop = self.cfg.invalid == InvalidPolicy.drop
        return ScoredBatch(
            rewards=rewards,
            raw=[float("nan") if bad else t for t, bad in zip(total, invalid)],
            components={n: [float("nan") if s is None else s for s in r.scores] for n, r in runs.items()},
            valid=[not (drop and bad) for bad in invalid],
            invalid=invalid,
            ref_logprobs=ref_logprobs,
            metrics=call_counts(runs),
            errors={n: r.errors[0] for n, r in runs.items() if r.errors},
        )

    @ray.method(concurrency_group="stats")
    def busy_seconds(self) -> float:
        return Busy.busy_seconds(self)

    def state_dict(self) -> dict:
        """The running normaliser and the sources' state (judges' verdict caches, those of the suites too)."""
        sources = {"": self.reward.state_dict()} | {k: r.state_dict() for k, r in self.suite_rewards.items()}
        return {"running": self.running.state_dict(), "sources": sources}

    def load_state_dict(self, state: dict) -> None:
        self.running.load_state_dict(state["running"])
        sources = state.get("sources", {})  # none in a checkpoint from before the judges' caches were kept
        for suite, reward in [("", self.reward), *self.suite_rewards.items()]:
            reward.load_state_dict(sources.get(suite, {}))


def tokenizer_of(path: str):
    """The model's tokenizer alone (a scoring service with no reference model to take it from)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
