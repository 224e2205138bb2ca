"""Which seeds the loop's batches sample with (review A 1, 8): every batch launched at one step (round 0,
top-ups of skipped prompts, dynamic-sampling rounds) has its own draw, so none repeats another's seeds,
and evaluation has a stream of its own, the same for every evaluation. Through the real Trainer.generate,
_launch, _resubmit, RolloutPool.submit and RolloutWorker._request_seed, on engines that record seeds."""

from types import SimpleNamespace

from orchestrator import trainer as trainer_module
from orchestrator.data import PromptSampler
from orchestrator.phases import Ahead
from orchestrator.trainer import Trainer
from rollout.config import SamplingConfig
from rollout.pool import RolloutPool
from rollout.seeds import EVALUATION, request_seed
from rollout.types import RolloutBatch

B = 4  # prompts per step


class Engine:
    """A worker's generate.remote that records the seed of every request as RolloutWorker computes it,
    and skips the last prompt of its first call (so the trainer tops the batch up)."""

    def __init__(self, run_seed: int):
        from rollout.worker import RolloutWorker  # imports vLLM: only here

        self.worker = object.__new__(RolloutWorker)
        self.worker.seed = run_seed
        self.calls, self.generate = [], SimpleNamespace(remote=self.remote)

    def remote(self, prompts, step, first, greedy, sampling, tasks, draw):
        seeds = [self.worker._request_seed(SamplingConfig(), (step, draw), first + k) for k in range(len(prompts))]
        self.calls.append(seeds)
        keep = len(prompts) - 1 if len(self.calls) == 1 else len(prompts)
        n = keep
        batch = RolloutBatch(
            list(range(first, first + n)),
            [[1]] * n,
            [[2]] * n,
            [[0.0]] * n,
            ["x"] * n,
            ["stop"] * n,
            [(first + n, "too long")] if keep < len(prompts) else [],
        )
        batch.version_first = batch.version_last = [step] * n  # fresh: no staleness drop
        return batch


def loop_for(run_seed: int) -> SimpleNamespace:
    engine = Engine(run_seed)
    pool = SimpleNamespace(workers=[engine])
    loop = SimpleNamespace(
        cfg=SimpleNamespace(data=SimpleNamespace(rollout_batch_size=B)),
        step=3,
        lead=0,
        sampler=PromptSampler(50, run_seed, shuffle=True),
        counters={"async/dropped_stale": 0},
        train=[{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(50)],
        _prompt=lambda e: e["prompt"],
        _meta=lambda e: e,
        rollout=SimpleNamespace(
            submit=lambda *a, **k: RolloutPool.submit(pool, *a, **k),
            collect=lambda pending: RolloutBatch.concat(pending),
        ),
    )
    for name in ("_launch", "_resubmit", "_collect"):
        setattr(loop, name, getattr(Trainer, name).__get__(loop))
    return loop, engine


def test_a_top_up_and_a_dynamic_sampling_round_never_reuse_a_rounds_seeds():
    loop, engine = loop_for(run_seed=0)
    batch, examples = Trainer.generate(loop)  # round 0 skips one prompt: a top-up of 1 follows, at the same step
    assert len(set(batch.prompt_index)) == B and len(engine.calls) == 2
    again, _ = Trainer.generate(loop)  # what a dynamic-sampling round does: a fresh batch at the same step
    first, top_up, dynamic = engine.calls[0], engine.calls[1], engine.calls[2]
    # before: every launch at step 3 seeded its prompt k with request_seed(run, 3, k): the top-up's one
    # prompt drew round 0's first prompt's seed, and the dynamic round repeated round 0 request by request
    assert top_up[0] not in first and not set(dynamic) & set(first + top_up)
    assert len(set(first + top_up + dynamic)) == len(first) + len(top_up) + len(dynamic)
    # a resumed run redoes the step from the same sampler state: the same draws, the same seeds
    replay, replayed = loop_for(run_seed=0)
    Trainer.generate(replay)
    Trainer.generate(replay)
    assert replayed.calls == engine.calls


def test_a_batch_launched_ahead_keeps_its_draw_through_a_checkpoint():
    loop, engine = loop_for(run_seed=0)
    job = Trainer._launch(loop, 4, B)
    job.batch = Trainer._collect(loop, job)
    restored = Ahead.from_state(job.state_dict())
    assert restored.draw == job.draw == loop.sampler.drawn == B
    Trainer._resubmit(loop, restored)  # e.g. its engine died after the resume: generated again alike
    assert engine.calls[-1] == engine.calls[0][: len(engine.calls[-1])]


def test_evaluation_samples_from_its_own_stream_the_same_every_time(monkeypatch):
    loop, _ = loop_for(run_seed=0)
    calls = []
    loop.held_out = loop.train[:3]
    loop.rollout.generate = lambda prompts, step, greedy, tasks, draw: calls.append((step, draw))
    loop._sample_table = lambda *a: []
    monkeypatch.setattr(
        trainer_module, "evaluate_policy", lambda generate, *a: (generate(["p"], False), SimpleNamespace(metrics={}))[1]
    )
    monkeypatch.setattr(trainer_module, "shown", lambda ev: (None, None))
    loop.cfg = SimpleNamespace(eval=SimpleNamespace(greedy=True), **vars(loop.cfg))
    loop._temperature, loop.scoring = 1.0, SimpleNamespace(evaluate=None)
    loop.learner = SimpleNamespace(policy_logprobs=None)
    Trainer.evaluate(loop)
    loop.step = 7
    Trainer.evaluate(loop)
    assert calls == [(0, EVALUATION), (0, EVALUATION)]  # paired: every evaluation draws the same
    # before: step 0's training stream (draw 0); no training draw is negative, so none shares a seed
    evaluation = {request_seed(0, 0, k, EVALUATION) for k in range(64)}
    training = {request_seed(0, 0, k, draw) for k in range(64) for draw in range(0, 65)}
    assert not evaluation & training
