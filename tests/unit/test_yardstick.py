"""scripts/yardstick.py's plain loop computes what relay computes: its packed rows mask exactly the response
tokens, and its logprobs are the reference model's on the same batch (the GPU figures compare like with like)."""

import torch
from transformers import AutoModelForCausalLM

from reward_service.reference import ReferenceModel
from scripts.yardstick import SMALL, build_model, packed_row, plain_reference, variable_batch


def test_a_packed_row_masks_the_response_tokens_and_no_cross_sequence_target():
    from rollout.types import RolloutBatch

    batch = RolloutBatch([0, 1], [[5, 6], [7]], [[8], [9, 10]], [[0.0], [0.0, 0.0]], ["x", "y"], ["stop"] * 2)
    ids, pos, mask = packed_row(batch, [0, 1], torch.device("cpu"))
    assert ids.tolist() == [[5, 6, 8, 7, 9, 10]] and pos.tolist() == [[0, 1, 2, 0, 1, 2]]
    # targets 6, 8, 7, 9, 10: the response tokens 8, 9, 10; 7 is the next sequence's prompt
    assert mask.tolist() == [[0.0, 1.0, 0.0, 1.0, 1.0]]


def test_the_plain_loops_logprobs_are_the_reference_models(tmp_path):
    path = build_model(tmp_path, quick=True)
    batch, _ = variable_batch(8, 4, SMALL["vocab_size"], quick=True)
    assert len({len(r) for r in batch.response_ids}) > 3 and len({len(p) for p in batch.prompt_ids}) > 1  # varied
    want = ReferenceModel(path, micro_batch_size=4).logprobs(batch)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    rows = [[0, 1, 2, 3], [4, 5, 6, 7]]
    got = []
    for r, logprobs in zip(rows, plain_reference(model, batch, rows, torch.device("cpu"))):
        _, _, mask = packed_row(batch, r, torch.device("cpu"))
        got += logprobs[mask > 0].tolist()
    flat = [v for row in want for v in row]
    assert len(got) == len(flat) and max(abs(a - b) for a, b in zip(got, flat)) < 1e-5
