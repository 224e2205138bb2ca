"""Multi-turn episodes in the update: observation tokens (action mask 0) are in the sequence the
model reads but get no gradient, no KL and no advantage; the model's own tokens around them do."""

import pytest
import torch

from learner.config import AlgorithmConfig, KLPlacement, LearnerConfig, PolicyLoss
from learner.experience import ForwardSettings, make_experience
from learner.micro_batch_loss import LossSettings, policy_loss
from learner.models import build_policy
from reward_service.types import ScoredBatch
from rollout.types import RolloutBatch
from runtime.logprobs import SamplerSettings


@pytest.mark.parametrize("loss", list(PolicyLoss))
def test_observation_tokens_get_no_gradient_no_kl_and_no_advantage(tiny_model, loss):
    policy = build_policy(LearnerConfig(model_path=tiny_model), value_head=False)
    # prompt of 2 tokens; sample 0: model 2, observation 2, model 1; sample 1: model 2
    batch = RolloutBatch(
        [0, 0],
        [[5, 6], [5, 6]],
        [[7, 8, 9, 10, 11], [7, 12]],
        [[-1.0] * 5, [-1.0] * 2],
        ["a", "b"],
        ["stop", "stop"],
        action_mask=[[1, 1, 0, 0, 1], [1, 1]],
    )
    scored = ScoredBatch([1.0, 0.0], {}, [True, True], [False, False], [[-2.0] * 5, [-2.0] * 2], raw=[1.0, 0.0])
    algo = AlgorithmConfig(kl_placement=KLPlacement.loss, init_kl_coef=0.1, policy_loss=loss)
    exp = make_experience(
        policy,
        None,
        batch,
        scored,
        algo,
        0.1,
        ForwardSettings(SamplerSettings(n_samples_per_prompt=2), pad_id=0, micro=2, rank=0, world=1),
    )
    # targets input_ids[:, 1:]: column j is token j + 1; the response starts at column 1
    assert exp.mask.tolist() == [[0, 1, 1, 0, 0, 1], [0, 1, 1, 0, 0, 0]]
    assert torch.all(exp.advantages[0, 3:5] == 0) and torch.all(exp.advantages[0, [1, 2, 5]] != 0)
    mb = exp.rows(torch.arange(2))
    logits, _ = policy(mb.input_ids, mb.attention_mask, mb.position_ids)
    logits.retain_grad()
    total = float(mb.mask.sum())
    loss_value, terms = policy_loss(logits, mb, algo, 0.1, LossSettings(1.0, 1024, total, "token_mean"))
    loss_value.backward()
    grad = logits.grad.abs().sum(-1)  # (B, L-1): what each target position contributes
    assert torch.all(grad[0, 3:5] == 0) and torch.all(grad[0, [1, 2, 5]] > 0)  # observations: nothing
    assert torch.all(grad[1, 3:] == 0) and torch.all(grad[1, 1:3] > 0)
    assert terms["kl"] > 0  # the KL term exists, over the model's tokens only (it sums to the masked mean)
