"""LoRA adapter sync's pure parts (rollout/adapters.py): vLLM's engine arguments for a rank, the folder an
adapter is written to as PEFT saves one, the config key that picks the path and the mode it refuses. The
engines' side on real vLLM: tests/e2e/learner/test_lora_sync.py."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from orchestrator.config.load import ConfigError, load_config
from orchestrator.loop.roles import lora_sync
from rollout.adapters import adapter_bytes, engine_lora_args, write_adapter
from tests.helpers import REPO

DEFAULT = REPO / "configs" / "grpo_tiny_cpu.yaml"
LORA = ["learner.lora.rank=4"]


def test_engine_arguments_round_the_rank_up_to_a_vllm_slot_and_keep_two_adapters_resident():
    assert engine_lora_args(0) == {}
    args = engine_lora_args(4)
    assert args["enable_lora"] and args["max_lora_rank"] == 8 and args["max_loras"] == 2
    assert engine_lora_args(16)["max_lora_rank"] == 16 and engine_lora_args(17)["max_lora_rank"] == 32
    with pytest.raises(ValueError, match="learner.lora.rank 600: vLLM serves adapters up to rank 512"):
        engine_lora_args(600)


def test_an_adapter_is_written_as_peft_saves_one(tmp_path):
    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(4, 8)}
    adapter = {"tensors": tensors, "config": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}}
    write_adapter(tmp_path / "a", adapter)
    assert torch.equal(load_file(tmp_path / "a" / "adapter_model.safetensors")[next(iter(tensors))], torch.ones(4, 8))
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["r"] == 4
    assert adapter_bytes(adapter) == 4 * 8 * 4


def test_the_sync_path_follows_the_config(capsys):
    assert lora_sync(load_config(DEFAULT).learner) == ""  # no LoRA
    # auto, the default: merged on CPU engines (vLLM's CPU LoRA kernels generated 2.3x slower), the adapter on GPUs
    assert lora_sync(load_config(DEFAULT, LORA).learner) == "merged"
    assert "learner.lora.sync auto -> merged: CPU engines generated 2.3x slower" in capsys.readouterr().err
    gpu = ["cluster.gpus_per_rollout_worker=1", "cluster.gpus_per_learner=1", "cluster.colocate=false"]
    assert lora_sync(load_config(DEFAULT, [*LORA, *gpu]).learner) == "adapter"
    in_flight = load_config(DEFAULT, [*LORA, *gpu, "async_training.mode=in_flight"]).learner
    assert lora_sync(in_flight) == "merged"  # one adapter a request cannot follow an update mid-way
    assert lora_sync(load_config(DEFAULT, [*LORA, "learner.lora.sync=adapter"]).learner) == "adapter"  # as asked
    assert lora_sync(load_config(DEFAULT, [*LORA, *gpu, "learner.lora.sync=merged"]).learner) == "merged"
    with pytest.raises(ConfigError, match="learner.lora.sync"):
        load_config(DEFAULT, [*LORA, "learner.lora.sync=both"])


def test_in_flight_updates_need_the_merged_path():
    in_flight = [*LORA, "async_training.mode=in_flight", "learner.lora.sync=adapter"]
    with pytest.raises(ConfigError, match="learner.lora.sync") as e:
        load_config(DEFAULT, in_flight)
    assert "samples with one adapter from start to end" in str(e.value)
    assert load_config(DEFAULT, [*in_flight[:-1], "learner.lora.sync=merged"]).learner.lora.sync.value == "merged"


class FakeLLM:
    """AsyncLLM's LoRA calls as Adapters makes them: the ids vLLM holds."""

    def __init__(self):
        self.loaded: set[int] = set()

    async def add_lora(self, request) -> bool:
        self.loaded.add(request.lora_int_id)
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        self.loaded.remove(lora_id)
        return True


def test_a_request_keeps_its_adapter_through_a_sync_and_the_old_one_goes_when_nothing_samples_with_it(tmp_path):
    import asyncio

    from rollout.adapters import Adapters

    adapter = {"tensors": {"a.lora_A.weight": torch.zeros(2, 2)}, "config": {"r": 2}}

    async def scenario():
        llm = FakeLLM()
        adapters = Adapters(llm)
        assert adapters.take() is None  # before the first sync: the base model
        await adapters.load(adapter, version=1)
        running = adapters.take()  # a request sampling with version 1's adapter
        await adapters.load(adapter, version=2)  # a sync while it runs: it keeps its adapter
        assert adapters.loaded() == [1, 2] and llm.loaded == {1, 2} and running.lora_int_id == 1
        newer = adapters.take()
        assert newer.lora_int_id == 2
        await adapters.release(running)  # it ends: nothing samples with version 1 any more
        assert adapters.loaded() == [2] and llm.loaded == {2}
        assert not (adapters.root / "1").exists() and (adapters.root / "2" / "adapter_config.json").exists()
        await adapters.release(newer)  # the newest stays, used or not
        await adapters.load(adapter, version=3)
        assert adapters.loaded() == [3] and llm.loaded == {3}
        adapters.close()
        assert not adapters.root.exists()

    asyncio.run(scenario())


def test_the_adapter_folders_of_an_engine_that_died_go_when_the_next_engine_starts(tmp_path, monkeypatch):
    """An engine killed without close() leaves its folders in the node's temporary directory: the next engine
    on the node removes those whose process is gone, and leaves a live engine's and another host's (a shared
    temporary directory)."""
    from rollout.adapters import ADAPTER_DIRS, Adapters, owner, sweep_dead

    host = owner().rpartition(".")[0]
    dead = tmp_path / f"{ADAPTER_DIRS}{host}.{2**22 + 1}-abc"  # above Linux's largest pid: no such process
    live = tmp_path / f"{ADAPTER_DIRS}{host}.{os.getpid()}-def"
    elsewhere = tmp_path / f"{ADAPTER_DIRS}otherhost.{2**22 + 1}-ghi"
    for folder in (dead, live, elsewhere):
        (folder / "1").mkdir(parents=True)
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path))
    adapters = Adapters(FakeLLM())
    assert not dead.exists() and live.exists() and elsewhere.exists()
    assert adapters.root.parent == tmp_path and adapters.root.name.startswith(f"{ADAPTER_DIRS}{owner()}-")
    assert sweep_dead(tmp_path) == []  # its own folder and the live one stay


def test_a_config_built_in_code_gets_its_sync_path_when_the_run_starts_and_never_runs_auto():
    from learner.lora_config import LoraSync
    from orchestrator.config.lora import resolve_lora_sync
    from orchestrator.config.schema import TrainConfig

    cfg = TrainConfig()
    cfg.learner.lora.rank = 4
    with pytest.raises(ValueError, match="learner.lora.sync auto: not resolved"):
        lora_sync(cfg.learner)  # the roles refuse an unresolved path rather than guess one
    assert resolve_lora_sync(cfg) == [  # what start_parts does before any role starts
        "learner.lora.sync auto -> merged: CPU engines generated 2.3x slower with vLLM's LoRA kernels than with "
        "merged weights"
    ]
    assert cfg.learner.lora.sync == LoraSync.merged and resolve_lora_sync(cfg) == []  # once
    on_gpus = TrainConfig()
    on_gpus.learner.lora.rank, on_gpus.cluster.gpus_per_rollout_worker = 4, 0.5  # a GPU's share is a GPU
    resolve_lora_sync(on_gpus)
    assert on_gpus.learner.lora.sync == LoraSync.adapter
    no_lora = TrainConfig()
    assert resolve_lora_sync(no_lora) == [] and lora_sync(no_lora.learner) == ""
