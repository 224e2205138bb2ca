"""AsyncEngine's order of calls and weight syncs, on a stand-in AsyncLLM: Ray runs an async actor's
calls out of order, and the pool's numbering (after which sync a call was sent; how many calls a sync
follows) must restore the order the driver sent them in. And token_versions reads vLLM's spans."""

import asyncio
from types import SimpleNamespace

from rollout.async_engine import AsyncEngine, EngineRestarted, token_versions


class Collector:
    def __init__(self, rid, done):
        self.request_id, self.done = rid, done

    def get_nowait(self):
        return None

    async def get(self):
        await self.done.wait()
        return SimpleNamespace(finished=True, outputs=[])


class StandIn:
    """add_request's requests finish when `release` is set; the scheduler's pause is one flag, as
    vLLM's is (a resume clears it whoever paused); pause, resume and version calls are recorded."""

    def __init__(self):
        self.release, self.log, self.paused, self.errored = asyncio.Event(), [], False, False
        self.engine_core = SimpleNamespace(pause_scheduler_async=self._pause, resume_scheduler_async=self._resume)

    async def _pause(self, mode, clear_cache):
        self.paused = True
        self.log.append(("pause", mode))

    async def _resume(self):
        self.paused = False
        self.log.append(("resume",))

    async def abort(self, rid, internal=False):
        self.log.append(("abort", rid))

    async def add_request(self, rid, request, params):
        self.log.append(("add", request["cache_salt"]))
        return Collector(rid, self.release)

    async def update_weight_version(self, v):
        self.log.append(("version", v, self.paused))


async def call(engine, after, name, out):
    async with engine.call(after):
        out.append(("start", name, engine.serial))
        await engine.generate([[1, 2]], [SimpleNamespace(output_kind=None)])
        out.append(("end", name))


async def sync(engine, serial, calls, in_flight, out, during=None):
    async with engine.weights(serial, calls, in_flight):
        out.append(("sync", serial))
        if during is not None:
            await during()
        await engine.set_version(serial)


def test_a_sync_that_arrives_first_waits_for_the_calls_sent_before_it_and_holds_the_ones_after():
    async def run():
        engine, out = AsyncEngine(StandIn()), []
        # sent: call a, call b (after sync 0), sync 1, call c (after sync 1); arrived: c, sync 1, b, a
        tasks = [asyncio.create_task(call(engine, 1, "c", out))]
        await asyncio.sleep(0)
        tasks.append(asyncio.create_task(sync(engine, 1, 2, False, out)))
        await asyncio.sleep(0)
        assert out == []  # c waits for sync 1, which waits for a and b
        tasks += [asyncio.create_task(call(engine, 0, n, out)) for n in "ba"]
        await asyncio.sleep(0.01)
        engine.llm.release.set()
        await asyncio.gather(*tasks)
        return out, engine.llm.log

    out, log = asyncio.run(run())
    assert [e for e in out if e[0] != "end"] == [("start", "b", 0), ("start", "a", 0), ("sync", 1), ("start", "c", 1)]
    assert out.index(("end", "a")) < out.index(("sync", 1)) and out.index(("end", "b")) < out.index(("sync", 1))
    assert [e for e in log if e[0] == "add"] == [("add", "w0"), ("add", "w0"), ("add", "w1")]  # salt: the load


def test_a_sync_in_flight_does_not_wait_for_running_calls_and_pauses_with_keep():
    async def run():
        engine, out = AsyncEngine(StandIn()), []
        running = asyncio.create_task(call(engine, 0, "a", out))
        await asyncio.sleep(0.01)
        await sync(engine, 1, 1, True, out)  # while a still runs
        engine.llm.release.set()
        await running
        return out, engine.llm.log

    out, log = asyncio.run(run())
    assert out == [("start", "a", 0), ("sync", 1), ("end", "a")]
    # a's own hold while adding, then the sync's: the version is set while the engine is paused
    assert [e for e in log if e[0] != "add"] == [
        ("pause", "keep"),
        ("resume",),
        ("pause", "keep"),
        ("version", "1", True),
        ("resume",),
    ]


