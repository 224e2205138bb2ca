"""The API sweep: every field of OpenAI's chat-completions request, through the real `openai` client
against the endpoint's real FastAPI app (a stand-in engine that samples like vLLM: stop strings,
max tokens), is served as the field table says (rollout/gateway_request.py) or refused with a 400
that names it: null (not given), each JSON type the API allows, every type it does not, unknown
fields. The table itself must cover the installed client's whole request and match docs/agents.md."""

from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import openai
import pytest
from openai.types.chat import completion_create_params

from learner.tiny_gpt import DEFAULT_ALPHABET, char_tokenizer
from rollout.config import SamplingConfig
from rollout.gateway import Batcher, build_app
from rollout.gateway_request import FIELDS, KINDS
from rollout.recorder import Recorder
from tests.helpers import REPO

# what the stand-in model samples: a ReAct step, then what the tool would have said
TEXT = "Thought: add them\nObservation: 3\nAnswer: 3"
QUESTION = [{"role": "user", "content": "1+2="}]
CONFIG = SamplingConfig(temperature=1.0, max_new_tokens=64, stop=["\nAnswer"])  # the run's own stop string


class StopEngine:
    """A rollout worker's `complete` as the Batcher calls it, sampling TEXT char by char as vLLM would
    under each call's sampling: it ends after the first stop string (its tokens sampled, its text left
    out) or at max_new_tokens; records each call's SamplingConfig."""

    def __init__(self, tok):
        self.tok, self.version, self.params = tok, 0, []
        self.complete = self

    def remote(self, prompts, params):
        self.params += params
        future = Future()
        future.set_result(([self.sample(s) for s in params], self.version))
        return SimpleNamespace(future=lambda: future)

    def sample(self, s: SamplingConfig):
        hits = sorted((TEXT.index(x), x) for x in s.stop if x in TEXT)
        ids = self.tok.encode(TEXT, add_special_tokens=False) + [self.tok.eos_token_id]
        text, finish = TEXT, "stop"
        if hits:
            at, x = hits[0]
            ids, text = ids[: at + len(x)], TEXT[:at]
        if len(ids) > s.max_new_tokens:
            ids, finish = ids[: s.max_new_tokens], "length"
            text = self.tok.decode(ids, skip_special_tokens=True)
        return ids, [-0.01 * (k + 1) for k in range(len(ids))], text, finish


@pytest.fixture(scope="module")
def served():
    """(http client onto the app, the engine, the recorder), one app for the module."""
    from fastapi.testclient import TestClient

    tok = char_tokenizer(DEFAULT_ALPHABET + "<|>")
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    engine, recorder = StopEngine(tok), Recorder(tok, 64, 256)
    with TestClient(build_app(recorder, Batcher([engine], 0.001), CONFIG, "relay-policy")) as http:
        yield http, engine, recorder


def create(served, path: str = "/episodes/e/v1", **fields):
    """One call through the openai client (fields as its keywords; messages: QUESTION unless given);
    a stream comes back as its list of chunks."""
    http = served[0]
    client = openai.OpenAI(base_url=f"http://testserver{path}", api_key="unused", max_retries=0, http_client=http)
    out = client.chat.completions.create(**{"model": "relay-policy", "messages": QUESTION, **fields})
    return list(out) if isinstance(out, openai.Stream) else out


def refused(served, field: str, **fields) -> str:
    """The call is answered 400 naming `field` (OpenAI's error `param`, and the message's start)."""
    with pytest.raises(openai.BadRequestError) as e:
        create(served, **fields)
    assert e.value.status_code == 400 and e.value.param == field, e.value.body
    assert e.value.body["message"].startswith(field)
    return e.value.body["message"]


def text_of(reply) -> str:
    if isinstance(reply, list):
        return "".join(c.choices[0].delta.content or "" for c in reply if c.choices)
    return reply.choices[0].message.content


