"""A LoRA policy reaches colocated engines over IPC: what an engine opens from the learner's handles,
after the sender has returned, is W + BA, not W; and the frozen base W is never written, so many syncs
leave it bit for bit as it was. The sender's own path (WeightSender.send_weights: merged_weights,
wire_tensors, ipc_update_info) on CPU, where a handle rebuilds on this
process's memory as vLLM's IPC engine rebuilds a CUDA handle on the learner's GPU memory."""

import pytest
import torch
from peft.tuners.lora import LoraLayer
from torch.multiprocessing.reductions import rebuild_tensor

from learner.config import Dtype, LearnerConfig
from learner.lora_config import LoraConfig
from learner.models import build_policy, rollout_weights
from learner.weight_sender import WeightSender
from rollout.weight_sync import IPC_BACKEND, encode_plan


class Rank(WeightSender):
    """A learner rank as WeightSender reads it: rank, device, cfg and policy."""

    def __init__(self, cfg: LearnerConfig):
        self.rank, self.device, self.cfg = 0, torch.device("cpu"), cfg
        self.policy = build_policy(cfg, value_head=False)
        self._init_sender()
        self.sync_backend = IPC_BACKEND  # init_weight_sync's for colocated GPU engines (it refuses a CPU rank)


def engine_reads(rank: Rank) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A sync's update_info opened as the engine opens it, once the sender has returned: each handle
    rebuilt; and the sender's kept tensors the handles point into, by name."""
    info = rank.send_weights(encode_plan(rank.weight_buckets(bucket_mb=1)))
    handles = zip(info["names"], info["ipc_handles"])
    return {n: rebuild_tensor(*h["cpu"]).clone() for n, h in handles}, dict(zip(info["names"], rank._ipc_kept))


@pytest.mark.parametrize("dtype", [Dtype.float32, Dtype.bfloat16])
def test_the_engines_read_the_merged_lora_weights_and_the_base_stays_exact(tiny_model, dtype):
    wire = getattr(torch, dtype.value)
    rank = Rank(LearnerConfig(model_path=tiny_model, dtype=dtype, lora=LoraConfig(rank=4, target_modules=["c_attn"])))
    torch.manual_seed(0)
    with torch.no_grad():  # a trained adapter: peft starts B at 0, where W + BA = W
        for name, p in rank.policy.lm.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.5)
    base = {n: t.detach().clone() for n, t in rollout_weights(rank.policy)}
    with torch.no_grad():  # W + BA, as peft's merge adds it (scaled, in Hugging Face layout)
        lora = [(n.removeprefix("base_model.model."), m) for n, m in rank.policy.lm.named_modules()]
        deltas = {f"{n}.weight": m.get_delta_weight("default") for n, m in lora if isinstance(m, LoraLayer)}
    want = {n: (base[n] + deltas[n] if n in deltas else base[n]).to(wire) for n in base}
    adapted = {n for n in want if not torch.equal(want[n], base[n].to(wire))}
    assert adapted == {f"transformer.h.{i}.attn.c_attn.weight" for i in range(2)}  # the example tells W from W+BA

    got, kept = engine_reads(rank)
    assert set(got) == set(want)
    wrong = [n for n in want if not torch.equal(got[n], want[n])]
    assert not wrong, f"the engines would load {wrong} without the adapter"
    for _ in range(20):  # merging in place and unmerging (peft's merge_adapter) rounds W at each sync
        engine_reads(rank)
    live = dict(rollout_weights(rank.policy))
    drifted = [n for n in base if not torch.equal(live[n], base[n])]
    assert not drifted, f"the frozen base changed under the syncs: {drifted}"
    # an adapted weight travels as the merge's own copy: the rest is the live parameter (float32) or the cast
    aliases = {n for n in want if kept[n].untyped_storage().data_ptr() == live[n].untyped_storage().data_ptr()}
    assert aliases == (set(want) - adapted if dtype == Dtype.float32 else set())