def test_a_call_arriving_during_an_in_flight_sync_does_not_resume_the_engine_before_the_sync_ends():
    async def run():
        engine, out, late = AsyncEngine(StandIn()), [], []

        async def a_call_arrives():  # sent before the sync, arrives while it loads, finds the engine idle
            late.append(asyncio.create_task(call(engine, 0, "late", out)))
            await asyncio.sleep(0.01)
            assert engine.llm.paused  # its own hold and release left the sync's pause in place

        await sync(engine, 1, 1, True, out, during=a_call_arrives)
        engine.llm.release.set()
        await asyncio.gather(*late)
        return engine.llm.log

    log = asyncio.run(run())
    version = next(i for i, e in enumerate(log) if e[0] == "version")
    assert log[version] == ("version", "1", True) and log[-1] == ("resume",)
    assert sum(e == ("resume",) for e in log[:version]) == 0  # nothing resumed it mid-sync


def test_a_failed_sync_leaves_the_serial_so_later_calls_wait_and_a_restarted_engine_skips_lost_calls():
    async def run():
        engine, out = AsyncEngine(StandIn()), []

        async def failing():
            async with engine.weights(1, 0, False):
                raise RuntimeError("lost a rank")

        try:
            await failing()
        except RuntimeError:
            pass
        assert engine.serial == 0 and not engine._updating
        # a restarted engine (serial 0) gets sync 5 after 2 calls sent to its dead predecessor: no wait
        await asyncio.wait_for(sync(engine, 5, 2, False, out), timeout=1.0)
        return engine.serial

    assert asyncio.run(run()) == 5


def test_token_versions_follow_the_spans_and_default_is_the_initial_model():
    span = lambda v, s, e: SimpleNamespace(version=v, start=s, end=e)  # noqa: E731
    c = SimpleNamespace(token_ids=[5] * 6, weight_versions=[span("default", 0, 2), span("3", 2, 5), span("4", 5, 6)])
    assert token_versions(c) == [0, 0, 3, 3, 3, 4]
    assert token_versions(SimpleNamespace(token_ids=[1, 2], weight_versions=None)) == [0, 0]


def test_the_endpoints_complete_runs_through_the_async_engine():
    """RolloutWorker.complete (the agent endpoint's engine call) on the stand-in engine: its context
    managers nest as they must (an async one and the sync busy clock)."""
    from rollout.config import SamplingConfig
    from rollout.worker import RolloutWorker  # imports vLLM: only here

    done = SimpleNamespace(
        token_ids=[5, 6],
        logprobs=[{5: SimpleNamespace(logprob=-0.5)}, {6: SimpleNamespace(logprob=-1.0)}],
        finish_reason="stop",
        text="hi",
    )

    class Finished(StandIn):
        async def add_request(self, rid, request, params):
            collector = await super().add_request(rid, request, params)
            collector.get = lambda: asyncio.sleep(0, SimpleNamespace(finished=True, outputs=[done]))
            return collector

    worker = object.__new__(RolloutWorker)
    worker.engine = AsyncEngine(Finished())
    worker.tokenizer = SimpleNamespace(decode=lambda ids, skip_special_tokens: f"decoded {ids}")
    out, version = asyncio.run(worker.complete([[1, 2, 3]], [SamplingConfig(seed=3, stop=["\n"])]))
    assert out == [([5, 6], [-0.5, -1.0], "hi", "stop")] and version == 0  # stop strings: vLLM's text
    out, _ = asyncio.run(worker.complete([[1, 2, 3]], [SamplingConfig(seed=3)]))
    assert out[0][2] == "decoded [5, 6]"  # none: vLLM did not detokenize, the worker decodes
    assert worker.busy_seconds() > 0 and worker.engine._running == 0


