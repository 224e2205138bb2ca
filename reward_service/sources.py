"""Reward sources: each turns (prompts, responses, metadata) into one score per sample.

A score of None, NaN or inf means "could not judge this sample"; the service isolates and counts
those, and exceptions, so one broken sample or source never stops the run.
`metadata[i]` carries the data's extra fields for sample i: `answer` (the reference answer) and,
for reasoning-gym prompts, `entry` (the task's own record).
"""

from __future__ import annotations

import functools
import importlib
import json
from pathlib import Path

import torch

from reward_service import rules
from reward_service.config import RewardSource, SourceKind
from reward_service.judge import JudgeSource, LocalJudge, OpenAIJudge, VLLMJudge, check_choice_tokens
from reward_service.remote import RemoteReward
from reward_service.rm_input import pad_right, rm_input_ids
from runtime.device import to_device
from runtime.endpoint_auth import REWARD_KEY_ENV, env_key
from runtime.forward import PolicyFunction
from runtime.packing import packed_forward, packing_for
from runtime.prompts import is_chat

REWARD_STATS_FILE = "relay_reward_stats.json"  # written next to a reward model by `relay rm`


class RuleSource:
    """A rule-based reward (math answer, exact match, format, length) of one configured source."""

    def __init__(self, cfg: RewardSource):
        self.cfg = cfg

    def score(self, prompts, responses, metadata) -> list[float | None]:
        kind = self.cfg.kind
        if kind == SourceKind.math_answer:
            return [rules.math_answer(r, m.get("answer")) for r, m in zip(responses, metadata)]
        if kind == SourceKind.exact_match:
            return [rules.exact_match(r, m.get("answer")) for r, m in zip(responses, metadata)]
        if kind == SourceKind.format:
            return [rules.format_reward(r, self.cfg.pattern) for r in responses]
        return [rules.length_penalty(r, self.cfg.target_length) for r in responses]


class EnvironmentSource:
    """The return the environment gave the episode (rollout/episodes.py), carried as
    metadata["env_return"]; None (invalid, counted) where the environment failed."""

    def score(self, prompts, responses, metadata) -> list[float | None]:
        return [m.get("env_return") for m in metadata]


class ReasoningGymSource:
    """A reasoning-gym task's own `score_answer(answer, entry)`; the entry travels in metadata.

    The answer is what reasoning-gym's own trainers pass: the last `<answer>...</answer>` of the
    response (`reasoning_gym.utils.extract_answer`), None without one (the task scores that 0), so
    prompts must ask for the tags (reasoning-gym's `SYSTEM_PROMPTS`)."""

    def score(self, prompts, responses, metadata) -> list[float | None]:
        from reasoning_gym.utils import extract_answer

        out = []
        for response, m in zip(responses, metadata):
            entry = m.get("entry")
            if not entry:
                out.append(None)
                continue
            scorer = _score_answer_fn(entry["metadata"]["source_dataset"])
            out.append(float(scorer(extract_answer(response), entry)))
        return out


@functools.lru_cache(maxsize=None)
def _score_answer_fn(name: str):
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(name)  # builds the task's dataset object: once per task


class FunctionSource:
    """User code: `module.path:function(prompts, responses, metadata) -> list of floats`."""

    def __init__(self, cfg: RewardSource):
        module, _, name = cfg.function.partition(":")
        try:
            self.fn = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"reward function {cfg.function!r} cannot be loaded: {e}") from None

    def score(self, prompts, responses, metadata):
        return list(self.fn(prompts, responses, metadata))