# each field's values the API allows and relay serves, one call each (with the fields it needs beside)
SERVED = [
    (
        "messages",
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "1+"}, {"type": "text", "text": "2="}]}]},
    ),
    ("messages", {"messages": [{"role": "system", "content": "add"}, {"role": "user", "content": "1+2="}]}),
    ("model", {"model": "gpt-4o"}),
    ("max_tokens", {"max_tokens": 5}),
    ("max_tokens", {"max_tokens": 10**6}),
    ("max_completion_tokens", {"max_completion_tokens": 1}),
    ("temperature", {"temperature": 1}),
    ("temperature", {"temperature": 1.0}),
    ("top_p", {"top_p": 1.0}),
    ("presence_penalty", {"presence_penalty": 0}),
    ("frequency_penalty", {"frequency_penalty": 0.0}),
    ("logit_bias", {"logit_bias": {}}),
    ("n", {"n": 1}),
    ("stop", {"stop": "Observation:"}),
    ("stop", {"stop": ["Observation:", "zzz", "3", "\n"]}),
    ("stop", {"stop": []}),
    ("seed", {"seed": 0}),
    ("seed", {"seed": -1}),
    ("seed", {"seed": 2**63 - 1}),
    ("logprobs", {"logprobs": True}),
    ("logprobs", {"logprobs": False}),
    ("top_logprobs", {"logprobs": True, "top_logprobs": 0}),
    ("tools", {"tools": []}),
    ("tool_choice", {"tool_choice": "auto"}),
    ("tool_choice", {"tool_choice": "none"}),
    ("parallel_tool_calls", {"parallel_tool_calls": True}),
    ("functions", {"functions": []}),
    ("response_format", {"response_format": {"type": "text"}}),
    ("stream", {"stream": True}),
    ("stream", {"stream": False}),
    ("stream_options", {"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}}),
    ("stream_options", {"stream": True, "stream_options": {"include_usage": None}}),
    ("user", {"user": "agent-7"}),
    ("metadata", {"metadata": {"task": "sums"}}),
    ("store", {"store": False}),
    ("service_tier", {"service_tier": "auto"}),
    ("service_tier", {"service_tier": "default"}),
    ("modalities", {"modalities": ["text"]}),
    ("prediction", {"prediction": {"type": "content", "content": "Thought"}}),
    ("prompt_cache_key", {"prompt_cache_key": "k"}),
    ("prompt_cache_options", {"prompt_cache_options": {"mode": "implicit"}}),
    ("prompt_cache_retention", {"prompt_cache_retention": "24h"}),
    ("safety_identifier", {"safety_identifier": "hashed-user"}),
]
# values of an allowed type that relay refuses (the distribution the learner trains under, or what it cannot do)
REFUSED = [
    ("messages", {"messages": []}),
    ("messages", {"messages": ["1+2="]}),
    ("messages", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}),
    ("messages", {"messages": [{"role": "user", "content": 12}]}),
    ("max_tokens", {"max_tokens": 0}),
    ("max_completion_tokens", {"max_completion_tokens": -3}),
    ("temperature", {"temperature": 0.7}),
    ("top_p", {"top_p": 0.9}),
    ("presence_penalty", {"presence_penalty": 1.0}),
    ("frequency_penalty", {"frequency_penalty": -0.5}),
    ("logit_bias", {"logit_bias": {"5": 100}}),
    ("n", {"n": 2}),
    ("stop", {"stop": ["a", "b", "c", "d", "e"]}),
    ("stop", {"stop": [""]}),
    ("stop", {"stop": ["ok", 3]}),
    ("seed", {"seed": 2**63}),
    ("top_logprobs", {"logprobs": True, "top_logprobs": 2}),
    ("top_logprobs", {"top_logprobs": 0}),
    ("tools", {"tools": [{"type": "function", "function": {"name": "add"}}]}),
    ("tools", {"tools": ["add"]}),
    ("tool_choice", {"tool_choice": "required"}),
    ("tool_choice", {"tool_choice": {"type": "function", "function": {"name": "add"}}}),
    ("parallel_tool_calls", {"parallel_tool_calls": False}),
    ("functions", {"functions": [{"name": "add"}]}),
    ("function_call", {"function_call": "auto"}),
    ("function_call", {"function_call": {"name": "add"}}),
    ("response_format", {"response_format": {"type": "json_object"}}),
    ("response_format", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}),
    ("response_format", {"response_format": {}}),
    ("stream_options", {"stream_options": {"include_usage": True}}),
    ("stream_options", {"stream": True, "stream_options": {"include_usage": "yes"}}),
    ("stream_options", {"stream": True, "stream_options": {"usage": True}}),
    ("metadata", {"metadata": {"n": 1}}),
    ("store", {"store": True}),
    ("reasoning_effort", {"reasoning_effort": "low"}),
    ("verbosity", {"verbosity": "medium"}),
    ("service_tier", {"service_tier": "priority"}),
    ("modalities", {"modalities": ["text", "audio"]}),
    ("audio", {"audio": {"voice": "alloy", "format": "wav"}}),
    ("web_search_options", {"web_search_options": {}}),
    ("moderation", {"moderation": {"model": "omni-moderation-latest"}}),
]
# a value of every JSON type: a field is sent each one its table's types do not allow
JSON_VALUES = [True, 7, 2.5, "x", ["x"], {"x": "y"}]
WRONG_TYPES = [
    (name, value)
    for name, field in FIELDS.items()
    for value in JSON_VALUES
    if not any(KINDS[kind](value) for kind in field.kinds)
]


def test_the_table_is_the_installed_clients_whole_request_and_docs_agents_shows_it_row_for_row():
    params = completion_create_params.CompletionCreateParamsStreaming
    assert set(FIELDS) == params.__required_keys__ | params.__optional_keys__
    docs = (REPO / "docs" / "agents.md").read_text()
    for name, field in FIELDS.items():
        assert f"| `{name}` | {' or '.join(field.kinds)} | {field.how} |" in docs, name
    tested = {name for name, _ in SERVED + REFUSED}
    assert tested == set(FIELDS), set(FIELDS) - tested  # every field swept with values of its own
    assert all(any(n == name for n, _ in WRONG_TYPES) for name in FIELDS)  # and with a type it may not take


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_null_means_not_given(served, name):
    if name == "messages":  # the one required field
        refused(served, "messages", messages=None)
        return
    reply = create(served, **{name: None})
    assert text_of(reply) == "Thought: add them\nObservation: 3" and reply.choices[0].logprobs is None
    assert (served[1].params[-1].stop, served[1].params[-1].max_new_tokens) == (["\nAnswer"], 64)