def test_a_restarted_engine_refuses_calls_sent_after_syncs_it_never_took_and_takes_them_after_its_own():
    """Ray restarted the engine: a call sent after sync 3 (which went to its dead predecessor) fails at
    once, naming the actor, instead of waiting for that sync forever; once the driver's restart path
    has given it weights (any sync), calls are admitted as usual. A fresh engine's calls wait as ever."""

    async def run():
        engine, out = AsyncEngine(StandIn(), restarted_actor="abc123"), []
        engine.llm.release.set()  # requests finish at once
        try:
            await call(engine, 3, "stale", out)
        except EngineRestarted as e:
            refused = (e.actor_id, e.after, str(e))
        await asyncio.wait_for(
            call(engine, None, "unordered", out), timeout=1.0
        )  # e.g. an evaluation's, outside the numbering: no wait
        await sync(engine, 4, 0, False, out)
        await asyncio.wait_for(call(engine, 4, "after its own sync", out), timeout=1.0)
        fresh = AsyncEngine(StandIn())
        waiting = asyncio.ensure_future(call(fresh, 3, "fresh", out))
        await asyncio.sleep(0.01)
        pending = not waiting.done()
        waiting.cancel()
        return refused, out, pending

    refused, out, pending = asyncio.run(run())
    assert refused == ("abc123", 3, "rollout engine abc123 was restarted: it never took weight sync 3")
    assert [o for o in out if o[0] == "start"] == [("start", "unordered", 0), ("start", "after its own sync", 4)]
    assert pending  # a fresh engine waits for sync 3, which is on its way


def test_the_pool_reports_a_call_refused_by_a_restarted_engine_as_that_engines_death(monkeypatch):
    """The refusal reaches the driver as Ray sends an actor's exception: pickled inside a RayTaskError
    (an exception Ray cannot unpickle arrives as something else, which no restart path handles)."""
    import ray

    from rollout import pool

    sent = ray.exceptions.RayTaskError("resume", "traceback", EngineRestarted("abc123", 3)).to_bytes()

    def refuse(refs, what=""):
        raise ray.exceptions.RayError.from_bytes(sent).as_instanceof_cause()

    monkeypatch.setattr(pool.watchdog, "get", refuse)
    try:
        pool.RolloutPool.collect(["ref"])
    except ray.exceptions.RayActorError as e:
        died = e
    assert died.actor_id == "abc123" and "never took weight sync 3" in str(died)
    worker = SimpleNamespace(_actor_id=SimpleNamespace(hex=lambda: "abc123"))
    assert pool.died_among(died, [worker])


def test_calls_add_their_requests_one_whole_call_after_another_in_the_order_they_came():
    """The first call finds the engine idle and pauses it before adding; a second call arriving
    meanwhile waits for it to finish adding instead of slipping its requests ahead (its batch, launched
    ahead, would decode before the one the learner waits for)."""

    async def run():
        engine = AsyncEngine(StandIn())
        engine.llm.release.set()
        added, add = [], engine.llm.add_request

        async def recording(rid, request, params):
            added.append(request["prompt_token_ids"][0])
            return await add(rid, request, params)

        engine.llm.add_request = recording
        pause = engine.llm.engine_core.pause_scheduler_async

        async def slow_pause(mode, clear_cache):  # vLLM's is a round trip to the engine core
            await asyncio.sleep(0.01)
            await pause(mode, clear_cache)

        engine.llm.engine_core.pause_scheduler_async = slow_pause
        p = SimpleNamespace(output_kind=None)
        await asyncio.gather(engine.generate([[1], [2], [3]], [p, p, p]), engine.generate([[4], [5]], [p, p]))
        return added, engine.llm.log

    added, log = asyncio.run(run())
    assert added == [1, 2, 3, 4, 5]
    assert [e[0] for e in log if e[0] in ("pause", "resume")] == ["pause", "resume"]  # the idle call's hold only


def finished_engine(done, params_seen: list):
    """A stand-in engine whose every request finishes at once as `done`; records each request's params."""

    class Finished(StandIn):
        async def add_request(self, rid, request, params):
            params_seen.append((request["prompt_token_ids"], params.seed, params.max_tokens))
            collector = await super().add_request(rid, request, params)
            collector.get = lambda: asyncio.sleep(0, SimpleNamespace(finished=True, outputs=[done]))
            return collector

    return AsyncEngine(Finished())


