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
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging

log = logging.getLogger(__name__)


def token_versions(completion) -> list[int]:
    """The policy version that sampled each token of a completion, from vLLM's weight_versions spans
    (a span's version is the str(int) relay set at an update; vLLM's "default" is the weights the
    engine started with: version 0, the initial model, which a restarted engine holds too)."""
    n_tokens = len(completion.token_ids)
    versions = [0] * n_tokens
    for span in completion.weight_versions or []:
        v = 0 if span.version in (None, "default") else int(span.version)
        for t in range(max(span.start, 0), min(span.end, n_tokens)):
            versions[t] = v
    return versions


class AsyncEngine:
    """Owns the AsyncLLM, its request ids, the calls running on it, how weights may change under them
    and the policy version it holds (weight syncs received; 0 = the initial model)."""

    def __init__(self, llm):
        self.llm = llm
        self.version = 0
        self._ids = itertools.count()
        self._running = 0  # calls whose requests are in the engine
        self._updating = False  # an update between calls holds new calls back
        self._changed: asyncio.Condition | None = None  # made on the actor's event loop, at first use

    @property
    def changed(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def generate(self, prompt_ids: list[list[int]], params: list) -> list:
        """One RequestOutput per prompt (every one of its n completions), in prompt order."""
        if not prompt_ids:
            return []
        async with self.changed:
            await self.changed.wait_for(lambda: not self._updating)
            self._running += 1
            idle = self._running == 1
        try:
            if idle:  # nothing decoding: add the whole call at once, as LLM.generate does
                await self._hold()
            try:
                collectors = [await self._add(ids, p) for ids, p in zip(prompt_ids, params)]
            finally:
                if idle:
                    await self._release()
            return list(await asyncio.gather(*(self._final(c) for c in collectors)))
        finally:
            async with self.changed:
                self._running -= 1
                self.changed.notify_all()

    async def _add(self, ids: list[int], params):
        from vllm.sampling_params import RequestOutputKind

        params.output_kind = RequestOutputKind.FINAL_ONLY  # one output per request, all n completions in it
        # the salt keeps the prefix cache to KV that the current weights computed: no reset after an update
        request = {"prompt_token_ids": ids, "cache_salt": f"v{self.version}"}
        return await self.llm.add_request(f"relay-{next(self._ids)}", request, params)

    async def _final(self, collector):
        try:
            while True:
                out = collector.get_nowait() or await collector.get()
                if out.finished:
                    return out
        except asyncio.CancelledError:
            await self.llm.abort(collector.request_id, internal=True)
            raise

    async def _hold(self) -> None:
        # the engine core's own pause (what pause_generation calls): pause_generation adds a 20 ms
        # sleep so outputs of running requests arrive first, and nothing runs here
        await self.llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)

    async def _release(self) -> None:
        await self.llm.engine_core.resume_scheduler_async()

    @contextlib.asynccontextmanager
    async def weights_between_calls(self):
        """Inside: no call running; the calls already running finish first, new ones wait."""
        async with self.changed:
            await self.changed.wait_for(lambda: not self._updating)
            self._updating = True
            await self.changed.wait_for(lambda: self._running == 0)
        try:
            yield
        finally:
            async with self.changed:
                self._updating = False
                self.changed.notify_all()

    @contextlib.asynccontextmanager
    async def weights_in_flight(self):
        """Inside: the engine paused with its running requests kept; they continue on resume."""
        await self.llm.pause_generation(mode="keep", clear_cache=False)
        try:
            yield
        finally:
            await self.llm.resume_generation()

    async def set_version(self, version: int) -> None:
        """Tag every token sampled from now on with this policy version (vLLM's weight_versions)."""
        await self.llm.update_weight_version(str(version))
        self.version = version

    async def rpc(self, method: str, args: tuple = ()) -> list:
        """collective_rpc on every worker of the engine (its TP ranks); one answer each."""
        return await self.llm.collective_rpc(method, args=args)
