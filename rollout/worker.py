"""RolloutWorker: one vLLM engine (AsyncLLM) behind a Ray actor, called by method.

The actor is asynchronous: calls run concurrently on its event loop and share the engine's batch
(rollout/async_engine.py), and the engine's core runs in a child process of the actor."""

from __future__ import annotations

import dataclasses
import logging
import os
import pickle

import ray
import torch

from envs.config import EnvConfig
from envs.registry import make_factory
from rollout.adapters import Adapters
from rollout.async_engine import AsyncEngine, EngineRestarted, token_versions
from rollout.config import RolloutConfig, SamplingConfig
from rollout.continuation import joined
from rollout.engine import (
    completion_text,
    engine_env,
    make_engine,
    sampled_logprobs,
    sampling_params,
    transfer_backend,
)
from rollout.episodes import EpisodeSeeds, PromptShard, play, start_episodes, to_batch
from rollout.sync_check import PROBE_TEXT, PROBE_TOKENS, probe_params, prompt_logprobs
from rollout.types import Prompt, RolloutBatch
from rollout.weight_sync import GLOO_BACKEND
from runtime.device import process_device
from runtime.profiling import Busy, Profiled
from runtime.prompts import encode_prompt
from runtime.seeds import env_seed, request_seed, stream_seed

log = logging.getLogger(__name__)


def finish_reason(completion) -> str:
    """A completion's finish reason as RolloutBatch keeps it; vLLM's "abort" is a preempted sample's."""
    if completion.finish_reason == "abort":
        return "partial"
    return "length" if completion.finish_reason == "length" else "stop"