@pytest.mark.parametrize("name, fields", SERVED, ids=[f"{n}-{k}" for k, (n, _) in enumerate(SERVED)])
def test_a_served_value_is_answered(served, name, fields):
    reply = create(served, **fields)
    text = text_of(reply)
    assert text and TEXT.startswith(text)  # what the stand-in sampled, cut where the call asked


@pytest.mark.parametrize("name, fields", REFUSED, ids=[f"{n}-{k}" for k, (n, _) in enumerate(REFUSED)])
def test_a_refused_value_is_a_400_naming_its_field(served, name, fields):
    calls = len(served[1].params)
    refused(served, name, **fields)
    assert len(served[1].params) == calls  # it never reached an engine


@pytest.mark.parametrize("name, value", WRONG_TYPES, ids=[f"{n}-{type(v).__name__}" for n, v in WRONG_TYPES])
def test_a_type_the_api_does_not_allow_is_a_400_naming_its_field(served, name, value):
    message = refused(served, name, **{"stream": True} if name == "stream_options" else {}, **{name: value})
    assert "expected" in message


def test_a_field_the_api_does_not_have_is_a_400_naming_it(served):
    assert "not a field of OpenAI's" in refused(served, "temprature", extra_body={"temprature": 1.0})
    refused(served, "top_k", extra_body={"top_k": 5})  # vLLM's extensions too: they would change the sampling
    create(served, extra_body={"top_k": None})  # null: not given


def test_stop_is_one_string_or_several_and_adds_to_the_runs_own(served):
    """A ReAct agent's stop="Observation:" stops at that word, not at its first character; an array
    stops at the first of its strings; and rollout.sampling.stop still applies beside the call's."""
    engine = served[1]
    assert text_of(create(served, stop="Observation:")) == "Thought: add them\n"
    assert engine.params[-1].stop == ["\nAnswer", "Observation:"]
    assert text_of(create(served, stop=["3", "Observation:"], stream=True)) == "Thought: add them\n"
    assert text_of(create(served, stop=["zzz"])) == "Thought: add them\nObservation: 3"  # the run's stop
    assert engine.params[-1].stop == ["\nAnswer", "zzz"]
    assert text_of(create(served, stop="\nAnswer")) == "Thought: add them\nObservation: 3"  # once, not twice
    assert engine.params[-1].stop == ["\nAnswer"]


def test_seed_max_tokens_and_user_are_honoured(served):
    engine = served[1]
    create(served, seed=7)
    assert engine.params[-1].seed == 7
    create(served, seed=-1)
    assert engine.params[-1].seed == 2**63 - 1  # a seed still: vLLM would read -1 as none
    seeds = set()
    for _ in range(2):
        create(served, seed=None)
        seeds.add(engine.params[-1].seed)
    assert len(seeds) == 2 and None not in seeds  # not given: a fresh seed per call
    reply = create(served, max_tokens=9, max_completion_tokens=5)
    assert engine.params[-1].max_new_tokens == 5 and reply.choices[0].finish_reason == "length"
    assert text_of(reply) == "Thoug" and reply.usage.completion_tokens == 5
    create(served, max_tokens=10**6)
    assert engine.params[-1].max_new_tokens == CONFIG.max_new_tokens  # the learner's budget caps it
    reply = create(served, path="/v1", user="agent-7", stop="Observation:")
    assert reply.model_extra["relay"]["episode"] == "agent-7" and "agent-7" in served[2].episodes


def test_logprobs_true_gives_each_sampled_tokens_logprob_streamed_or_not(served):
    whole = create(served, logprobs=True, stop="Observation:")
    tokens = whole.model_extra["relay"]["token_ids"]
    content = whole.choices[0].logprobs.content
    assert (
        [c.logprob for c in content]
        == whole.model_extra["relay"]["logprobs"]
        == [-0.01 * (k + 1) for k in range(len(tokens))]
    )
    assert "".join(c.token for c in content) == "Thought: add them\nObservation:"  # the stop string was sampled
    assert all(c.top_logprobs == [] and bytes(c.bytes).decode() == c.token for c in content)
    chunks = create(served, logprobs=True, stop="Observation:", stream=True)
    streamed = [
        c for chunk in chunks if chunk.choices and chunk.choices[0].logprobs for c in chunk.choices[0].logprobs.content
    ]
    assert [(c.token, c.logprob) for c in streamed] == [(c.token, c.logprob) for c in content]


def test_a_messages_text_parts_are_its_content(served):
    parts = [{"role": "user", "content": [{"type": "text", "text": "1+"}, {"type": "text", "text": "2="}]}]
    create(served, "/episodes/parts/v1", messages=parts)
    create(served, "/episodes/plain/v1", messages=[{"role": "user", "content": "1+\n2="}])
    samples = served[2].episodes
    assert samples["parts"][0].prompt_ids == samples["plain"][0].prompt_ids
