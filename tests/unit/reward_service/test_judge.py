"""The judge reward source: its verdicts parsed, cached and counted; a judge that answers garbage or hangs
makes samples "could not judge", never a score; a real model and a real OpenAI-style server behind it."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from reward_service.combine import call_counts, run_source
from reward_service.config import RewardSource, SourceKind
from reward_service.judge import JudgeSource, choice_probability, judge_prompt, parse_verdict
from reward_service.sources import build_source

CHOICE = RewardSource(kind=SourceKind.judge, url="http://x")
NUMBER = RewardSource(kind=SourceKind.judge, url="http://x", verdict="number", score_range=[1.0, 5.0])


def test_verdicts_are_parsed_or_left_unjudged():
    assert parse_verdict("Yes, it is right.", CHOICE) == 1.0 and parse_verdict(" no", CHOICE) == 0.0
    assert parse_verdict("No. Yes would be wrong", CHOICE) == 0.0  # the first choice said
    assert parse_verdict("yesterday", CHOICE) is None and parse_verdict("", CHOICE) is None  # whole words only
    assert parse_verdict("Score: 4", NUMBER) == 0.75 and parse_verdict("1", NUMBER) == 0.0
    assert parse_verdict("9 out of 5", NUMBER) is None and parse_verdict("great!", NUMBER) is None
    assert judge_prompt("Q {prompt} A {answer} R {response}", "2+2=", "4", None) == "Q 2+2= A None R 4"


def test_a_probability_verdict_weighs_the_choices_by_the_judges_first_token():
    # " yes" and "Yes" are one choice: 0.5 + 0.1 yes, 0.2 no, "the" no choice -> 0.6 / 0.8 = 0.75
    tokens = {" yes": 0.5, "Yes": 0.1, " no": 0.2, "the": 0.2}
    assert choice_probability(tokens, {"yes": 1.0, "no": 0.0}) == pytest.approx(0.75)
    assert choice_probability(tokens, {"yes": 2.0, "no": -1.0}) == pytest.approx((0.6 * 2 - 0.2) / 0.8)
    assert choice_probability({"the": 0.9, " yesterday": 0.1}, {"yes": 1.0, "no": 0.0}) is None  # no choice: unjudged
    assert choice_probability({}, {"yes": 1.0}) is None  # a prompt too long for the judge
    cfg = RewardSource(kind=SourceKind.judge, url="http://x", verdict="probability")
    assert parse_verdict({"no": 0.25, "yes": 0.75}, cfg) == 0.75
    # the choices hold 0.5% of its first token: it meant something else, and 0.004 / 0.005 is no verdict
    assert parse_verdict({" yes": 0.004, " no": 0.001, "The": 0.9}, cfg) is None  # judge_min_choice_mass 0.5
    assert choice_probability({" yes": 0.004, " no": 0.001}, {"yes": 1.0, "no": 0.0}, 0.0) == pytest.approx(0.8)


def test_a_choice_of_several_tokens_is_refused_for_a_probability_verdict():
    from learner.tiny_gpt import char_tokenizer
    from reward_service.judge import check_choice_tokens

    tok = char_tokenizer()  # one token per character
    check_choice_tokens(tok, {"4": 1.0, "5": 0.0})
    with pytest.raises(ValueError, match="'45' is several tokens"):  # its probability would never be counted
        check_choice_tokens(tok, {"4": 1.0, "45": 0.0})


def test_a_response_cannot_put_the_reference_into_the_question():
    # filled in one pass: a response "{answer}" stays as written, not the reference answer
    filled = judge_prompt("Reference: {answer} Proposed: {response}", "2+2=", "{answer}", "4")
    assert filled == "Reference: 4 Proposed: {answer}"


class Judge:
    """A judge that says yes to the response 4, no verdict to ?, no to the rest; it keeps its prompts."""

    def __init__(self):
        self.seen = []

    def generate(self, texts):
        self.seen += texts
        verdict = {"4": "yes", "?": "hmm", "long": None}  # "hmm": no verdict; None: too long for the judge
        return [verdict.get(t.split("Proposed answer: ")[1].split("\n")[0], "no") for t in texts]


def test_the_source_caches_verdicts_by_question_and_counts_each_call():
    judge = Judge()
    source = JudgeSource(CHOICE, judge)
    out = source.score(["2+2=", "2+2=", "3+3="], ["4", "5", "?"], [{"answer": "4"}, {"answer": "4"}, {}])
    assert out.scores == [1.0, 0.0, None] and len(judge.seen) == 3
    assert "Reference answer: 4" in judge.seen[0] and "Reference answer: None" in judge.seen[2]
    assert out.counts["judge/judged"] == 3 and out.counts["judge/parse_failures"] == 1
    again = source.score(["2+2=", "3+3="], ["4", "?"], [{"answer": "4"}, {}])
    assert again.scores == [1.0, None] and len(judge.seen) == 3 and again.counts["judge/cache_hits"] == 2
    # the same prompt and response with another reference answer is another question, asked anew
    other = source.score(["2+2="], ["4"], [{"answer": "5"}])
    assert len(judge.seen) == 4 and "Reference answer: 5" in judge.seen[-1] and other.counts["judge/judged"] == 1
    # a question too long for the judge is not sent: not judged, not a parse failure, counted apart
    out = source.score(["1+1="], ["long"], [{}])
    assert out.scores == [None] and out.counts["judge/too_long"] == 1
    assert out.counts["judge/judged"] == 0 and out.counts["judge/parse_failures"] == 0
    run = run_source(source, ["2+2="], ["7"], [{}], 5.0)
    assert run.scores == [0.0] and call_counts({"judge": run})["judge/judged"] == 1


def test_a_judge_that_fails_on_the_batch_is_asked_one_sample_at_a_time():
    class Flaky(Judge):  # fails on more than one question at once
        def generate(self, texts):
            if len(texts) > 1:
                raise RuntimeError("out of memory")
            return super().generate(texts)

    run = run_source(JudgeSource(CHOICE, Flaky()), ["2+2=", "2+3="], ["4", "6"], [{}, {}], 5.0)
    assert run.scores == [1.0, 0.0] and "out of memory" in run.errors[0]
    # a group's samples often repeat: each new question is sent once, the repeats are cache hits
    judge = Judge()
    source = JudgeSource(CHOICE, judge)
    seen = len(judge.seen)
    out = source.score(["5+5="] * 3 + ["6+6="], ["10", "10", "11", "10"], [{}] * 4)
    assert len(judge.seen) == seen + 3 and out.counts["judge/judged"] == 3 and out.counts["judge/cache_hits"] == 1


class TopJudge:
    """A judge whose first token is "yes" with probability 0.9 for the response 4, 0.2 otherwise."""

    def top_tokens(self, texts):
        return [{" yes": 0.9, " no": 0.1} if "Proposed answer: 4\n" in t else {" yes": 0.2, "no": 0.8} for t in texts]


def test_a_probability_verdict_scores_through_the_source():
    source = JudgeSource(RewardSource(kind=SourceKind.judge, url="http://x", verdict="probability"), TopJudge())
    out = source.score(["2+2=", "2+2="], ["4", "5"], [{"answer": "4"}, {"answer": "4"}])
    assert out.scores == pytest.approx([0.9, 0.2]) and out.counts["judge/parse_failures"] == 0


def serve(reply):
    """An OpenAI-compatible /v1/completions server on a free port; reply(prompts) -> its body."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            data = json.dumps(reply(body["prompt"])).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("behaviour", ["answers", "garbage", "hangs"])