def test_a_continuation_is_seeded_by_its_place_in_the_group_and_a_spent_budget_ends_it_without_a_call():
    """RolloutWorker.resume: two cut samples of one prompt with equal prefixes get different seeds (their
    places in the group), each asks only for the tokens left of max_new_tokens, one whose budget is spent
    ends "length" with no request; with stop strings the text is the prefix's and vLLM's new text."""
    from learner.tiny_gpt import char_tokenizer
    from rollout.config import RolloutConfig, SamplingConfig
    from rollout.worker import RolloutWorker  # imports vLLM: only here

    done = SimpleNamespace(token_ids=[6], logprobs=[{6: SimpleNamespace(logprob=-0.5)}], finish_reason="stop", text="3")
    seen = []
    worker = object.__new__(RolloutWorker)
    worker.cfg = RolloutConfig(sampling=SamplingConfig(max_new_tokens=8, stop=["\n"]))
    worker.seed, worker.tokenizer, worker.engine = 0, char_tokenizer(), finished_engine(done, seen)
    cut = [(3, 0, [1, 2], [5]), (3, 1, [1, 2], [5]), (4, 0, [9], [7] * 8)]
    more = asyncio.run(worker.resume(cut, step=2, draw=4, after=None))
    assert [s[0] for s in seen] == [[1, 2, 5], [1, 2, 5]] and [s[2] for s in seen] == [7, 7]
    assert seen[0][1] != seen[1][1]
    assert more.response_ids == [[6], [6], []] and more.finish_reason == ["stop", "stop", "length"]
    assert more.response_text[:2] == ["23", "23"] and more.logprobs == [[-0.5], [-0.5], []]
    worker.seed, again = 1, []  # the run seed changes every continuation's seed
    worker.engine = finished_engine(done, again)
    asyncio.run(worker.resume(cut, step=2, draw=4, after=None))
    assert {s[1] for s in again}.isdisjoint({s[1] for s in seen})


def test_a_continuation_ends_at_a_stop_string_that_began_before_the_cut():
    """Issue 40, item 10: the response so far is the continuation's prompt, so vLLM saw no "==" in
    "7=" + "=5" and the sample ran on past its stop string. Now it ends as an uncut one would."""
    from learner.tiny_gpt import char_tokenizer
    from rollout.config import RolloutConfig, SamplingConfig
    from rollout.worker import RolloutWorker  # imports vLLM: only here

    tok = char_tokenizer()
    ids = tok.convert_tokens_to_ids(list("=5"))
    done = SimpleNamespace(
        token_ids=ids, logprobs=[{t: SimpleNamespace(logprob=-0.5)} for t in ids], finish_reason="length", text="=5"
    )
    worker = object.__new__(RolloutWorker)
    worker.cfg = RolloutConfig(sampling=SamplingConfig(max_new_tokens=8, stop=["=="]))
    worker.seed, worker.tokenizer, worker.engine = 0, tok, finished_engine(done, [])
    more = asyncio.run(worker.resume([(0, 0, [1], tok.convert_tokens_to_ids(list("7=")))], 1, 0, None))
    assert more.response_text == ["7"] and more.finish_reason == ["stop"]
    assert more.response_ids == [ids[:1]] and more.logprobs == [[-0.5]] and more.token_versions == [[0]]


def test_the_pool_gives_each_cut_sample_its_place_in_its_group_whatever_engine_continues_it():
    from rollout.pool import RolloutPool
    from rollout.types import RolloutBatch

    sent = []
    worker = lambda i: SimpleNamespace(resume=SimpleNamespace(remote=lambda *a: sent.append((i, *a))))  # noqa: E731
    pool = object.__new__(RolloutPool)
    pool.workers, pool.calls_since_sync, pool.serial = [worker(0), worker(1)], [0, 0], 5
    ids = [[i] for i in range(6)]
    batch = RolloutBatch([0, 0, 0, 1, 1, 1], ids, ids, ids, [""] * 6, ["partial"] * 6)
    pool.submit_resume(batch, [1, 2, 4], step=3, draw=9)
    assert sent == [(0, [(0, 1, [1], [1]), (0, 2, [2], [2])], 3, 9, 5), (1, [(1, 1, [4], [4])], 3, 9, 5)]
    assert pool.calls_since_sync == [1, 1]
