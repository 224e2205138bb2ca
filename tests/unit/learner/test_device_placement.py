"""Every input a model computes on reaches it through runtime.device.to_device, the one place a
process moves tensors to its device. On a CPU a missing `.to(device)` cannot fail by accident, so
these tests make it fail: to_device is replaced by a spy that records what it returned, and each
model records what it was called with; an input that skipped the transfer is not in the record."""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from transformers import GPT2Config, GPT2ForSequenceClassification

from learner import experience as experience_module
from learner import worker as worker_module
from learner.config import AlgorithmConfig, LearnerConfig
from learner.experience import ForwardSettings, make_experience
from learner.models import build_policy
from learner.worker import Learner
from reward_service import reference as reference_module
from reward_service import sources as sources_module
from reward_service.config import RewardSource, SourceKind
from reward_service.reference import ReferenceModel
from runtime import device as device_module
from runtime.logprobs import SamplerSettings
from tests.helpers import make_scored_batch


class Spy:
    """to_device that returns fresh copies and remembers them: a tensor the model receives that is
    not one of these skipped the transfer, even where the transfer itself would be a no-op."""

    def __init__(self):
        self.moved: set[int] = set()

    def __call__(self, tensors, device):
        return self._fresh(device_module.to_device(tensors, device))

    def _fresh(self, x):
        if isinstance(x, torch.Tensor):
            copy = x.clone()
            self.moved.add(id(copy))
            return copy
        if isinstance(x, dict):
            return {k: self._fresh(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return type(x)(self._fresh(v) for v in x)
        return x

    def check(self, *args, **kwargs):
        stray = [tuple(t.shape) for t in _tensors((args, kwargs)) if id(t) not in self.moved]
        assert not stray, f"inputs that never went through to_device: {stray}"


def _tensors(x):
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    return []


def checked(module: torch.nn.Module, spy: Spy) -> torch.nn.Module:
    module.register_forward_pre_hook(lambda m, args, kwargs: spy.check(*args, **kwargs), with_kwargs=True)
    return module


def test_backend_follows_the_device_and_outside_ray_the_environment_decides(monkeypatch):
    import ray

    assert device_module.collective_backend(torch.device("cuda", 0)) == "nccl"
    assert device_module.collective_backend(torch.device("cpu")) == "gloo"
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.delenv("RELAY_DEVICE", raising=False)
    assert device_module.process_device() == torch.device("cpu")
    monkeypatch.setenv("RELAY_DEVICE", "meta")
    assert device_module.process_device() == torch.device("meta")
    moved = device_module.to_device({"a": torch.ones(2), "b": [torch.zeros(1), 3]}, torch.device("meta"))
    assert moved["a"].device.type == "meta" and moved["b"][0].device.type == "meta" and moved["b"][1] == 3


@pytest.fixture()
def spy(monkeypatch):
    s = Spy()
    for module in (experience_module, worker_module, reference_module, sources_module):
        monkeypatch.setattr(module, "to_device", s)
    return s


def test_the_learner_moves_every_batch_it_computes_on(tiny_model, spy):
    batch, scored = make_scored_batch(tiny_model, seed=3)
    policy = checked(build_policy(LearnerConfig(model_path=tiny_model), value_head=False), spy)
    algo = AlgorithmConfig(micro_batch_size=4, mini_batch_size=8)
    sampling = SamplerSettings(n_samples_per_prompt=4, top_p=0.9)
    exp = make_experience(
        policy, None, batch, scored, algo, 0.01, ForwardSettings(sampling, 0, 4, 0, 1, 16, torch.device("cpu"))
    )

    class Engine(torch.nn.Module):  # DeepSpeed's engine, as far as the learner uses it
        def __init__(self):
            super().__init__()
            self.module = policy

        def forward(self, *args):
            return self.module(*args)

        def backward(self, loss):
            loss.backward()

        def step(self):
            pass

        def set_gradient_accumulation_boundary(self, last: bool):  # engine.step_micro_batches sets it
            pass

    rank = SimpleNamespace(
        policy=policy,
        policy_engine=Engine(),
        critic_engine=None,
        algo=algo,
        rank=0,
        world=1,
        grad_accum=1,
        device=torch.device("cpu"),
        kl_ctl=SimpleNamespace(value=0.01),
        temperature=1.0,
        cfg=SimpleNamespace(logprob_chunk_tokens=16, packing=True, packing_row_tokens=0),
    )
    rank.sampling = sampling
    rank._policy_loss = lambda mb, total, agg, fill=None, idx=None: Learner._policy_loss(
        rank, mb, total, agg, fill, idx
    )
    rank._fill_old = lambda *args: Learner._fill_old(rank, *args)
    for one_pass in (False, True):  # old logprobs recomputed, or taken from this forward (experience.single_pass)
        sums = defaultdict(float)
        Learner._train_mini_batch(rank, exp, torch.arange(8), sums, one_pass)
        assert sums["loss/policy"] == sums["loss/policy"]  # ran, and was finite


def test_the_scoring_models_get_their_inputs_on_their_device(tiny_model, spy, tmp_path):
    batch, _ = make_scored_batch(tiny_model, seed=4)
    ref = ReferenceModel(tiny_model, micro_batch_size=5)
    checked(ref.model, spy)
    assert [len(x) for x in ref.logprobs(batch)] == [len(r) for r in batch.response_ids]
    from learner.tiny_gpt import char_tokenizer

    tok = char_tokenizer()
    rm_path = tmp_path / "rm"
    GPT2ForSequenceClassification(
        GPT2Config(
            vocab_size=len(tok),
            n_positions=64,
            n_embd=32,
            n_layer=1,
            n_head=2,
            num_labels=1,
            pad_token_id=tok.pad_token_id,
        )
    ).save_pretrained(rm_path)
    tok.save_pretrained(rm_path)
    rm = sources_module.build_source(RewardSource(kind=SourceKind.reward_model, model_path=str(rm_path)), 2)
    checked(rm.model, spy)
    assert len(rm.score(["1+1=", "2+2=", "3+3="], ["2", "4", "6"], [{}] * 3)) == 3
