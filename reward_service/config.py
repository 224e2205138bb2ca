"""Config section owned by reward_service/: what judges a rollout and how scores are shaped."""

from dataclasses import dataclass, field
from enum import Enum


class SourceKind(str, Enum):
    """The kinds of reward source (rule, verifier, function, reward model, remote, environment)."""

    math_answer = "math_answer"  # the final answer (#### N, last \boxed{}, else math-verify's pick) vs the reference
    exact_match = "exact_match"  # stripped response equals the reference answer
    format = "format"  # response matches `pattern` (e.g. required tags)
    length_penalty = "length_penalty"  # -|chars - target_length| / target_length
    reasoning_gym = "reasoning_gym"  # the task's own score_answer (metadata must carry the entry)
    function = "function"  # user code `module.path:function(prompts, responses, metadata) -> floats`
    reward_model = "reward_model"  # a sequence-classification model with a scalar head
    remote = "remote"  # POST to an HTTP endpoint (see `relay serve-reward`)
    environment = "environment"  # the episode's return (env.name); invalid where the environment failed
    judge = "judge"  # a language model's verdict on the response, from `template` (reward_service/judge.py)


class InvalidPolicy(str, Enum):
    """What becomes of a sample a source could not judge (a timeout, an exception, a NaN, a failed
    episode, a missing reference): a failure, unlike a wrong answer, which is a score."""

    drop = "drop"  # out of the loss, the group baselines and reward/*; counted (reward/dropped_samples)
    zero = "zero"  # a raw reward of 0, then shaped and trained exactly like a wrong answer (as most frameworks do)


class Normalization(str, Enum):
    """How combined rewards are normalised: none, per batch, or a running mean and std."""

    none = "none"
    batch = "batch"  # whiten over the batch
    running = "running"  # running mean/std, checkpointed with the run


@dataclass
class RewardSource:
    """One reward source: its kind, weight, and the options of that kind (pattern, model, URL, deadlines)."""

    kind: SourceKind = SourceKind.math_answer
    """math_answer, exact_match, format, length_penalty, reasoning_gym, function, reward_model, remote,
    environment or judge"""
    weight: float = 1.0
    """factor in the summed reward; 0 = reported only: changes no reward, nor which samples train"""
    name: str = ""
    """metric name (reward/<name>/mean); "" = the kind"""
    function: str = ""
    """function: "module.path:function" """
    model_path: str = ""
    """reward_model: a Hugging Face folder"""
    url: str = ""
    """remote: the endpoint to POST to (see `relay serve-reward`)"""
    timeout_s: float = 10.0
    """seconds a call may take, else its samples are invalid (remote: per attempt, plus retries)"""
    max_retries: int = 2
    """remote: retries of a failed or timed-out request"""
    max_concurrency: int = 4
    """remote: requests in flight at once (the batch is split into as many chunks)"""
    pattern: str = ""
    """format: a regular expression the response must match"""
    target_length: int = 0
    """length_penalty: characters"""
    template: str = (
        "Question: {prompt}\nReference answer: {answer}\nProposed answer: {response}\n"
        "Is the proposed answer correct? Answer yes or no."
    )
    """judge: the judge's prompt; {prompt}, {response} and {answer} (the data's reference, or none) filled in"""
    verdict: str = "choice"
    """judge: how its answer is read: choice (the first of `choices` it says), number (in score_range) or
    probability (the choices' scores weighted by its probability of each as its first token, among its 20
    likeliest: a judge's confidence, finer than its greedy word)"""
    choices: dict[str, float] = field(default_factory=lambda: {"yes": 1.0, "no": 0.0})
    """judge, verdict choice or probability: each word's score (probability: each must be one token)"""
    judge_min_choice_mass: float = 0.5
    """judge, verdict probability: the least probability the choices must have together at the first token,
    else the sample is not judged (the judge meant to say something else)"""
    score_range: list[float] = field(default_factory=lambda: [0.0, 10.0])
    """judge, verdict number: the scale, mapped to [0, 1]; a number outside it cannot be judged"""
    judge_max_tokens: int = 8
    """judge: tokens the judge may answer with"""
    judge_model: str = ""
    """judge with a url: the model name the server expects"""
    judge_engine: str = "vllm"
    """judge with model_path: vllm (its own frozen engine, prefix-cached, in a child process of the scoring
    service) or transformers (in the scoring service's process)"""
    judge_chat_template: bool = True
    """judge with model_path: send the filled template as a user turn of the model's chat template (if it has
    one); false: as raw text, for a few-shot template. A url judge always gets raw text (/v1/completions)"""
    judge_max_model_len: int = 0
    """judge on vllm: its context in tokens, 0 = the model's own; a longer question is not judged (judge/too_long)"""
    judge_kv_cache_gb: int = 1
    """judge on vllm, CPU: its KV cache in GiB"""
    judge_gpu_memory_utilization: float = 0.2
    """judge on vllm, GPU: the fraction of the scoring device's memory its engine may take"""


@dataclass
class RewardConfig:
    """The `reward` section: the sources, their combination, shaping, and what a sample nobody could judge
    becomes."""

    sources: list[RewardSource] = field(default_factory=lambda: [RewardSource()])
    """what judges a response; the reward is their weighted sum"""
    reference_model_path: str = ""
    """frozen reference policy; empty = the learner's starting model"""
    micro_batch_size: int = 16
    """samples per reference/reward-model forward"""
    clip: float = 0.0
    """clip the combined reward to [-clip, clip]; 0 = off"""
    normalization: Normalization = Normalization.none
    """after clipping: none, batch (whiten the step's valid rewards) or running (checkpointed mean/std)"""
    overlong_buffer: int = 0
    """DAPO overlong shaping: the last this many tokens before overlong_max_tokens cost up to overlong_penalty,
    linearly; 0 = off"""
    overlong_max_tokens: int = 0
    """overlong shaping: the length (model tokens) at which the full penalty applies, e.g.
    rollout.sampling.max_new_tokens"""
    overlong_penalty: float = 1.0
    """overlong shaping: the penalty at and beyond overlong_max_tokens"""
    invalid: InvalidPolicy = InvalidPolicy.drop
    """a sample not judged (a failure): drop (masked, counted) or zero"""
    max_unjudged_steps: int = 3
    """stop the run after this many steps in a row with no sample judged; 0 = never"""
