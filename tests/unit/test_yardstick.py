"""scripts/yardstick.py's plain loop computes what relay computes: its logprobs of the response tokens are the
reference model's on the same batch (the GPU figures compare like with like), and its update does relay's work."""

import torch
from transformers import AutoModelForCausalLM

from reward_service.reference import ReferenceModel
from scripts.yardstick import SMALL, build_model, plain_logprobs, plain_reference, variable_batch


def test_the_plain_loops_logprobs_are_the_reference_models(tmp_path):
    path = build_model(tmp_path, quick=True)
    batch, _ = variable_batch(8, 4, SMALL["vocab_size"], quick=True)
    assert len({len(r) for r in batch.response_ids}) > 3 and len({len(p) for p in batch.prompt_ids}) > 1  # varied
    want = ReferenceModel(path, micro_batch_size=4).logprobs(batch)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    rows = [[0, 1, 2, 3], [4, 5, 6, 7]]
    got = []
    for r, logprobs in zip(rows, plain_reference(model, batch, rows, torch.device("cpu"))):
        _, mask = plain_logprobs(model, batch, r, torch.device("cpu"))
        got += logprobs[mask > 0].tolist()
    flat = [v for row in want for v in row]
    assert len(got) == len(flat) and max(abs(a - b) for a, b in zip(got, flat)) < 1e-5


def test_the_plain_update_makes_the_old_logprob_forward_only_when_told(tmp_path):
    from learner.algorithms import grpo_advantages
    from scripts.yardstick import plain_update

    path = build_model(tmp_path, quick=True)
    batch, scored = variable_batch(8, 4, SMALL["vocab_size"], quick=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).train()
    grads = []
    model.get_decoder().register_forward_pre_hook(lambda m, a: grads.append(torch.is_grad_enabled()))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    advantages = grpo_advantages(torch.tensor(scored.rewards), 4)
    before = [p.detach().clone() for p in model.parameters()]
    plain_update(model, optimizer, batch, advantages, micro=4, old_forward=False)
    assert grads == [True, True]  # one forward (and backward) per micro-batch, as relay's single pass
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters()))  # and it stepped
    grads.clear()
    plain_update(model, optimizer, batch, advantages, micro=4, old_forward=True)
    assert grads == [False, False, True, True]
