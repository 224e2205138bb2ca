"""AsyncEngine: one worker's vLLM AsyncLLM, shared by every call the worker serves.

Requests of every call flow into one engine: a call that arrives while another runs joins its batch
at the next scheduler step (continuous batching), whatever step it belongs to. Weights change in one
of two ways (`weights_between_calls` and `weights_in_flight`):
- between calls: the update waits for the calls already running, and calls arriving meanwhile wait
  for it, so every sample is sampled by one version (sync, one_step and full training);
- in flight: the engine pauses with vLLM's `keep`, takes the weights and resumes, so running samples
  continue under the new version; every token's version comes from vLLM's `weight_versions` spans.

A call that finds the engine idle adds all its requests while the scheduler is held, so they enter
the batch together as `LLM.generate`'s do: a sync-mode step decodes the same batches, bit for bit.

Ray runs an async actor's calls out of order, so the order the driver meant travels with them: the
pool numbers its weight syncs (`serial`); a call says after which sync it was sent, and waits for it;
a sync says how many calls were sent to this engine since the sync before, and (between calls) waits
for them to arrive and finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
from collections import Counter

from rollout.adapters import Adapters

log = logging.getLogger(__name__)


def token_versions(completion) -> list[int]:
    """The policy version that sampled each token of a completion, from vLLM's weight_versions spans
    (a span's version is the str(int) relay set at an update; vLLM's "default" is the weights the
    engine started with: version 0, the initial model, which a restarted engine holds too)."""
    n_tokens = len(completion.token_ids)
    versions = [0] * n_tokens
    for span in getattr(completion, "weight_versions", None) or []:  # absent: a stand-in engine's
        v = 0 if span.version in (None, "default") else int(span.version)
        for t in range(max(span.start, 0), min(span.end, n_tokens)):
            versions[t] = v
    return versions


class EngineRestarted(RuntimeError):
    """A call reached an engine that Ray restarted: it was sent after a weight sync that went to the
    engine's dead predecessor, so it would wait for that sync forever (or sample with the initial
    model). The driver takes it as the engine's death (RolloutPool.collect), restarts its weights and
    sends the call again."""

    def __init__(self, actor_id: str, after: int):
        super().__init__(f"rollout engine {actor_id} was restarted: it never took weight sync {after}")
        self.actor_id, self.after = actor_id, after

    def __reduce__(self):  # Ray sends it to the driver pickled: rebuilt from its own arguments
        return EngineRestarted, (self.actor_id, self.after)


class AsyncEngine:
    """Owns the AsyncLLM, its request ids, the calls running on it, how weights may change under them
    and the policy version it holds (weight syncs received; 0 = the initial model)."""

    def __init__(self, llm, restarted_actor: str | None = None):
        """restarted_actor: this actor's id when Ray restarted it (EngineRestarted), else None."""
        self.llm, self.restarted_actor = llm, restarted_actor
        self.adapters: Adapters | None = None  # learner.lora.sync adapter: the LoRA adapters requests sample with
        self.version = 0
        self.serial = 0  # the last weight sync taken, by the pool's numbering
        self.loads = 0  # weight loads taken (whatever their version): the prefix cache's salt
        self._pauses = 0  # holders of the scheduler's pause: a call adding its requests, a sync in flight
        self._pause_lock: asyncio.Lock | None = None
        self._adding: asyncio.Lock | None = None  # held by the call adding its requests
        self._ids = itertools.count()
        self._live: set[str] = set()  # requests added and not yet finished (preempt)
        self._lora: dict[str, object] = {}  # request id -> the adapter it samples with (Adapters.take)
        self._running = 0  # the worker's calls under way
        self._arrived: Counter[int] = Counter()  # calls admitted, by the sync they were sent after
        self._decoding = 0  # generate calls whose requests are in the engine
        self._updating = False  # an update between calls holds new calls back
        self._changed: asyncio.Condition | None = None  # made on the actor's event loop, at first use
        self._sync_lock: asyncio.Lock | None = None

    @property
    def changed(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    @property
    def sync_lock(self) -> asyncio.Lock:
        if self._sync_lock is None:
            self._sync_lock = asyncio.Lock()
        return self._sync_lock

    @property
    def adding(self) -> asyncio.Lock:
        if self._adding is None:
            self._adding = asyncio.Lock()
        return self._adding

    @property
    def pause_lock(self) -> asyncio.Lock:
        if self._pause_lock is None:
            self._pause_lock = asyncio.Lock()
        return self._pause_lock

    @contextlib.asynccontextmanager
    async def call(self, after: int | None = None):
        """One call of the worker: admitted once the sync it was sent after (`after`; None: any) is
        taken and no sync between calls is under way; counted as running until it ends. On an engine
        Ray restarted, a call sent after a sync it never took raises EngineRestarted at once."""
        if self.restarted_actor is not None and self.loads == 0 and after:
            raise EngineRestarted(self.restarted_actor, after)
        async with self.changed:
            await self.changed.wait_for(lambda: not self._updating and (after is None or self.serial >= after))
            self._running += 1
            if after is not None:
                self._arrived[after] += 1
                self.changed.notify_all()
        try:
            yield
        finally:
            async with self.changed:
                self._running -= 1
                self.changed.notify_all()

    async def generate(self, prompt_ids: list[list[int]], params: list) -> list:
        """One RequestOutput per prompt (every one of its n completions), in prompt order."""
        if not prompt_ids:
            return []
        self._decoding += 1
        idle, collectors = self._decoding == 1, []
        try:
            # calls add their requests one call after another, in the order they came: a call that found
            # the engine idle pauses it first, and one arriving meanwhile must not slip its requests
            # ahead (the batch launched ahead would then decode before the batch the learner waits for)
            async with self.adding:
                if idle:  # nothing decoding: add the whole call at once, as LLM.generate does
                    await self._pause()
                try:
                    for ids, p in zip(prompt_ids, params):
                        collectors.append(await self._add(ids, p))
                finally:
                    if idle:
                        await self._resume()
            return list(await asyncio.gather(*(self._final(c) for c in collectors)))
        except BaseException:
            self._engine_dead_exits()
            for c in collectors:  # none may decode on after its call failed (a sync counts on that)
                await self.llm.abort(c.request_id, internal=True)
            raise
        finally:
            self._decoding -= 1
            self._live.difference_update(c.request_id for c in collectors)
            if self.adapters is not None:
                for c in collectors:
                    await self.adapters.release(self._lora.pop(c.request_id, None))

    async def preempt(self) -> int:
        """End every request now with what it has sampled so far (vLLM's abort: its final output, finish
        reason "abort"), so each call returns at once with its samples cut (partial rollouts: a
        checkpoint keeps them, and they are continued later). Returns the requests cut."""
        cut = list(self._live)
        if cut:
            await self.llm.abort(cut, internal=True)
        return len(cut)

    async def hold(self) -> None:
        """Freeze the running sequences where they are (the scheduler paused with vLLM's keep) until
        release(): a test's way to cut or update them at a set point, whatever the machine's speed."""
        await self._pause()

    async def release(self) -> None:
        await self._resume()

    def sampled_so_far(self) -> list[int]:
        """How many tokens each unfinished sequence has sampled (vLLM's output processor keeps them even
        for final-only outputs): lets a test land an update at a set point of its sequences."""
        states = self.llm.output_processor.request_states.values()
        return [s.detokenizer.num_output_tokens() for s in states if s.detokenizer is not None]

    def _engine_dead_exits(self) -> None:
        """vLLM's engine core (a child process) died: end this worker's process too, so that Ray
        restarts it and the driver's restart paths see a dead actor, not one that fails every call."""
        if self.llm.errored:
            log.error("rollout: vLLM's engine core died; exiting so that Ray restarts this worker")
            os._exit(1)

    async def _add(self, ids: list[int], params):
        from vllm.sampling_params import RequestOutputKind

        params.output_kind = RequestOutputKind.FINAL_ONLY  # one output per request, all n completions in it
        # the salt keeps the prefix cache to KV computed by the weights of this load or, in flight, a
        # later one (a request added before an in-flight sync may prefill after it): no reset needed
        request = {"prompt_token_ids": ids, "cache_salt": f"w{self.loads}"}
        lora = self.adapters.take() if self.adapters is not None else None  # the newest adapter, for its whole life
        try:
            adapter = {"lora_request": lora} if lora is not None else {}
            collector = await self.llm.add_request(f"relay-{next(self._ids)}", request, params, **adapter)
        except BaseException:
            if lora is not None:
                await self.adapters.release(lora)
            raise
        self._live.add(collector.request_id)
        if lora is not None:
            self._lora[collector.request_id] = lora
        return collector

    async def _final(self, collector):
        # a cancelled or failed call's requests are aborted once, by generate
        while True:
            out = collector.get_nowait() or await collector.get()
            if out.finished:
                return out

    async def _pause(self) -> None:
        """Hold the scheduler (vLLM's keep: running requests stay, frozen); counted, as a call adding
        its requests and an in-flight sync may hold it at once, and only the last release resumes.
        The engine core's own call, which AsyncLLM.pause_generation makes after a 20 ms sleep for the
        outputs of running requests to arrive first: nothing here waits for them."""
        async with self.pause_lock:
            self._pauses += 1
            if self._pauses == 1:
                await self.llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)

    async def _resume(self) -> None:
        async with self.pause_lock:
            self._pauses -= 1
            if self._pauses == 0:
                await self.llm.engine_core.resume_scheduler_async()

    @contextlib.asynccontextmanager
    async def weights(self, serial: int | None, calls: int, in_flight: bool):
        """Inside, sync `serial` loads (None: a sync outside the pool's numbering, e.g. a test's);
        `calls`: the calls sent to this engine since sync serial - 1. Syncs run one at a time.
        Between calls (in_flight False): those calls arrive and finish first, and calls arriving
        meanwhile wait. In flight: at once, the engine paused with its running requests kept (vLLM's
        keep); they continue on resume, under the new weights."""
        async with self.sync_lock:
            async with self.changed:
                # an engine behind by more than one sync was restarted: the calls sent to it before died
                await self.changed.wait_for(
                    lambda: (
                        in_flight or serial is None or self.serial < serial - 1 or self._arrived[serial - 1] >= calls
                    )
                )
                self._updating = not in_flight
                await self.changed.wait_for(lambda: in_flight or self._running == 0)
            ok = False
            try:
                if in_flight:
                    await self._pause()
                try:
                    yield
                finally:
                    if in_flight:
                        await self._resume()
                ok = True
            finally:
                await self._synced(serial if ok else None)

    async def _synced(self, serial: int | None) -> None:
        """After a sync: calls may go on; a sync that failed (serial None) leaves the engine's serial
        where it was, so no call sent after it is admitted on weights it did not finish loading."""
        async with self.changed:
            self._updating = False
            self.loads += 1
            if serial is not None:
                self.serial = max(self.serial, serial)
                self._arrived = Counter({k: n for k, n in self._arrived.items() if k >= self.serial})
            self.changed.notify_all()

    async def set_version(self, version: int) -> None:
        """Tag every token sampled from now on with this policy version (vLLM's weight_versions)."""
        await self.llm.update_weight_version(str(version))
        self.version = version

    async def rpc(self, method: str, args: tuple = ()) -> list:
        """collective_rpc on every worker of the engine (its TP ranks); one answer each."""
        return await self.llm.collective_rpc(method, args=args)
