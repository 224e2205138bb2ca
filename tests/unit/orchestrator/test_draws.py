"""Which seeds the loop's batches sample with (review A 1, 8): every batch launched at one step (round 0,
top-ups of skipped prompts, dynamic-sampling rounds) has its own draw, so none repeats another's seeds,
and evaluation has a stream of its own, the same for every evaluation. Through the real PromptBatches,
RolloutPool.submit and RolloutWorker._request_seed, on engines that record seeds, and the real Evaluator."""

from types import SimpleNamespace

from orchestrator.config.load import load_config
from orchestrator.loop.batches import LaunchedBatch, PromptBatches
from rollout.config import SamplingConfig
from rollout.pool import RolloutPool
from rollout.types import RolloutBatch
from runtime.seeds import EVALUATION, request_seed
from tests.small_loop import DEFAULT, small_trainer

B = 4  # prompts per step


class Engine:
    """A worker's generate.remote that records the seed of every request as RolloutWorker computes it,
    and skips the last prompt of its first call (so the trainer tops the batch up)."""

    def __init__(self, run_seed: int):
        from rollout.worker import RolloutWorker  # imports vLLM: only here

        self.worker = object.__new__(RolloutWorker)
        self.worker.seed = run_seed
        self.calls, self.generate = [], SimpleNamespace(remote=self.remote)

    def remote(self, prompts, step, first, greedy, sampling, tasks, draw, after=None):
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


def batches_for(run_seed: int, *overrides: str) -> tuple[PromptBatches, Engine]:
    """Real PromptBatches on one recording engine, behind the real RolloutPool.submit."""
    engine = Engine(run_seed)
    pool = SimpleNamespace(workers=[engine], calls_since_sync=[0], serial=0)
    pool._shards = lambda n: RolloutPool._shards(pool, n)
    rollout = SimpleNamespace(
        submit=lambda *a, **k: RolloutPool.submit(pool, *a, **k), collect=lambda pending: RolloutBatch.concat(pending)
    )
    sizes = [f"data.rollout_batch_size={B}", "algorithm.mini_batch_size=32", "algorithm.micro_batch_size=32"]
    cfg = load_config(DEFAULT, [f"seed={run_seed}", *sizes, *overrides])
    train = [{"prompt": f"{i}+1=", "answer": str(i + 1), "metadata": {}} for i in range(50)]
    return PromptBatches(cfg, train, rollout, scoring=None, restart_rollout=None), engine


def test_a_top_up_and_a_dynamic_sampling_round_never_reuse_a_rounds_seeds():
    batches, engine = batches_for(run_seed=0)
    batch, examples = batches.generate(3)  # round 0 skips one prompt: a top-up of 1 follows, at the same step
    assert len(set(batch.prompt_index)) == B and len(engine.calls) == 2
    again, _ = batches.generate(3)  # what a dynamic-sampling round does: a fresh batch at the same step
    first, top_up, dynamic = engine.calls[0], engine.calls[1], engine.calls[2]
    # before: every launch at step 3 seeded its prompt k with request_seed(run, 3, k): the top-up's one
    # prompt drew round 0's first prompt's seed, and the dynamic round repeated round 0 request by request
    assert top_up[0] not in first and not set(dynamic) & set(first + top_up)
    assert len(set(first + top_up + dynamic)) == len(first) + len(top_up) + len(dynamic)
    # a resumed run redoes the step from the same sampler state: the same draws, the same seeds
    replay, replayed = batches_for(run_seed=0)
    replay.generate(3)
    replay.generate(3)
    assert replayed.calls == engine.calls


def test_a_batch_launched_ahead_keeps_its_draw_through_a_checkpoint():
    batches, engine = batches_for(0, "async_training.mode=one_step", "total_steps=10")
    batches.next(3)  # launches steps 3 and 4, trains on 3 (topped up: its engine skipped a prompt)
    batches.collect_launched(3)
    state = batches.state_dict()
    restored, restored_engine = batches_for(0, "async_training.mode=one_step", "total_steps=10")
    restored.load_state_dict(state, {"async/dropped_stale": 0})
    ahead = restored.launched[0]
    assert ahead.draw == batches.launched[0].draw == 2 * B and ahead.step == 4
    assert LaunchedBatch.from_state(ahead.state_dict()).batch == ahead.batch
    ahead.batch = None  # e.g. its engine died after the resume: generated again alike
    restored.relaunch_uncollected()
    assert restored_engine.calls == [engine.calls[1]]  # step 4's launch: the same seeds


def test_evaluation_samples_from_its_own_stream_the_same_every_time(tmp_path):
    trainer, _ = small_trainer(tmp_path)
    trainer.evaluator.evaluate(0)
    trainer.evaluator.evaluate(7)
    assert (
        trainer.roles.rollout.evaluations == [(0, EVALUATION)] * 4
    )  # greedy and sampled, twice: every evaluation draws the same
    # before: step 0's training stream (draw 0); no training draw is negative, so none shares a seed
    evaluation = {request_seed(0, 0, k, EVALUATION) for k in range(64)}
    training = {request_seed(0, 0, k, draw) for k in range(64) for draw in range(0, 65)}
    assert not evaluation & training
