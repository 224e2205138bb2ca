"""AsyncEngine's order of calls and weight syncs, on a stand-in AsyncLLM: Ray runs an async actor's
calls out of order, and the pool's numbering (after which sync a call was sent; how many calls a sync
follows) must restore the order the driver sent them in. And token_versions reads vLLM's spans."""

import asyncio
from types import SimpleNamespace

from rollout.async_engine import AsyncEngine, token_versions


class Collector:
    def __init__(self, rid, done):
        self.request_id, self.done = rid, done

    def get_nowait(self):
        return None

    async def get(self):
        await self.done.wait()
        return SimpleNamespace(finished=True, outputs=[])


class StandIn:
    """add_request's requests finish when `release` is set; pause/resume/version calls are recorded."""

    def __init__(self):
        self.release, self.log = asyncio.Event(), []
        self.engine_core = SimpleNamespace(pause_scheduler_async=self._noop, resume_scheduler_async=self._noop)

    async def _noop(self, **kw):
        return None

    async def add_request(self, rid, request, params):
        self.log.append(("add", request["cache_salt"]))
        return Collector(rid, self.release)

    async def pause_generation(self, **kw):
        self.log.append(("pause", kw["mode"]))

    async def resume_generation(self):
        self.log.append(("resume",))

    async def update_weight_version(self, v):
        self.log.append(("version", v))


async def call(engine, after, name, out):
    async with engine.call(after):
        out.append(("start", name, engine.serial))
        await engine.generate([[1, 2]], [SimpleNamespace(output_kind=None)])
        out.append(("end", name))


async def sync(engine, serial, calls, in_flight, out):
    async with engine.weights(serial, calls, in_flight):
        out.append(("sync", serial))
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
    assert [e for e in log if e[0] == "add"] == [("add", "v0"), ("add", "v0"), ("add", "v1")]  # the salt: the version


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
    assert [e for e in log if e[0] != "add"] == [("pause", "keep"), ("version", "1"), ("resume",)]


def test_token_versions_follow_the_spans_and_default_is_the_initial_model():
    span = lambda v, s, e: SimpleNamespace(version=v, start=s, end=e)  # noqa: E731
    c = SimpleNamespace(token_ids=[5] * 6, weight_versions=[span("default", 0, 2), span("3", 2, 5), span("4", 5, 6)])
    assert token_versions(c) == [0, 0, 3, 3, 3, 4]
    assert token_versions(SimpleNamespace(token_ids=[1, 2], weight_versions=None)) == [0, 0]