def test_a_judge_server_that_answers_garbage_or_hangs_leaves_its_samples_unjudged(behaviour):
    release = threading.Event()  # a hung judge answers only once the run is back: no clock decides the test

    def reply(prompts):
        if behaviour == "hangs":
            release.wait(60)  # were the run to wait for it, it would get these verdicts and fail below
        text = {"answers": lambda p: "yes" if "answer: 4" in p else "no", "garbage": lambda p: "the cat sat"}
        text = text["answers" if behaviour == "hangs" else behaviour]
        return {"choices": [{"index": i, "text": text(p)} for i, p in enumerate(prompts)]}

    server = serve(reply)
    try:
        # the deadline is meant to cut only the hung judge: one that answers gets more than a loaded machine needs
        timeout_s = 1.0 if behaviour == "hangs" else 60.0
        cfg = RewardSource(kind=SourceKind.judge, url=f"http://127.0.0.1:{server.server_port}", timeout_s=timeout_s)
        run = run_source(build_source(cfg), ["2+2=", "2+3="], ["4", "6"], [{}, {}], cfg.timeout_s)
    finally:
        release.set()
        server.shutdown()
    if behaviour == "answers":
        assert run.scores == [1.0, 0.0] and run.counts["judge/parse_failures"] == 0
    elif behaviour == "garbage":  # every verdict unparsable: could not judge, counted, never 0
        assert run.scores == [None, None] and run.counts["judge/parse_failures"] == 2 and not run.timeouts
    else:  # back while the judge still hung, its samples unjudged: the deadline cut it, not the judge's answer
        assert run.scores == [None, None] and run.timeouts >= 1


def test_a_model_folder_judges_in_process_and_its_unparsable_answers_are_counted(tiny_model):
    # in process by transformers; on vLLM (the default): tests/e2e/reward_service/test_judge_vllm.py
    cfg = RewardSource(kind=SourceKind.judge, model_path=tiny_model, judge_max_tokens=4, judge_engine="transformers")
    source = build_source(cfg, micro_batch_size=2)
    out = source.score(["1+1=", "2+2=", "3+3="], ["2", "4", "7"], [{}, {}, {}])
    # a 2-layer model trained on sums answers digits, not yes/no: each sample unjudged, each counted
    assert len(out.scores) == 3 and out.counts["judge/judged"] == 3
    assert out.counts["judge/parse_failures"] == sum(s is None for s in out.scores)
    number = build_source(
        RewardSource(
            kind=SourceKind.judge,
            model_path=tiny_model,
            verdict="number",
            score_range=[0.0, 1000.0],
            template="{prompt}",
            judge_engine="transformers",
        ),
        micro_batch_size=2,
    )
    scored = number.score(["12+34="], ["x"], [{}])  # the prompt alone: the model answers its sum, a number
    assert scored.scores[0] is None or 0.0 <= scored.scores[0] <= 1.0