class RewardModelSource:
    """A sequence-classification model with one scalar output, scoring prompt + response with its
    own tokenizer, through the function `relay rm` trained it with (reward_service.rm_input);
    normalised by the mean/std stored beside it by `relay rm`, if present.

    The prompt is `metadata[i]["prompt"]`, as the data gave it to the policy (text or chat
    messages; the trainer and `relay eval` put it there). Without one (`relay serve-reward`,
    remote callers), or when it is token ids (the policy's vocabulary, not the RM's), the service's
    text `prompts[i]` is used: the prompt ids decoded with special tokens stripped."""

    def __init__(
        self,
        cfg: RewardSource,
        micro_batch_size: int,
        device: torch.device = torch.device("cpu"),
        dtype: str = "float32",
        packing: int | None = None,
    ):
        """packing: a packed row's token budget (runtime/packing.py), None = padded rows."""
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        self.tokenizer.padding_side = "right"
        self.device = device
        self.model = (
            AutoModelForSequenceClassification.from_pretrained(
                cfg.model_path, num_labels=1, dtype=getattr(torch, dtype)
            )
            .eval()
            .to(device)
        )
        self.model.requires_grad_(False)
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        stats = Path(cfg.model_path) / REWARD_STATS_FILE
        saved = json.loads(stats.read_text()) if stats.exists() else {"mean": 0.0, "std": 1.0}
        self.mean, self.std = float(saved["mean"]), float(saved["std"])
        self.micro_batch_size = micro_batch_size
        self.packing = packing_for(self.model.base_model, packing, f"learner.packing ({cfg.model_path})")

    @torch.no_grad()
    def score(self, prompts, responses, metadata) -> list[float]:
        seqs = [rm_input_ids(self.tokenizer, _rm_prompt(p, m), r) for p, r, m in zip(prompts, responses, metadata)]
        out = []
        for i in range(0, len(seqs), self.micro_batch_size):
            ids, attention = pad_right(seqs[i : i + self.micro_batch_size], self.tokenizer.pad_token_id)
            ids, attention = to_device((ids, attention), self.device)
            out += self.scores(ids, attention).float().tolist()
        return [(r - self.mean) / self.std for r in out]

    def scores(self, ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """The classifier's score of each right-padded row, read at its last token that is not padding (as
        transformers' sequence classifiers read it): packed, the trunk's states unpacked, then the `score` head."""
        head = getattr(self.model, "score", None)
        if self.packing is None or not isinstance(head, torch.nn.Linear):
            return self.model(input_ids=ids, attention_mask=attention).logits[:, 0]
        positions = (attention.cumsum(-1) - 1).clamp(min=0)
        out, plan = packed_forward(self.model.base_model, ids, attention, positions, self.packing)
        hidden = plan.unpack(out.last_hidden_state)
        columns = torch.arange(ids.shape[1], device=ids.device)
        last = (columns * (ids != self.model.config.pad_token_id)).argmax(-1)
        return head(hidden[torch.arange(len(ids), device=ids.device), last])[:, 0]


def _rm_prompt(decoded: str, meta: dict):
    """The data's own prompt (text or chat messages) when the caller passed it, else the decoded text."""
    original = meta.get("prompt")
    return original if isinstance(original, str) or is_chat(original) else decoded


class RemoteSource:
    """A reward served over HTTP: it owns the client, with its timeouts, retries and concurrency, and
    sends RELAY_REWARD_KEY (if set) as the server's key."""

    def __init__(self, cfg: RewardSource):
        key = env_key(REWARD_KEY_ENV)
        self.client = RemoteReward(cfg.url, cfg.timeout_s, cfg.max_retries, cfg.max_concurrency, key=key)

    @property
    def deadline_s(self) -> float:
        """The client's own deadline (every attempt and its backoff) plus a margin, so that deadline,
        which keeps the scores of every chunk that answered, fires before the service's."""
        return self.client.deadline_s + max(2.0, 0.1 * self.client.deadline_s)

    def score(self, prompts, responses, metadata):
        return self.client.score(prompts, responses, metadata)  # a RemoteResult: the service reads its counts


def deadline_s(source, cfg: RewardSource) -> float:
    """How long one call to a built source may take in all: `timeout_s`, but for a remote source
    (where timeout_s is per attempt) its whole budget of retries."""
    return source.deadline_s if isinstance(source, RemoteSource) else cfg.timeout_s


def build_source(
    cfg: RewardSource,
    micro_batch_size: int = 16,
    device: torch.device = torch.device("cpu"),
    function: PolicyFunction = PolicyFunction(),
):
    """`device`, `function`: for a reward model or a local judge (the scoring process's device; the learner's
    dtype, and its packing for a reward model)."""
    dtype = function.dtype
    kind = cfg.kind
    if kind in (SourceKind.math_answer, SourceKind.exact_match, SourceKind.format, SourceKind.length_penalty):
        return RuleSource(cfg)
    if kind == SourceKind.reasoning_gym:
        return ReasoningGymSource()
    if kind == SourceKind.environment:
        return EnvironmentSource()
    if kind == SourceKind.function:
        return FunctionSource(cfg)
    if kind == SourceKind.reward_model:
        return RewardModelSource(cfg, micro_batch_size, device, dtype, function.packing)
    if kind == SourceKind.judge:
        if cfg.model_path and cfg.judge_engine == "vllm":
            backend = VLLMJudge(cfg, device, dtype)
        elif cfg.model_path:
            backend = LocalJudge(
                cfg.model_path, cfg.judge_max_tokens, micro_batch_size, device, dtype, cfg.judge_chat_template
            )
        else:
            backend = OpenAIJudge(cfg.url, cfg.judge_model, cfg.judge_max_tokens, cfg.timeout_s)
        if cfg.verdict == "probability" and cfg.model_path:  # a url judge's tokenizer is the server's
            check_choice_tokens(backend.tokenizer, cfg.choices)
        return JudgeSource(cfg, backend)
    return RemoteSource(cfg)
