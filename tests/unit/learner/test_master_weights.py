"""learner.precision master_weights: bf16 weights and activations, float32 master weights and Adam state in
DeepSpeed's bf16 optimizer (learner.engine.make_engine, ZeRO >= 2). The masters take updates below a bf16 weight's
rounding step, which bf16 weights alone would lose; every ZeRO stage's step equals a hand-made float32 master step
(gradients accumulated in float32, clipped, AdamW); a checkpoint restores the masters, not their bf16 rounding; and
the reference computes the policy's bf16 function exactly. Real DeepSpeed engines, one gloo rank in this process."""

import copy

import pytest
import torch

from learner.checkpoint import check_layout, layout
from learner.config import Dtype, LearnerConfig, Precision
from learner.engine import make_engine, zero_stage
from learner.experience import ragged_to_dense
from learner.models import build_policy, scalar_head
from learner.precision import bucket_elements, policy_function
from learner.tiny_gpt import init_tiny_llama
from orchestrator.tools.plan_roles import reduce_bucket_lines
from reward_service.reference import ReferenceModel
from rollout.types import pack
from runtime.forward import PolicyFunction
from runtime.logprobs import chunked_logprobs
from tests.helpers import make_scored_batch


def master_cfg(zero: int = 0, **over) -> LearnerConfig:
    cfg = LearnerConfig(**{"model_path": "unused", "zero_stage": zero, "dtype": Dtype.bfloat16, **over})
    cfg.precision = Precision.master_weights
    return cfg


def masters(engine) -> torch.Tensor:
    """The optimizer's own float32 weights, flat, in the module's parameter order (one rank: whole)."""
    zero3 = getattr(engine.optimizer, "fp32_partitioned_groups_flat", None)  # ZeRO-3 hands them over per step
    groups = zero3 if zero3 is not None else [p for g in engine.optimizer.optimizer.param_groups for p in g["params"]]
    flat = torch.cat([p.detach().flatten() for p in groups])
    assert flat.dtype == torch.float32
    return flat


def weights(engine) -> torch.Tensor:
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return torch.cat([p.detach().flatten().clone() for p in params])


