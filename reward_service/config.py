"""Config section owned by reward_service/: what judges a rollout and how scores are shaped."""
from dataclasses import dataclass, field
from enum import Enum


class SourceKind(str, Enum):
    math_answer = "math_answer"  # final answer (#### N, \boxed{}, last number) vs the reference, numerically
    exact_match = "exact_match"  # stripped response equals the reference answer
    format = "format"  # response matches `pattern` (e.g. required tags)
    length_penalty = "length_penalty"  # -|chars - target_length| / target_length
    reasoning_gym = "reasoning_gym"  # the task's own score_answer (metadata must carry the entry)
    function = "function"  # user code `module.path:function(prompts, responses, metadata) -> floats`
    reward_model = "reward_model"  # a sequence-classification model with a scalar head
    remote = "remote"  # POST to an HTTP endpoint (see `relay serve-reward`)


class InvalidPolicy(str, Enum):
    zero = "zero"  # an invalid sample scores 0 and still trains
    drop = "drop"  # an invalid sample is masked out of the update


class Normalization(str, Enum):
    none = "none"
    batch = "batch"  # whiten over the batch
    running = "running"  # running mean/std, checkpointed with the run


@dataclass
class RewardSource:
    kind: SourceKind = SourceKind.math_answer
    weight: float = 1.0
    name: str = ""  # metric name; defaults to the kind
    function: str = ""  # function: "module.path:function"
    model_path: str = ""  # reward_model: a Hugging Face folder
    url: str = ""  # remote: endpoint
    timeout_s: float = 10.0  # remote: per-call deadline
    max_retries: int = 2  # remote
    max_concurrency: int = 4  # remote
    pattern: str = ""  # format: a regular expression the response must match
    target_length: int = 0  # length_penalty: characters


@dataclass
class RewardConfig:
    sources: list[RewardSource] = field(default_factory=lambda: [RewardSource()])
    reference_model_path: str = ""  # frozen reference policy; empty = the learner's starting model
    micro_batch_size: int = 16  # samples per reference/reward-model forward
    clip: float = 0.0  # clip the combined reward to [-clip, clip]; 0 = off
    normalization: Normalization = Normalization.none
    invalid: InvalidPolicy = InvalidPolicy.zero
