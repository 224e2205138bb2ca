"""Evaluation, one module for the trainer's held-out checks and `relay eval` (eval_checkpoint.py): the measuring.
Its tables, report.md and plots: eval_report.py.

`evaluate_policy` is read-only: it scores through the scoring service's `evaluate` (raw rewards; the
running reward normaliser never moves) and generates greedy answers only if `eval.greedy`.
"""

from __future__ import annotations

import dataclasses
import functools
import statistics
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from orchestrator.config.schema import TrainConfig, eval_samples
from orchestrator.loop.step_metrics import VERIFIABLE, distinct_n, reward_metrics
from orchestrator.tools.pass_at_k import sample_metrics
from reward_service.rules import answer_key, exact_match, same_answer
from rollout.config import SamplingConfig
from runtime.seeds import EVALUATION


def win_rate(policy: list[float], reference: list[float]) -> float:
    """Share of prompts where the policy's answer outscores the reference's; ties count half."""
    return sum(1.0 if p > r else 0.5 if p == r else 0.0 for p, r in zip(policy, reference)) / len(policy)


@dataclass
class Evaluation:
    """One policy's held-out evaluation: its metrics, and the greedy and sampled batches with their scores."""

    metrics: dict[str, float]  # eval/greedy/..., eval/sampled/...
    greedy: object | None  # RolloutBatch of greedy answers (None when eval.greedy is off)
    greedy_scored: object | None  # its ScoredBatch (raw rewards)
    sampled: object  # RolloutBatch sampled as in training
    sampled_scored: object
    notes: list[str] = field(default_factory=list)  # what a reader must be told: a figure left out, and why


NO_ANSWER = ""  # a reasoning-gym response without <answer> tags: a vote for "no answer", wrong as the task scores it


def reasoning_gym_answer(response: str) -> str:
    """The answer reasoning-gym's task scores (ReasoningGymSource: the last <answer>...</answer>,
    reasoning_gym.utils.extract_answer), exactly as the task receives it: its scorers may tell answers
    apart by their whitespace (rotate_matrix's grid rows); NO_ANSWER without one."""
    from reasoning_gym.utils import extract_answer

    answer = extract_answer(response)
    return NO_ANSWER if answer is None else answer


# maj@k's vote per verifiable source kind: how the grader reads a response's answer, and which answers are one.
# Never the whole response where the grader reads less: five right answers reasoned five ways would lose to
# three identical wrong ones.
VOTES: dict[str, tuple[Callable[[str], str], Callable[[str, str], bool]]] = {
    "math_answer": (answer_key, same_answer),
    "exact_match": (str, lambda a, b: exact_match(b, a) == 1.0),  # the response is the answer, equal as graded
    "reasoning_gym": (reasoning_gym_answer, str.__eq__),
}
NO_VOTE = {  # the verifiable kinds with no answer to vote on, and why
    "environment": "episodes are judged by their environment's return, and relay reads no final answer from them",
}


def eval_sampling(cfg: TrainConfig) -> SamplingConfig:
    """Training's sampling with eval.n_samples samples per prompt (0: training's)."""
    return dataclasses.replace(cfg.rollout.sampling, n_samples_per_prompt=eval_samples(cfg))


def eval_ks(cfg: TrainConfig) -> list[int]:
    """The k of pass@k and maj@k: eval.pass_k, else 1 and n."""
    return sorted(set(cfg.eval.pass_k or [1, eval_sampling(cfg).n_samples_per_prompt]))


def evaluate_policy(
    generate,
    score,
    prompts: list,
    meta: list[dict],
    greedy: bool,
    temperature: float,
    policy_logprobs,
    pass_k: list[int] = (),
) -> Evaluation:
    """Held-out prompts: greedy answers (accuracy) if `greedy`, and samples as in training (reward,
    KL to the reference, length, diversity), with pass@k, maj@k and avg@n for each k of `pass_k` where
    a verifiable source judges them (pass_at_k). `generate(prompts, greedy) -> RolloutBatch`;
    `score(batch, meta, temperature, with_reference) -> ScoredBatch` must be read-only (raw rewards);
    `policy_logprobs(batch)`: the policy's logprob of each response token, computed by the same function
    as the reference's (not the engine's: its kernels, dtype and top-k/top-p renormalisation differ, and
    the KL of a policy to itself would not be 0)."""
    g = gs = None
    if greedy:
        g = generate(prompts, True)
        gs = score(g, meta, 1.0, False)  # nothing reads a KL of greedy answers
    s = generate(prompts, False)
    ss = score(s, meta, temperature, True)
    m = {f"eval/greedy/{k}": v for k, v in reward_metrics(gs).items()} if greedy else {}
    m.update({f"eval/sampled/{k}": v for k, v in reward_metrics(ss).items()})  # as training reports its batch
    acts = s.action_mask or [[1] * len(lp) for lp in s.logprobs]  # episodes: the model's tokens only
    if [len(r) for r in ss.ref_logprobs] != [len(a) for a in acts]:  # else zip would read a KL of 0
        raise ValueError("held-out evaluation: the reference's logprobs do not cover the samples' tokens")
    kl = [
        p - r for lp, ref, act in zip(policy_logprobs(s), ss.ref_logprobs, acts) for p, r, a in zip(lp, ref, act) if a
    ]
    m["eval/sampled/kl_ref"] = sum(kl) / max(len(kl), 1)  # per model token, the k1 estimate on the sampler's tokens
    m["eval/sampled/response/length_mean"] = statistics.fmean(s.model_lengths)  # the model's tokens, as in training
    m["eval/sampled/distinct_1"], m["eval/sampled/distinct_2"] = distinct_n(s.model_ids, 1), distinct_n(s.model_ids, 2)
    m["eval/prompts"] = float(len(prompts))
    grader, notes = next((k for k in ss.components if k.startswith(VERIFIABLE)), None), []
    if pass_k and grader is not None:
        n = max(Counter(s.prompt_index).values(), default=0)
        kind = next(k for k in VERIFIABLE if grader.startswith(k))
        read, same = VOTES.get(kind, (str, None))  # no vote: pass@k and avg@n only
        metrics = sample_metrics(graded_samples(s, ss, grader, read), n, pass_k, same)
        m.update({f"eval/sampled/{k}": v for k, v in metrics.items()})
        if same is None and max(pass_k) > 1:
            notes.append(f"no maj@k: the {grader} source's {NO_VOTE[kind]}")
    return Evaluation(m, g, gs, s, ss, notes)