def test_a_judge_server_gives_its_first_token_probabilities():
    import math

    def reply(prompts):  # the completions API's logprobs: the first token's top_logprobs
        def top(p):
            return {" yes": math.log(0.6), " no": math.log(0.2)} if "answer: 4" in p else {" no": 0.0}

        return {
            "choices": [{"index": i, "text": "", "logprobs": {"top_logprobs": [top(p)]}} for i, p in enumerate(prompts)]
        }

    server = serve(reply)
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        source = build_source(RewardSource(kind=SourceKind.judge, url=url, verdict="probability"))
        out = source.score(["2+2=", "2+3="], ["4", "6"], [{}, {}])
    finally:
        server.shutdown()
    assert out.scores == pytest.approx([0.75, 0.0])


def test_a_model_folders_first_token_probabilities_are_its_softmax(tiny_model):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    judge = build_source(
        RewardSource(kind=SourceKind.judge, model_path=tiny_model, judge_engine="transformers", template="{prompt}"),
        micro_batch_size=2,
    ).backend
    prompts = ["12+34=", "5+7=", "99+1="]  # different lengths: left padding in a micro-batch
    got = judge.top_tokens(prompts)
    tok, model = AutoTokenizer.from_pretrained(tiny_model), AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    for prompt, top in zip(prompts, got):
        text = tok.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        with torch.no_grad():  # one unpadded sequence at a time
            probs = model(torch.tensor([tok(text).input_ids])).logits[0, -1].softmax(-1)
        assert len(top) > 1 and sum(top.values()) <= 1 + 1e-5
        for token, p in top.items():
            assert p == pytest.approx(
                sum(probs[i].item() for i in range(len(probs)) if tok.decode([i]) == token), abs=1e-5
            )


@pytest.mark.parametrize("verdict", ["choice", "probability"])
def test_a_model_folders_judge_leaves_a_question_over_its_context_unjudged(tiny_model, verdict):
    """transformers would fail the whole batch (or read past its positions): a too-long question is not sent."""
    from transformers import AutoConfig

    context = AutoConfig.from_pretrained(tiny_model).n_positions
    cfg = RewardSource(
        kind=SourceKind.judge, model_path=tiny_model, judge_engine="transformers", template="{prompt}", verdict=verdict
    )
    cfg.choices = {"1": 1.0, "0": 0.0}  # one token each of the character tokenizer
    source = build_source(cfg, micro_batch_size=2)
    long = "1+" * context + "1="
    out = source.score(["2+2=", long, "3+3="], ["4", "2", "6"], [{}, {}, {}])
    assert out.counts["judge/too_long"] == 1 and out.counts["judge/judged"] == 2 and out.scores[1] is None
    ask = source.backend.top_tokens if verdict == "probability" else source.backend.generate
    answers = ask(["2+2=", long, "3+3="])
    assert answers[1] is None and answers[0] is not None and answers[2] is not None
    alone = ask(["2+2="])[0]  # the fitting questions' answers are theirs, in their places (unpadded: ~1e-8 apart)
    assert answers[0] == (pytest.approx(alone, abs=1e-6) if verdict == "probability" else alone)


def test_the_verdict_cache_is_state_a_resumed_or_replayed_run_counts_as_an_uninterrupted_one():
    # issue 40 item 8: an uninterrupted source scores steps 1-3; a checkpoint after step 1 is restored (a resume,
    # through JSON as orchestrator.json holds it, or a replay rewinding the same source) and steps 2-3 scored again
    steps = [(["2+2=", "3+3="], ["4", "6"]), (["2+2=", "5+5="], ["4", "10"]), (["3+3=", "5+5="], ["6", "9"])]
    meta = [{"answer": "4"}, {}]

    def run(source, todo):
        return [source.score(p, r, meta).counts for p, r in todo]

    whole = JudgeSource(CHOICE, Judge())
    want = run(whole, steps)
    source = JudgeSource(CHOICE, Judge())
    run(source, steps[:1])
    checkpoint = json.loads(json.dumps(source.state_dict()))
    assert not any("2+2=" in key for key, _ in checkpoint["verdicts"])  # digests, no question text
    run(source, steps[1:])  # the steps the crash loses
    for restored in (JudgeSource(CHOICE, Judge()), source):  # resumed in a new process; replayed in this one
        restored.load_state_dict(checkpoint)
        got = run(restored, steps[1:])
        for g, w in zip(got, want[1:]):
            assert {k: v for k, v in g.items() if k != "judge/seconds"} == {
                k: v for k, v in w.items() if k != "judge/seconds"
            }
        assert got[0]["judge/cache_hits"] == 1  # 2+2=4, asked at step 1
