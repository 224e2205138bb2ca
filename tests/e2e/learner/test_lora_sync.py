"""LoRA adapters synced alone (learner.lora.sync adapter, rollout/adapters.py) from a real learner to real vLLM
engines on a tiny Llama: the engines keep the base weights they loaded once and take each sync's adapter
under a new id, sample with the newest, drop the old, and score the sync check's probe as the learner does.
A sync that did not arrive fails at once, naming the adapter path; the merged path sends the whole model;
a model vLLM has no LoRA for is refused, naming the key."""

import pytest
import ray
import torch

from learner.lora_config import LoraConfig, LoraSync
from rollout.adapters import adapter_bytes, refuse_unservable
from rollout.channel import WeightChannel
from rollout.config import RolloutConfig, SamplingConfig
from rollout.pool import PoolOptions, RolloutPool
from rollout.sync_check import TOLERANCE, SyncCheck, SyncCheckFailed
from tests.helpers import build_inputs, cached_build, make_scored_batch, tiny_learner

pytestmark = pytest.mark.e2e
PROMPTS = ["12+34=", "7*8=", "hello"]
RANK = 4
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTER = SyncCheck("LoRA adapter, float32", TOLERANCE["float32"])


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    from learner.tiny_gpt import init_tiny_llama

    folder = cached_build("tiny-llama", build_inputs(init_tiny_llama, seed=0), lambda out: init_tiny_llama(out, seed=0))
    return str(folder)


@pytest.fixture(scope="module")
def roles(ray_cluster, llama):
    cfg = RolloutConfig(max_model_len=128, max_prompt_tokens=16, sampling=SamplingConfig(max_new_tokens=8))
    pool = RolloutPool(cfg, llama, num_workers=2, seed=0, options=PoolOptions(num_cpus=0, lora_rank=RANK))
    learner = tiny_learner(llama, lr=2e-2, lora=LoraConfig(rank=RANK, alpha=8, target_modules=TARGETS))
    yield pool, learner
    learner.shutdown()
    pool.shutdown()


def train(learner, llama, seed: int) -> None:
    learner.update(*make_scored_batch(llama, seed=seed), step=0)


def close_logprobs(a, b, tol=1e-4):
    return all(len(x) == len(y) and torch.allclose(torch.tensor(x), torch.tensor(y), atol=tol) for x, y in zip(a, b))


def test_the_adapter_alone_reaches_every_engine_which_samples_with_the_newest(roles, llama):
    pool, learner = roles
    channel = WeightChannel(pool, learner, bucket_mb=1, timeout_s=60, check=ADAPTER)
    train(learner, llama, 1)  # PEFT starts B at zero: one update makes the adapter change the model
    before = pool.generate(PROMPTS, step=0, greedy=True)  # the base model: no adapter loaded yet
    assert not close_logprobs(before.logprobs, learner.policy_logprobs(before))
    for version in (1, 2, 3):
        channel.send(version=version)
        assert 0 <= channel.probe_gap < ADAPTER.tolerance / 10  # the check passed, far inside its tolerance
        after = pool.generate(PROMPTS, step=0, greedy=True)
        assert close_logprobs(after.logprobs, learner.policy_logprobs(after))
        assert after.version_first == [version] * len(after)
        train(learner, llama, 10 + version)
    adapter = ray.get(learner.adapter_weights())
    assert channel.sent_bytes == adapter_bytes(adapter) == sum(t.numel() * 4 for t in adapter["tensors"].values())
    # every engine holds one adapter, the newest: the older ones were dropped once nothing sampled with them
    assert [ray.get(w.adapters_loaded.remote()) for w in pool.workers] == [([3], 1)] * 2


def test_a_sync_that_did_not_arrive_fails_naming_the_adapter_path(roles, llama):
    pool, learner = roles
    channel = WeightChannel(pool, learner, bucket_mb=1, timeout_s=60, check=ADAPTER)
    assert channel.sent_bytes != channel.sent_bytes  # NaN: nothing sent yet
    channel.send(version=4, wait=False)  # a background sync (one_step, full): its bytes at once, checked once taken
    assert channel.sent_bytes == channel.adapter_bytes and channel.unchecked is not None
    channel.wait_sent()
    assert channel.unchecked is None and channel.probe_gap < ADAPTER.tolerance / 10
    train(learner, llama, 20)  # the engines keep version 4's adapter (as after a load that never happened)
    with pytest.raises(SyncCheckFailed, match=r"policy version 5 \(LoRA adapter, float32\): engine \d .* nats"):
        channel.verify(version=5)
    channel.send(version=5)  # a real sync repairs it
    assert channel.probe_gap < ADAPTER.tolerance / 10