class RolloutWorker(Profiled, Busy):
    """Create with `ray.remote(RolloutWorker).options(...).remote(cfg, model_path, seed)`;
    RolloutPool does this for N workers."""

    def __init__(
        self,
        cfg: RolloutConfig,
        model_path: str,
        seed: int,
        threads: int = 0,
        sleep_mode: bool = False,
        step_samples: int = 0,
        env: EnvConfig | None = None,
        lora_rank: int = 0,
    ):
        """env: the environment its samples play (multi-turn episodes); None or no name = single-turn.
        lora_rank: serve LoRA adapters of this rank on the base weights (learner.lora.sync adapter); 0: none."""
        self.env = env if env is not None and env.name else None
        self.env_factory = make_factory(self.env.name, self.env.options) if self.env else None
        self.device = process_device()
        os.environ.update(engine_env(cfg, threads, self.device.type == "cuda"))
        self.cfg, self.seed = cfg, seed  # the run seed
        context = ray.get_runtime_context() if ray.is_initialized() else None  # None: built outside Ray (tests)
        restarted = context.get_actor_id() if context and context.was_current_actor_reconstructed else None
        self.engine = AsyncEngine(
            make_engine(cfg, model_path, stream_seed(seed, "engine"), self.device, sleep_mode, step_samples, lora_rank),
            restarted,
        )
        if lora_rank > 0:
            self.engine.adapters = Adapters(self.engine.llm)
        self.tokenizer = self.engine.llm.get_tokenizer()
        self.asleep = False
        # see rollout.transfer.GlooUpdateInfo.direct. CPU tensor-parallel layers lose their
        # weight_loader after loading, so those engines take vLLM's reload path.
        self.direct_load = self.device.type == "cuda" or (cfg.cpu_plain_linear and cfg.tensor_parallel_size == 1)
        self.transfer_backend = transfer_backend(self.device.type == "cuda", sleep_mode)
        self.keep_threads(threads)

    def ready(self) -> bool:
        return True

    def get_device(self) -> torch.device:
        return self.device

    async def generate(
        self,
        prompts: list[Prompt],
        step: int,
        first_index: int = 0,
        greedy: bool = False,
        sampling: SamplingConfig | None = None,
        tasks: list[dict] | None = None,
        draw: int = 0,
        after: int | None = None,
    ) -> RolloutBatch:
        """Sample for `prompts`, whose global indices start at `first_index`, with the configured
        sampling (or `sampling`, e.g. for evaluation), seeded by (step, draw, index): runtime.seeds.
        Unusable prompts are skipped and listed with their reason; the n samples of one prompt come
        back contiguous. With an environment each sample is an episode, reset on the prompt's entry of
        `tasks` (answer and metadata). `after`: the pool's weight sync this call was sent after
        (AsyncEngine.call)."""
        async with self.engine.call(after):
            return await self._generate_or_play(prompts, step, first_index, greedy, sampling, tasks, draw)

    async def _generate_or_play(self, prompts, step, first_index, greedy, sampling, tasks, draw) -> RolloutBatch:
        with self.working():
            key = (step, draw)
            if self.env is not None:
                return await self._episodes(prompts, tasks, key, first_index, greedy, sampling or self.cfg.sampling)
            return await self._generate(prompts, key, first_index, greedy, sampling or self.cfg.sampling)

    def busy_seconds(self) -> float:
        return Busy.busy_seconds(self)

    async def _generate(
        self, prompts: list[Prompt], key: tuple[int, int], first_index: int, greedy: bool, sampling: SamplingConfig
    ) -> RolloutBatch:
        requests, params, kept, skipped = [], [], [], []
        for offset, prompt in enumerate(prompts):
            index = first_index + offset
            ids, reason = encode_prompt(self.tokenizer, prompt, self.cfg.max_prompt_tokens, self.cfg.prompt_overflow)
            if ids is None:
                log.warning("rollout: skipping prompt %d: %s", index, reason)
                skipped.append((index, reason))
                continue
            requests.append(ids)
            params.append(sampling_params(sampling, self._request_seed(sampling, key, index), greedy))
            kept.append(index)
        outputs = await self.engine.generate(requests, params)
        batch = RolloutBatch([], [], [], [], [], [], skipped)
        for index, request, out in zip(kept, requests, outputs):
            for c in sorted(out.outputs, key=lambda c: c.index):
                self._append(batch, index, request, c, c.text)
        if not sampling.stop:  # not detokenized by vLLM (engine.sampling_params): one batch decode, as vLLM would
            batch.response_text = self.tokenizer.batch_decode(batch.response_ids, skip_special_tokens=True)
        return batch

    async def preempt(self) -> int:
        """Cut every running sample where it is (AsyncEngine.preempt): the calls return with them
        "partial", to be continued by `resume`. Episodes are not cut (0): they run to their end."""
        return 0 if self.env is not None else await self.engine.preempt()

    async def hold(self, on: bool) -> None:
        """Freeze the running sequences where they are (on), or let them go on (AsyncEngine.hold)."""
        await (self.engine.hold() if on else self.engine.release())

    async def sampled_so_far(self) -> list[int]:
        """Tokens sampled so far by each unfinished sequence (AsyncEngine.sampled_so_far)."""
        return self.engine.sampled_so_far()

    async def resume(
        self, cut: list[tuple[int, int, list[int], list[int]]], step: int, draw: int, after: int
    ) -> RolloutBatch:
        """Continue cut samples [(prompt index, place in its group, prompt ids, the response so far)] of
        the batch of (step, draw), each one sample up to the configured max_new_tokens in all, seeded by
        its prompt, its place in the group and its length; one continuation each, in order
        (RolloutBatch.continued joins them), with the whole response's text; a stop string across the cut
        ends the sample there, as vLLM would have (rollout.continuation.joined). A sample whose budget is
        spent already (a run resumed with a smaller max_new_tokens) ends "length" with no new token."""
        sampling = dataclasses.replace(self.cfg.sampling, n_samples_per_prompt=1)
        live = [c for c in cut if len(c[3]) < sampling.max_new_tokens]
        requests, params = [], []
        for index, place, prompt, response in live:
            seed = stream_seed(self._request_seed(sampling, (step, draw), index), "resume", place, len(response))
            requests.append(prompt + response)
            params.append(sampling_params(sampling, seed, max_tokens=sampling.max_new_tokens - len(response)))
        async with self.engine.call(after):
            with self.working():
                outputs = iter(zip(await self.engine.generate(requests, params), params))
        more = RolloutBatch([], [], [], [], [], [], [])
        for index, _, prompt, response in cut:
            out, p = next(outputs) if len(response) < sampling.max_new_tokens else (None, None)
            c, text = joined(self.tokenizer, response, out.outputs[0] if out else None, p)
            self._append(more, index, prompt, c, text)
        return more

    def _append(self, batch: RolloutBatch, index: int, prompt: list[int], c, text: str) -> None:
        """One completion `c` of prompt `index` as a sample of `batch` (None: no token, its budget spent)."""
        versions = token_versions(c) if c else []
        batch.prompt_index.append(index)
        batch.prompt_ids.append(prompt)
        batch.response_ids.append(list(c.token_ids) if c else [])
        batch.logprobs.append(sampled_logprobs(c) if c else [])
        batch.response_text.append(text)
        batch.finish_reason.append(finish_reason(c) if c else "length")
        batch.token_versions.append(versions)
        batch.version_first.append(versions[0] if versions else self.version)
        batch.version_last.append(versions[-1] if versions else self.version)

    @property
    def version(self) -> int:
        """The policy version of the weights held: weight syncs received (0 = the initial model)."""
        return self.engine.version

    async def _episodes(
        self,
        prompts: list[Prompt],
        tasks: list[dict] | None,
        key: tuple[int, int],
        first_index: int,
        greedy: bool,
        sampling: SamplingConfig,
    ) -> RolloutBatch:
        if tasks is None or len(tasks) != len(prompts):
            raise ValueError(f"env {self.env.name}: every prompt needs its task (answer, metadata) to reset an episode")
        samples = 1 if greedy else sampling.n_samples_per_prompt
        step, draw = key
        first_version = self.version
        episodes, skipped = start_episodes(
            self.env_factory,
            PromptShard(prompts, tasks, first_index),
            samples,
            EpisodeSeeds(
                sampling=lambda index: self._request_seed(sampling, key, index),
                env=lambda index, k: env_seed(self.seed, step, index, draw, k),
            ),
            self.tokenizer,
            self.cfg,
            self.env.step_timeout_s,
        )
        await play(
            self.engine,
            self.tokenizer,
            episodes,
            sampling,
            greedy,
            self.env,
            self.env.response_tokens(sampling.max_new_tokens),
        )
        batch = to_batch(episodes, skipped)
        batch.version_first = [v[0] if v else first_version for v in batch.token_versions]
        batch.version_last = [v[-1] if v else first_version for v in batch.token_versions]
        return batch

    async def complete(self, prompt_ids: list[list[int]], sampling: list[SamplingConfig]) -> tuple[list[tuple], int]:
        """One completion per token-id prompt, each with its own sampling (the agent endpoint's calls,
        rollout/gateway.py): [(token ids, logprobs, text, finish reason)] and the policy version."""
        async with self.engine.call():
            with self.working():
                version = self.version
                params = [sampling_params(s, s.seed) for s in sampling]
                outputs = await self.engine.generate(prompt_ids, params)
        out = [
            (
                list(c.token_ids),
                sampled_logprobs(c),
                completion_text(c, self.tokenizer, p),
                "length" if c.finish_reason == "length" else "stop",
            )
            for c, p in zip((o.outputs[0] for o in outputs), params)
        ]
        return out, version

    def _request_seed(self, sampling: SamplingConfig, key: tuple[int, int], index: int) -> int:
        """The run seed's sampling stream, or rollout.sampling.seed's where it overrides the run seed;
        key: (step, draw)."""
        step, draw = key
        return request_seed(self.seed if sampling.seed is None else sampling.seed, step, index, draw)

    # ---- weights: vLLM's weight-transfer API; payloads and backends in rollout/weight_sync.py
    async def init_weight_sync(self, init_info: dict) -> None:
        """Every TP worker of this engine joins the transfer group (weight_sync.init_info: each adds
        its own rank to the engine's first rank, see pool.sync_ranks)."""
        await self.engine.llm.collective_rpc("init_weight_transfer_engine", kwargs={"init_info": init_info})

    async def receive_weights(
        self,
        update_info: dict,
        version: int | None = None,
        in_flight: bool = False,
        order: tuple[int, int] | None = None,
    ) -> int:
        """Take one full update (weight_sync.update_info, as the sender's) as policy `version` (None:
        unchanged, for tests and benchmarks); returns the tensors loaded (0 on vLLM's own engines,
        which do not count them). Taken between calls (after the calls sent before it, before the
        ones sent after), or in flight: at once, the running sequences paused and continued under
        the new weights. order: (the pool's sync serial, the calls sent to this engine since the
        sync before); see AsyncEngine.weights."""
        if self.transfer_backend == GLOO_BACKEND:
            update_info = {**update_info, "direct": self.direct_load}
        llm = self.engine.llm
        async with self.engine.weights(*(order or (None, 0)), in_flight):
            await llm.collective_rpc("start_weight_update")
            await llm.collective_rpc("update_weights", kwargs={"update_info": update_info})
            await llm.collective_rpc("finish_weight_update")
            if version is not None:
                await self.engine.set_version(version)  # vLLM's tag on every token sampled from now on
        return (await llm.collective_rpc("relay_loaded"))[0]

    async def load_weights(
        self,
        named_tensors: list[tuple[str, torch.Tensor]],
        version: int | None = None,
        in_flight: bool = False,
        order: tuple[int, int] | None = None,
    ) -> int:
        """The same-node path on CPU: tensors arrive through Ray's shared-memory object store and go
        through the same update, pickled (vLLM's RPC to the engine's process turns tensors nested in
        its arguments into lists)."""
        return await self.receive_weights({"payload": pickle.dumps(named_tensors)}, version, in_flight, order)

    async def load_adapter(
        self, adapter: dict, version: int | None = None, in_flight: bool = False, order: tuple[int, int] | None = None
    ) -> None:
        """Take one adapter sync (rollout/adapters.py) as policy `version`, in the order receive_weights takes
        a full one; requests added from then on sample with it."""
        async with self.engine.weights(*(order or (None, 0)), in_flight):
            await self.engine.adapters.load(adapter, self.version if version is None else version)
            if version is not None:
                await self.engine.set_version(version)

    async def adapters_loaded(self) -> tuple[list[int], int]:
        """(the policy versions of the adapters this engine holds, the adapters vLLM has loaded)."""
        return self.engine.adapters.loaded(), len(await self.engine.llm.list_loras())

    async def weight_routes(self) -> dict[str, tuple[str, int, bool]]:
        """Tensors that load by direct copy (rollout/load_routes.py): name -> (parameter, first row, transposed)."""
        routes = (await self.engine.rpc("relay_routes"))[0]
        return {name: tuple(route) for name, route in routes.items()}  # vLLM's RPC returns tuples as lists

    async def probe_ids(self) -> list[int]:
        """The sync check's probe as this engine's tokenizer encodes it (rollout/sync_check.py)."""
        ids = self.tokenizer.encode(PROBE_TEXT, add_special_tokens=False)[
            : min(PROBE_TOKENS, self.cfg.max_model_len - 1)
        ]
        if len(ids) < 2:
            raise ValueError(f"rollout.sync_check: the tokenizer makes {len(ids)} token(s) of the probe; set it false")
        return ids

    async def probe(self, ids: list[int]) -> list[float]:
        """This engine's logprobs of the probe's tokens after the first, with the weights it holds now. Outside
        the calls' order (AsyncEngine.call): the channel asks once the sync has loaded. An engine Ray restarted
        since holds the initial weights: it fails as a restarted engine's calls do, not as a bad sync."""
        e = self.engine
        if e.restarted_actor is not None and e.loads == 0:
            raise EngineRestarted(e.restarted_actor, 0)
        out = (await self.engine.generate([ids], [probe_params()]))[0]
        return prompt_logprobs(out, ids)

    async def weight_checksum(self) -> float:
        return (await self.engine.rpc("relay_weight_checksum"))[0]

    # ---- lifecycle
    async def sleep(self) -> int:
        """Free device memory for a colocated learner (vLLM sleep level 1: weights offloaded to
        host memory, KV cache dropped); returns the bytes freed on the device (0 on CPU)."""
        if self.device.type != "cuda":
            return 0
        free_before = torch.cuda.mem_get_info()[0]
        await self.engine.llm.sleep(level=1)
        self.asleep = True
        freed = torch.cuda.mem_get_info()[0] - free_before
        log.info("rollout: asleep, %.2f GiB freed on the GPU", freed / 2**30)
        return freed

    async def wake_up(self) -> None:
        if self.device.type != "cuda":
            return
        await self.engine.llm.wake_up()
        self.asleep = False

    def shutdown(self) -> None:
        self.engine.llm.shutdown()
        if self.engine.adapters is not None:
            self.engine.adapters.close()