def evaluate_suites(
    suites: list, generate, score, cfg: TrainConfig, policy_logprobs
) -> tuple[dict[str, float], list[str]]:
    """Each evaluation suite (orchestrator/tools/suites.py) through evaluate_policy, its metrics under
    eval/<suite>/, with the training prompts its file held (left_out), and its notes, each naming the
    suite. `generate(prompts, greedy, meta)`, `score(batch, meta, temperature, with_reference, suite)`."""
    out, notes = {}, []
    for suite in suites:
        ev = evaluate_policy(
            lambda p, greedy: generate(p, greedy, suite.meta),
            lambda b, meta, t, with_ref: score(b, meta, t, with_ref, suite.name),
            suite.prompts,
            suite.meta,
            cfg.eval.greedy,
            eval_sampling(cfg).temperature,
            policy_logprobs,
            eval_ks(cfg),
        )
        out |= {f"eval/{suite.name}/{k.removeprefix('eval/')}": v for k, v in ev.metrics.items()}
        out[f"eval/{suite.name}/left_out"] = float(suite.left_out)
        notes += [f"suite {suite.name}: {note}" for note in ev.notes]
    return out, notes


def graded_samples(batch, scored, grader: str, read: Callable[[str], str]) -> list[tuple[list[bool], list[str]]]:
    """Per prompt, in sampling order, the (correct, answer) of each sample the verifiable source `grader`
    judged (correct: its full mark, a score >= 1; the answer as `read` takes it from the response: VOTES);
    a sample it could not judge (NaN) is left out, never counted wrong."""
    graded: dict[int, tuple[list[bool], list[str]]] = {}
    for j, score, text in zip(batch.prompt_index, scored.components[grader], batch.response_text):
        correct, answers = graded.setdefault(j, ([], []))
        if score == score:
            correct.append(score >= 1.0)
            answers.append(read(text))
    return list(graded.values())


def evaluate_roles(
    cfg: TrainConfig, policy: str, reference: str, scoring, prompts: list, meta: list[dict], make_pool, suites=()
) -> dict[str, Evaluation]:
    """The policy's and the reference's evaluations, each generating through its own engine
    (`make_pool(path)`, shut down after), the suites' metrics (evaluate_suites) in its metrics. The KL's
    policy side is the role's own logprobs by the reference's function: for the reference role the scoring
    service's reference model itself, for the policy a copy built as that one is, freed before the
    reference's turn (no second reference)."""
    from reward_service.reference import ReferenceModel

    ref, temperature, evals = scoring.reference, cfg.rollout.sampling.temperature, {}
    for role, path in (("policy", policy), ("reference", reference)):
        model = ref if role == "reference" else ReferenceModel(path, ref.function, ref.micro_batch_size, ref.device)
        pool = make_pool(path)
        try:
            evals[role] = evaluate_policy(
                lambda p, greedy: pool.generate(p, 0, greedy, eval_sampling(cfg), meta, EVALUATION),
                scoring.evaluate,
                prompts,
                meta,
                cfg.eval.greedy,
                temperature,
                functools.partial(model.logprobs, temperature=temperature),
                eval_ks(cfg),
            )
            metrics, notes = evaluate_suites(
                suites,
                lambda p, greedy, m: pool.generate(p, 0, greedy, eval_sampling(cfg), m, EVALUATION),
                lambda b, m, t, with_ref, suite: scoring.evaluate(b, m, t, with_ref, suite),
                cfg,
                functools.partial(model.logprobs, temperature=temperature),
            )
            evals[role].metrics |= metrics
            evals[role].notes += notes
        finally:
            pool.shutdown()
            del model  # the policy's copy: freed before the reference role runs
    return evals
