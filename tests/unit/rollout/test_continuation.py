"""Partial rollouts: a cut sample's continuation is generated with the response so far as its prompt,
so vLLM never sees a stop string that begins before the cut and ends after it. rollout.continuation
.joined (what RolloutWorker.resume joins with) ends such a sample as vLLM ends an uncut one. Real
vLLM output types and SmolLM2's byte-level BPE tokenizer, whose tokens span several characters."""

import pytest
from vllm import SamplingParams
from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, WeightVersionSpan

from rollout.async_engine import token_versions
from rollout.continuation import joined, straddling_stop
from rollout.engine import sampled_logprobs

BEFORE = "Thought: add 2 and 3\nObserv"  # the cut falls inside "Observation:"
AFTER = "ation: 5\nAnswer: 5"  # tokens: "ation", ":", " ", "5", "\n", "Answer", ":", " ", "5"
HEAD = "Thought: add 2 and 3\n"


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_tokenizer_path)


def continuation(tok, text=AFTER, tokens=None, finish="length", stop_reason=None):
    """vLLM's completion of the cut sample: `tokens` of AFTER's tokens (all), `text` its text."""
    ids = tok.encode(AFTER)[:tokens]
    return CompletionOutput(
        index=0,
        text=text,
        token_ids=ids,
        cumulative_logprob=None,
        logprobs=[{t: Logprob(-0.1 * (k + 1))} for k, t in enumerate(ids)],
        finish_reason=finish,
        stop_reason=stop_reason,
        weight_versions=[WeightVersionSpan("3", 0, 1), WeightVersionSpan("4", 1, len(ids))],
    )


def test_a_stop_string_across_the_cut_ends_the_sample_before_it_with_the_token_that_completes_it(tok):
    response = tok.encode(BEFORE)
    assert [tok.decode([t]) for t in tok.encode(AFTER)[:2]] == ["ation", ":"]  # the example's premise
    c, text = joined(tok, response, continuation(tok), SamplingParams(stop=["Observation:"]))
    assert text == HEAD and c.finish_reason == "stop" and c.stop_reason == "Observation:"
    assert [tok.decode([t]) for t in c.token_ids] == ["ation", ":"]  # through the ":" that completes it
    assert sampled_logprobs(c) == pytest.approx([-0.1, -0.2]) and token_versions(c) == [3, 4]
    # included when asked for, as vLLM's include_stop_str_in_output
    _, text = joined(
        tok, response, continuation(tok), SamplingParams(stop=["Observation:"], include_stop_str_in_output=True)
    )
    assert text == HEAD + "Observation:"


def test_a_stop_string_that_ends_mid_token_keeps_that_token_as_vllm_does(tok):
    # "Observa" ends inside "ation": vLLM keeps the token that completes a stop string, cuts the text
    c, text = joined(tok, tok.encode(BEFORE), continuation(tok), SamplingParams(stop=["Observa"]))
    assert text == HEAD and [tok.decode([t]) for t in c.token_ids] == ["ation"] and token_versions(c) == [3]


def test_the_stop_string_that_completes_first_wins_whatever_its_place_in_the_list(tok):
    c, text = joined(tok, tok.encode(BEFORE), continuation(tok), SamplingParams(stop=["bservation: 5", "Observa"]))
    assert text == HEAD and c.stop_reason == "Observa" and len(c.token_ids) == 1
    # one vLLM met after the cut and took out of the text ("ation: 5") completes after the one across it
    vllm_stopped = continuation(tok, text="", tokens=4, finish="stop", stop_reason="ation: 5")
    c, text = joined(tok, tok.encode(BEFORE), vllm_stopped, SamplingParams(stop=["ation: 5", "Observation"]))
    assert text == HEAD and c.stop_reason == "Observation" and len(c.token_ids) == 1


def test_without_a_stop_string_across_the_cut_the_continuation_is_vllms_own(tok):
    response = tok.encode(BEFORE)
    same = continuation(tok)
    c, text = joined(tok, response, same, SamplingParams(stop=["Observation?"]))
    assert c is same and text == BEFORE + AFTER
    # vLLM met "Answer" after the cut itself: its text and tokens stand
    own = continuation(tok, text="ation: 5\n", tokens=6, finish="stop", stop_reason="Answer")
    c, text = joined(tok, response, own, SamplingParams(stop=["Answer"]))
    assert c is own and text == BEFORE + "ation: 5\n"
    assert straddling_stop("ab", "cd", ["cd"]) is None and straddling_stop("ab", "cd", ["bc"]) == ("bc", 1)


def test_a_completion_that_meets_its_stop_string_at_once_has_no_text_not_the_stop_string(tok):
    # vLLM detokenized (a call with stop strings) and cut the text before "Observation:": its text is "",
    # its tokens are the stop string's. The reply (endpoint, episodes) is that "", never the decoded tokens
    from rollout.engine import completion_text

    ids = tok.encode("Observation:")
    c = CompletionOutput(0, "", ids, None, None, finish_reason="stop", stop_reason="Observation:")
    assert completion_text(c, tok, SamplingParams(stop=["Observation:"], detokenize=True)) == ""
    # not detokenized by vLLM (no stop strings): decoded here
    assert completion_text(c, tok, SamplingParams(detokenize=False)) == "Observation:"
