"""The builder of builtin://tiny-addition-gpt, the README default run's starting policy. The tests start from a
copy built once (tests/assets: the builder's result depends on the CPU), so this is the builder's own test."""

import hashlib
import json

from orchestrator.data.builtin_models import VERSIONS, build_tiny_policy, tiny_policy_data
from tests.helpers import ASSETS


def test_the_tests_copy_is_of_todays_version_and_was_trained_and_stopped_on_todays_data():
    """The copy stays the tests' starting policy until the builder's version or its data change: then a held-out
    prompt could be one the copy trained on. Rebuild it and redraw the gate's bands (tests/assets/README.md)."""
    built = json.loads((ASSETS / "tiny-addition-gpt.json").read_text())
    data = hashlib.sha256(json.dumps(tiny_policy_data("addition_2digit", 0), sort_keys=True).encode()).hexdigest()
    assert (built["version"], built["data_sha256"]) == (VERSIONS["tiny-addition-gpt"], data), (
        "tests/assets/tiny-addition-gpt is stale: rebuild it and redraw tests/metric_bands (tests/assets/README.md)"
    )


def test_the_starting_policy_trains_until_its_probe_reaches_the_target_and_reports_its_held_out_accuracy(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from learner.sft import greedy_accuracy

    out = build_tiny_policy(tmp_path / "policy")
    summary = json.loads((out / "relay_sft.json").read_text())
    # stopped by the probe at one of its checks (every 100 steps), before the 2,000-step cap
    assert summary["steps"] % 100 == 0 and summary["steps"] < 2000, summary
    assert not (tmp_path / "policy.tmp").exists()
    model, tokenizer = AutoModelForCausalLM.from_pretrained(out).eval(), AutoTokenizer.from_pretrained(out)
    _, probe, held_out = tiny_policy_data("addition_2digit", seed=0)
    assert greedy_accuracy(model, tokenizer, probe) >= 0.5  # the saved folder is the model that stopped
    # the reported accuracy is the saved model's on prompts no run trains on, and it learned the task partly
    assert greedy_accuracy(model, tokenizer, held_out) == summary["greedy_accuracy"] > 0.2