def test_the_merged_path_sends_the_whole_model(ray_cluster, llama):
    cfg = RolloutConfig(max_model_len=128, max_prompt_tokens=16, sampling=SamplingConfig(max_new_tokens=8))
    pool = RolloutPool(cfg, llama, num_workers=1, seed=0, options=PoolOptions(num_cpus=0))
    lora = LoraConfig(rank=RANK, alpha=8, target_modules=TARGETS, sync=LoraSync.merged)
    learner = tiny_learner(llama, lr=2e-2, lora=lora)
    try:
        train(learner, llama, 1)
        channel = WeightChannel(pool, learner, bucket_mb=1, timeout_s=60, check=SyncCheck("merged", 1e-3))
        channel.send(version=1)
        assert channel.probe_gap < 1e-4
        adapter = ray.get(learner.adapter_weights())
        assert channel.sent_bytes > 20 * adapter_bytes(adapter)  # the whole model, against the adapter
    finally:
        learner.shutdown()
        pool.shutdown()


def test_a_model_vllm_serves_no_lora_for_is_refused_naming_the_key(tiny_model, llama):
    with pytest.raises(ValueError, match="learner.lora.sync adapter: vLLM serves no LoRA adapter for GPT2LMHeadModel"):
        refuse_unservable(tiny_model, ["c_attn"])
    with pytest.raises(ValueError, match=r"linear layers, not on \['lm_head'\]"):
        refuse_unservable(llama, ["q_proj", "lm_head"])
    refuse_unservable(llama, TARGETS)  # served


def test_a_lora_run_sends_only_the_adapter_and_every_sync_passes_the_check(ray_cluster, llama, tmp_path, capsys):
    """`relay train`'s loop on the tiny Llama with LoRA, the adapter sync asked for. A length reward, which
    a random model's samples differ in, so the adapter moves every step and each sync carries a new one."""
    import json
    from pathlib import Path

    from orchestrator.config.load import load_config
    from orchestrator.loop.trainer import Trainer
    from tests.helpers import REPO

    over = {
        "learner.model_path": llama,
        "run_root": str(tmp_path),
        "name": "lora",
        "logging.wandb.mode": "disabled",
        "logging.progress_bar": "false",
        "data.rollout_batch_size": 16,
        "data.eval_size": 16,
        "algorithm.mini_batch_size": 64,
        "algorithm.micro_batch_size": 64,
        "learner.lr": 1e-2,
        "learner.lora.rank": RANK,
        "learner.lora.sync": "adapter",  # auto takes merged on CPU engines
        "learner.lora.target_modules": "[" + ",".join(TARGETS) + "]",
        "reward.sources": "[{kind: length_penalty, target_length: 4, weight: 1.0}]",
        "total_steps": 3,
        "eval.suites": "[]",
    }
    cfg = load_config(REPO / "configs" / "grpo_tiny_cpu.yaml", [f"{k}={v}" for k, v in over.items()])
    trainer = Trainer(cfg)
    try:
        trainer.run()
    finally:
        trainer.shutdown()
    out = capsys.readouterr().out
    assert "relay: LoRA weight sync: the adapter alone" in out
    assert "relay: LoRA reference: the learner's base weights with the adapter disabled" in out
    rows = [json.loads(line) for line in (tmp_path / "lora" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "timing/total" in r]
    model_bytes = (Path(llama) / "model.safetensors").stat().st_size
    assert len(steps) == 3 and all(r["sync/probe_gap"] < ADAPTER.tolerance / 10 for r in steps)
    assert all(0 < r["sync/bytes"] < model_bytes / 20 for r in steps)  # the adapter, not the model
    # the reference is the learner's base, its adapter off (learner.lora.reference learner, the default; the
    # scoring service holds none): at step 1 the policy is its base (peft starts B at 0), then the adapter moves
    # it away; were the adapter left on in the reference's forward, the KL would stay exactly 0
    assert steps[0]["kl/ref"] < 1e-6 and steps[-1]["kl/ref"] > 0.01  # 0.07 seen
    assert all(r["learner/reference_s"] > 0 for r in steps)  # the learner's forward, inside timing/advantages
    after = json.loads((tmp_path / "lora" / "eval_after.json").read_text())
    assert after["eval/sampled/kl_ref"] > 0.001  # held out too, from the learner's base
    assert all(r["rollout/logprob_gap"] < 1e-3 for r in steps)  # and the engines sampled with it
