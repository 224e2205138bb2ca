"""The NaN guard holds for every optimizer x ZeRO stage x bf16 precision (float32 weights, or bf16 weights with
float32 masters in DeepSpeed's bf16 optimizer: learner.precision): a step on non-finite gradients changes no weight
and no optimizer moment, nor moves the lr schedule (warmup), and is counted once (engine.skipped_steps,
what learner/skipped_steps reports); a finite step still trains. Real DeepSpeed engines (make_engine), one
gloo rank in this process."""

import pytest
import torch

from learner.config import Dtype, LearnerConfig, OptimizerKind, Precision
from learner.engine import make_engine, skipped_steps


def weights(engine) -> list[torch.Tensor]:
    """Every weight, whole (ZeRO-3 partitions them: gathered to read)."""
    import deepspeed

    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return [p.detach().clone() for p in params]


def step(engine, x: torch.Tensor) -> None:
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(engine(x).square().sum())
    engine.step()


# master weights run ZeRO 2 at least (learner.precision.zero_stage): their zero_stage 0 and 1 are the stage-2 case
CASES = [
    (z, p)
    for p in (Precision.autocast, Precision.master_weights)
    for z in range(4)
    if p == Precision.autocast or z >= 2
]


@pytest.mark.parametrize("zero, precision", CASES)
@pytest.mark.parametrize("optimizer", list(OptimizerKind))
def test_a_nonfinite_step_is_skipped_and_counted(one_rank, optimizer, zero, precision):
    torch.manual_seed(0)
    dtype = Dtype.bfloat16 if precision == Precision.master_weights else Dtype.float32
    cfg = LearnerConfig(model_path="unused", zero_stage=zero, optimizer=optimizer, warmup_steps=10, dtype=dtype)
    cfg.precision = precision
    engine = make_engine(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)), cfg, 1e-2, 2, 1)
    x = torch.randn(2, 8).to(next(engine.module.parameters()).dtype)
    before = weights(engine)
    step(engine, x)
    trained = weights(engine)
    assert all(torch.isfinite(w).all() for w in trained) and any(not torch.equal(a, b) for a, b in zip(before, trained))
    assert skipped_steps(engine) == 0
    state = {k: v.clone() for k, v in str_state(engine).items()}
    lr = engine.get_lr()
    step(engine, x.clone().fill_(float("nan")))
    assert skipped_steps(engine) == 1, f"{optimizer.value} at ZeRO {zero}: the NaN step was not counted once"
    assert engine.get_lr() == lr, f"{optimizer.value} at ZeRO {zero}: the skipped step moved the warmup"
    after = weights(engine)
    assert all(torch.equal(a, b) for a, b in zip(trained, after)), f"{optimizer.value} at ZeRO {zero} applied NaN"
    assert all(torch.equal(v, str_state(engine)[k]) for k, v in state.items())  # nor moved Adam's moments
    step(engine, x)  # and the next finite batch trains again, one warmup step further
    assert skipped_steps(engine) == 1 and any(not torch.equal(a, b) for a, b in zip(after, weights(engine)))
    assert engine.get_lr() == pytest.approx(
        [lr[0] * 3 / 2]
    )  # warmup 10: 2/10 after the first step, 3/10 after this one


def str_state(engine) -> dict[str, torch.Tensor]:
    """The optimizer's moments by a flat key (whatever optimizer ZeRO wraps)."""
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    return {f"{i}.{k}": v for i, s in enumerate(inner.state.values()) for k, v in s.items() if torch.is_tensor(v)}


def test_deepspeed_builds_no_shared_memory_all_reduce(one_rank):
    """init_distributed turns off DeepSpeed's shared-memory all-reduce: only its inference engine calls it, and on
    a CPU it is a C++ extension compiled at the first rank's start in every environment (learner/engine.py)."""
    import deepspeed
    import deepspeed.comm.comm as ds_comm

    from learner.engine import SHM_COMM_OP

    assert ds_comm.cdb is not None and ds_comm.cdb.is_initialized()
    assert ds_comm.cdb.shm_comm_op is None  # built and loaded when the op is compatible: 50 s of CPU on a Xeon with AMX
    assert deepspeed.ops.__compatible_ops__[SHM_COMM_OP] is False