@pytest.mark.parametrize("zero", [0, 3])
def test_updates_below_a_bf16_step_accumulate_in_the_float32_masters(one_rank, zero):
    """1.0's bf16 neighbour below is 1 - 2**-8: an AdamW step of lr 2e-4 rounds back to 1.0 in bf16 weights
    alone, for ever; the masters take every step and the bf16 weights follow once they cross the midpoint."""
    lr, steps = 2e-4, 12
    module = torch.nn.Linear(4, 1, bias=False)
    torch.nn.init.ones_(module.weight)
    plain = copy.deepcopy(module).to(torch.bfloat16)  # bf16 weights, no masters
    plain_adam = torch.optim.AdamW(plain.parameters(), lr=lr, weight_decay=0.0)
    engine = make_engine(module, master_cfg(zero, grad_clip=0.0), lr, 1, 1)
    assert zero_stage(master_cfg(zero)) == max(zero, 2) and next(engine.module.parameters()).dtype == torch.bfloat16
    x = torch.ones(1, 4, dtype=torch.bfloat16)
    for _ in range(steps):
        engine.set_gradient_accumulation_boundary(True)
        engine.backward(engine(x).float().sum())  # gradient +1 on every weight: each step moves it by -lr
        engine.step()
        plain_adam.zero_grad()
        plain(x).float().sum().backward()
        plain_adam.step()
    assert torch.equal(plain.weight, torch.ones_like(plain.weight))  # bf16 alone: every step lost
    assert masters(engine)[:4] == pytest.approx([1 - steps * lr] * 4, abs=1e-6)  # the masters: every step kept
    assert torch.equal(weights(engine)[:4], torch.full((4,), 1 - 2**-8, dtype=torch.bfloat16))  # and sent on


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_each_zero_stage_steps_as_float32_masters_with_float32_gradient_sums(one_rank, zero):
    """Two optimizer steps of two micro-batches each, clipped (norm ~1.8 > 0.5): the masters equal float32
    AdamW on the bf16 micro-batch gradients summed in float32 and clipped by their norm."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)).to(torch.bfloat16)
    xs = [torch.randn(2, 8, dtype=torch.bfloat16) for _ in range(4)]
    ref, norms = reference_steps(copy.deepcopy(module), xs, clip=0.5, lr=1e-3)
    engine = make_engine(module, master_cfg(zero, grad_clip=0.5), 1e-3, 2, 2)
    for j, x in enumerate(xs):
        engine.set_gradient_accumulation_boundary(j % 2 == 1)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()
        if j % 2 == 1:
            assert float(engine.get_global_grad_norm()) == pytest.approx(norms[j // 2], rel=2e-3)
    torch.testing.assert_close(masters(engine)[: ref.numel()], ref, atol=2e-7, rtol=0)
    assert torch.equal(weights(engine), ref.to(torch.bfloat16))  # the bf16 weights are the masters rounded


def reference_steps(module, xs, clip: float, lr: float):
    """float32 AdamW on float32 masters of the bf16 `module`, each step's two micro-batch gradients (each of the
    mean loss / 2, as DeepSpeed scales it) summed in float32 and clipped; the flat masters and the norms."""
    params = list(module.parameters())
    master = [p.detach().float().clone() for p in params]
    adam, norms = torch.optim.AdamW(master, lr=lr, weight_decay=0.0), []  # learner.weight_decay 0
    for i in range(0, len(xs), 2):
        sums = [torch.zeros_like(m) for m in master]
        for x in xs[i : i + 2]:
            module.zero_grad()
            (module(x).float().pow(2).mean() / 2).backward()
            for s, p in zip(sums, params):
                s += p.grad.float()
        for m, s in zip(master, sums):
            m.grad = s
        norms.append(float(torch.nn.utils.clip_grad_norm_(master, clip)))
        adam.step()
        with torch.no_grad():
            for p, m in zip(params, master):
                p.copy_(m)  # the next step's gradients come from the masters' bf16 rounding
    return torch.cat([m.detach().flatten() for m in master]), norms


def test_a_checkpoint_restores_the_masters_not_their_bf16_rounding(one_rank, tmp_path):
    torch.manual_seed(1)
    module = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    twin = copy.deepcopy(module)
    xs = [torch.randn(2, 8, dtype=torch.bfloat16) for _ in range(4)]

    def step(engine, x):
        engine.set_gradient_accumulation_boundary(True)
        engine.backward(engine(x).float().pow(2).mean())
        engine.step()

    first = make_engine(module, master_cfg(warmup_steps=4), 1e-3, 2, 1)
    for x in xs[:3]:
        step(first, x)
    first.save_checkpoint(str(tmp_path), tag="state")
    resumed = make_engine(twin, master_cfg(warmup_steps=4), 1e-3, 2, 1)
    resumed.load_checkpoint(str(tmp_path), tag="state", load_optimizer_states=True, load_lr_scheduler_states=True)
    assert torch.equal(masters(resumed), masters(first))
    assert not torch.equal(masters(first), weights(first).float())  # the masters hold more than the bf16 weights
    step(first, xs[3]), step(resumed, xs[3])
    assert torch.equal(masters(resumed), masters(first)) and torch.equal(weights(resumed), weights(first))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return str(init_tiny_llama(tmp_path_factory.mktemp("llama"), seed=4))


@pytest.mark.parametrize("arch", ["gpt2", "llama", "gpt2_keeping_ln_f_float32"])
def test_the_learner_computes_in_bf16_weights_and_the_reference_computes_the_same(
    one_rank, tiny_model, tiny_llama, arch, monkeypatch, tmp_path
):
    """Through the learner's DeepSpeed engine: every parameter bf16, every buffer as transformers keeps it. A
    Llama's RoPE frequencies stay float32 (cast with the module, they moved the learner's logprobs 0.46 nats away
    from the reference's on SmolLM2: a KL of 0.002 per token at step 1); a parameter transformers keeps float32
    (_keep_in_fp32_modules_strict) is bf16 on both sides."""
    path = tiny_llama if arch == "llama" else tiny_model
    if arch == "gpt2_keeping_ln_f_float32":
        from transformers import AutoModelForCausalLM, AutoTokenizer, GPT2LMHeadModel

        model = AutoModelForCausalLM.from_pretrained(tiny_model)
        with torch.no_grad():  # weights bf16 does not hold (a new model's are 1 and 0)
            model.transformer.ln_f.weight.add_(0.01 * torch.randn(model.config.n_embd))
        path = tmp_path / "ln_f"
        model.save_pretrained(path), AutoTokenizer.from_pretrained(tiny_model).save_pretrained(path)
        monkeypatch.setattr(GPT2LMHeadModel, "_keep_in_fp32_modules_strict", ["ln_f"], raising=False)
    cfg = master_cfg(model_path=path)
    policy = build_policy(cfg, value_head=True)
    kept = arch == "gpt2_keeping_ln_f_float32"
    assert ({p.dtype for p in policy.lm.parameters()} == {torch.bfloat16}) != kept  # loaded in bf16, but ln_f
    buffers = {n: b.dtype for n, b in policy.named_buffers()}
    engine = make_engine(policy, cfg, 1e-3, 8, 1)
    assert {p.dtype for p in engine.module.parameters()} == {torch.bfloat16}  # the value head too
    assert {n: b.dtype for n, b in engine.module.named_buffers()} == buffers
    if arch == "llama":
        assert torch.float32 in buffers.values()  # what the test is about: RoPE's inv_freq
    batch, _ = make_scored_batch(tiny_model, n_prompts=4, group=2, seed=3)
    ids, attention, positions, mask = pack(batch.prompt_ids, batch.response_ids, 0)
    with torch.no_grad():
        logits, values = engine(ids, attention, positions)
    assert logits.dtype == torch.bfloat16 and values.dtype == torch.float32  # the value head's output upcast
    own = chunked_logprobs(logits, ids[:, 1:], 1.0) * mask
    function = policy_function(cfg)
    assert function.weights == "bfloat16"
    ref = ragged_to_dense(ReferenceModel(path, function).logprobs(batch), mask)
    assert torch.equal(ref, own)  # the KL starts at exactly 0
    autocast = ragged_to_dense(ReferenceModel(path, PolicyFunction("bfloat16")).logprobs(batch), mask)
    gap = (autocast - ref).abs()[mask > 0]
    assert 0 < gap.mean() < 5e-3  # autocast over float32 weights: another function, near (test_mixed_precision)


def test_a_resume_in_another_precision_fails_naming_the_keys_to_resume_with(tmp_path):
    """DeepSpeed lays its state out by weight dtype and ZeRO stage: learner.json records both, and a resume that
    would run otherwise fails before DeepSpeed reads anything, saying how to resume."""
    autocast = LearnerConfig(model_path="unused")
    assert layout(autocast) == {"weights": "float32", "zero_stage": 0}
    assert layout(master_cfg(1)) == {"weights": "bfloat16", "zero_stage": 2}
    check_layout(tmp_path, {}, autocast)  # a checkpoint from before the layout was kept: float32 weights
    check_layout(tmp_path, layout(master_cfg(0)), master_cfg(2))  # zero_stage 0 and 2 run the same under masters
    with pytest.raises(ValueError, match="resume with learner.precision=autocast and learner.zero_stage=0"):
        check_layout(tmp_path, {}, master_cfg())
    with pytest.raises(ValueError, match=f"{tmp_path}: saved with bfloat16 weights at ZeRO 2.*precision=master_"):
        check_layout(tmp_path, layout(master_cfg()), autocast)


def two_rank_step(rank: int, port: int, zero: int, out) -> None:
    """One master-weights step of rank `rank` of 2 on its own micro-batch; rank 0 puts the engine's gradient norm
    and a float32 sum's (of both ranks' bf16 gradients, averaged as DeepSpeed averages over ranks)."""
    from learner.engine import RankAddress, init_distributed

    init_distributed(RankAddress(rank, 2, "127.0.0.1", port, threads=1), "gloo")
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 1)).to(torch.bfloat16)
    xs = [torch.randn(4, 256, dtype=torch.bfloat16) for _ in range(2)]
    twin, sums = copy.deepcopy(module), None
    for x in xs:
        twin.zero_grad()
        twin(x).float().pow(2).mean().backward()
        grads = torch.cat([p.grad.float().flatten() / 2 for p in twin.parameters()])
        sums = grads if sums is None else sums + grads
    engine = make_engine(module, master_cfg(zero, grad_clip=0.0), 1e-3, 4, 1)
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(engine(xs[rank]).float().pow(2).mean())
    engine.step()
    if rank == 0:
        out.put((float(engine.get_global_grad_norm()), float(sums.norm())))


@pytest.mark.parametrize("zero", [2, 3])
def test_two_ranks_sum_their_bf16_gradients_in_float32(zero):
    """Across ranks too: DeepSpeed reduces in the model's dtype unless told (communication_data_type fp32); in
    bf16 the two-rank norm was 1.8e-4 off the float32 sum, in float32 it is 9e-8 off."""
    import torch.multiprocessing as mp

    from runtime.ports import free_port

    ctx, port = mp.get_context("spawn"), free_port()
    out = ctx.Queue()
    ranks = [ctx.Process(target=two_rank_step, args=(r, port, zero, out)) for r in range(2)]
    for p in ranks:
        p.start()
    try:
        got, want = out.get(timeout=600)  # a hang guard only
    finally:
        for p in ranks:
            p.join(timeout=60)
    assert got == pytest.approx(want, rel=2e-6)  # ZeRO 3 sums its partitions' norms: 8.6e-7 off


def test_a_bf16_value_head_computes_in_float32():
    torch.manual_seed(2)
    head = torch.nn.Linear(16, 1).to(torch.bfloat16)
    states = (torch.randn(2, 5, 16) * 4).to(torch.bfloat16)
    got = scalar_head(head, states)
    want = torch.nn.functional.linear(states.float(), head.weight.float(), head.bias.float()).squeeze(-1)
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert not torch.equal(got, head(states).float().squeeze(-1))  # in bf16 the values round
    got.sum().backward()
    assert head.weight.grad is not None and head.weight.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_adamw_is_fused_where_the_rank_computes_on_cuda(one_rank, monkeypatch, device):
    """The rank's device decides (runtime.device.process_device), not the module's: it is still on the CPU when
    the optimizer is built (DeepSpeed moves it in initialize). torch's fused AdamW also runs on a CPU here."""
    import learner.engine as E

    monkeypatch.setattr(E, "process_device", lambda: torch.device(device))
    engine = make_engine(torch.nn.Linear(8, 1), LearnerConfig(model_path="unused"), 1e-3, 2, 1)
    assert bool(engine.optimizer.defaults["fused"]) == (device == "cuda")


@pytest.mark.parametrize("zero", [2, 3])
def test_zero_buckets_hold_the_trained_parameters_as_relay_plan_counts(one_rank, zero):
    """A frozen trunk (LoRA's case) is never bucketed: DeepSpeed's buckets are sized by the trained parameters,
    bucket_elements(trained) as `relay plan` counts them, not by the module or DeepSpeed's 5e8 elements."""
    module = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1))
    module[0].requires_grad_(False)
    engine = make_engine(module, master_cfg(zero), 1e-3, 2, 1)
    assert engine.zero_reduce_bucket_size() == bucket_elements(65) == 72  # 64 + 1 trained, rounded up to 8
    lines = dict((what, b) for what, b, _ in reduce_bucket_lines(65, True, zero, "policy"))
    assert lines["policy reduce bucket"] == 72 * (2 if zero == 2 else 4)  # bf16 at ZeRO 2, float32 at ZeRO 3
