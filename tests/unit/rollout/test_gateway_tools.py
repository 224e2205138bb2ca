"""The agent endpoint through the real `openai` client against the real server (Gateway, uvicorn on a
port), with a stand-in engine that samples chosen token ids: streaming, tool calls through vLLM's
hermes and qwen3_xml parsers, reasoning through its qwen3 parser, and the token-in/token-out record
of it all checked against the chat template, on SmolLM2's tokenizer (ChatML, as Qwen's)."""

from __future__ import annotations

import importlib.util
import json
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from rollout.chat_parsing import template_messages
from rollout.config import EndpointConfig, SamplingConfig
from rollout.episodes import continuation_ids
from rollout.gateway import Gateway
from runtime.prompts import encode_chat

TEMPLATES = Path(__file__).parent / "templates"
# a real model's template with tools and <think> (Qwen3's, as MiniCPM-V 4.5 ships it), from the installed vLLM
QWEN3_TEMPLATE = Path(importlib.util.find_spec("vllm").origin).parent / "transformers_utils/chat_templates"
QWEN3_TEMPLATE = QWEN3_TEMPLATE / "template_minicpmv45.jinja"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
QUESTION = [{"role": "user", "content": "What is 1 + 2? Use the tool."}]


class ScriptedEngine:
    """A rollout worker's `complete` as the Batcher calls it, sampling the texts given, one per call,
    as token ids ending with EOS (what a model would have to emit to call a tool)."""

    def __init__(self, tokenizer, texts: list[str]):
        self.tokenizer, self.texts, self.prompts = tokenizer, list(texts), []
        self.complete = self

    def remote(self, prompts, params):
        self.prompts += prompts
        out = []
        for _ in prompts:
            ids = self.tokenizer.encode(self.texts.pop(0), add_special_tokens=False) + [self.tokenizer.eos_token_id]
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            out.append((ids, [-0.1 * (k + 1) for k in range(len(ids))], text, "stop"))
        future = Future()
        future.set_result((out, 3))
        return SimpleNamespace(future=lambda: future)


@pytest.fixture
def serve(smollm2_tokenizer_path):
    """serve(texts, **endpoint config) -> (gateway, engine, tokenizer as the gateway renders with)."""
    made = []

    def start(texts: list[str], **cfg):
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(smollm2_tokenizer_path)
        engine = ScriptedEngine(tok, texts)
        endpoint = EndpointConfig(port=0, batch_wait_ms=1.0, **cfg)
        gateway = Gateway([engine], smollm2_tokenizer_path, endpoint, SamplingConfig(max_new_tokens=64), 1024, 2048)
        made.append(gateway)
        return gateway, engine, gateway.recorder.tokenizer

    yield start
    for g in made:
        g.shutdown()


def client(gateway, episode: str):
    from openai import OpenAI

    return OpenAI(base_url=f"{gateway.url()}/episodes/{episode}/v1", api_key="unused", max_retries=0)


def finished(gateway, episode: str):
    httpx.post(f"{gateway.url()}/episodes/{episode}/reward", json={"reward": 1.0}).raise_for_status()
    batch, _ = gateway.take(1, timeout_s=5.0, step=3)
    return batch


def stream(c, **call) -> tuple[list, dict]:
    """The chunks of a streamed call, and the message the client builds from them."""
    got = list(c.chat.completions.create(model="relay-policy", stream=True, **call))
    message = {"role": "assistant", "content": "", "tool_calls": {}, "reasoning_content": ""}
    for chunk in got:
        for choice in chunk.choices:
            message["content"] += choice.delta.content or ""
            message["reasoning_content"] += (choice.delta.model_extra or {}).get("reasoning_content") or ""
            for t in choice.delta.tool_calls or []:
                slot = message["tool_calls"].setdefault(t.index, {"id": t.id, "name": "", "arguments": ""})
                slot["name"] += t.function.name or ""
                slot["arguments"] += t.function.arguments or ""
    return got, message


def test_streaming_gives_the_non_streamed_text_token_for_token(serve):
    text = "Sure: 1 + 2 = 3, and ½ of 6 is 3 ✓."  # characters that span several byte-level tokens
    gateway, engine, tok = serve([text, text])
    plain = client(gateway, "whole").chat.completions.create(model="relay-policy", messages=QUESTION, seed=7)
    got, message = stream(
        client(gateway, "streamed"), messages=QUESTION, seed=7, stream_options={"include_usage": True}
    )
    assert plain.choices[0].message.content == text == message["content"]
    assert got[0].choices[0].delta.role == "assistant" and got[-2].choices[0].finish_reason == "stop"
    pieces = [c.model_extra["relay"]["token_ids"] for c in got[:-1]]
    assert sum(pieces, []) == plain.model_extra["relay"]["token_ids"]  # every sampled token once, in order
    assert sum(len(p) >= 1 for p in pieces) >= len(text.split())  # streamed piece by piece, not in one chunk
    assert got[-1].choices == [] and got[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert got[-2].model_extra["relay"]["completion"]["logprobs"] == plain.model_extra["relay"]["logprobs"]
    batch = finished(gateway, "streamed")
    assert batch.response_ids == [plain.model_extra["relay"]["token_ids"]] and batch.response_text == [text]
    engine.texts.append(text)
    raw = httpx.post(  # the wire format OpenAI's clients read
        f"{gateway.url()}/episodes/raw/v1/chat/completions", json={"messages": QUESTION, "stream": True}
    )
    events = [line for line in raw.text.split("\n\n") if line]
    assert raw.headers["content-type"].startswith("text/event-stream") and events[-1] == "data: [DONE]"
    assert json.loads(events[0].removeprefix("data: "))["object"] == "chat.completion.chunk"


def round_trip(gateway, episode: str, streamed: bool):
    """An agent's tool-call round trip: the call, the tool's result sent back, the answer."""
    c = client(gateway, episode)
    if streamed:
        _, m = stream(c, messages=QUESTION, tools=TOOLS)
        calls = [
            {"id": t["id"], "type": "function", "function": {"name": t["name"], "arguments": t["arguments"]}}
            for t in m["tool_calls"].values()
        ]
        assistant = {"role": "assistant", "content": m["content"] or None, "tool_calls": calls}
    else:
        first = c.chat.completions.create(model="relay-policy", messages=QUESTION, tools=TOOLS)
        assert first.choices[0].finish_reason == "tool_calls"
        assistant = first.choices[0].message.model_dump(exclude_none=True)
        calls = assistant["tool_calls"]
    assert [(t["function"]["name"], json.loads(t["function"]["arguments"])) for t in calls] == [
        ("add", {"a": 1, "b": 2})
    ]
    conversation = QUESTION + [assistant, {"role": "tool", "tool_call_id": calls[0]["id"], "content": "3"}]
    second = c.chat.completions.create(model="relay-policy", messages=conversation, tools=TOOLS)
    assert second.choices[0].message.content == "It is 3."
    return conversation, finished(gateway, episode)


HERMES_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
XML_CALL = (
    "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n2\n</parameter>\n</function>\n"
    "</tool_call>"
)


@pytest.mark.parametrize(
    "parser, template, call_text",
    [
        ("hermes", TEMPLATES / "hermes_tools.jinja", HERMES_CALL),
        ("qwen3_xml", TEMPLATES / "qwen3_xml_tools.jinja", XML_CALL),
    ],
)
@pytest.mark.parametrize("streamed", [False, True])
def test_a_tool_call_round_trip_trains_exactly_the_sampled_tokens(serve, parser, template, call_text, streamed):
    """The engine samples the call as the template writes it, so here the whole conversation through
    the chat template is exactly what the engine was given for the answer: prompt (the tools
    rendered), the sampled call, then the tool result's tokens (masked)."""
    gateway, engine, tok = serve([call_text, "It is 3."], tool_parser=parser, chat_template=str(template))
    conversation, batch = round_trip(gateway, f"{parser}-{streamed}", streamed)
    call_ids, answer_ids = sampled(tok, call_text), sampled(tok, "It is 3.")
    prompt = encode_chat(tok, QUESTION, tools=TOOLS)
    assert '"name": "add"' in tok.decode(prompt) or "<name>add</name>" in tok.decode(prompt)  # the tools rendered
    assert batch.prompt_ids == [prompt]
    ids, mask = batch.response_ids[0], batch.action_mask[0]
    given = encode_chat(tok, template_messages(conversation), tools=TOOLS)  # the template's whole conversation
    assert engine.prompts[1] == given == prompt + ids[: len(ids) - len(answer_ids)]
    tool_result = len(ids) - len(call_ids) - len(answer_ids)
    assert ids[: len(call_ids)] == call_ids and ids[-len(answer_ids) :] == answer_ids and tool_result > 0
    assert mask == [1] * len(call_ids) + [0] * tool_result + [1] * len(answer_ids)  # only sampled tokens train
    assert batch.logprobs[0][: len(call_ids)] == [-0.1 * (k + 1) for k in range(len(call_ids))]


def test_a_tool_call_under_qwen3s_own_template_continues_the_sample_token_for_token(serve):
    """Qwen3's template opens every answer with an empty <think></think> (thinking off) but renders
    past answers without it, so the conversation rendered again is not what the engine was given:
    the record is the prompt, the sampled call, and the template's tokens for the tool result."""
    gateway, engine, tok = serve([HERMES_CALL, "It is 3."], tool_parser="hermes", chat_template=str(QWEN3_TEMPLATE))
    conversation, batch = round_trip(gateway, "qwen3", streamed=False)
    call_ids, answer_ids = sampled(tok, HERMES_CALL), sampled(tok, "It is 3.")
    delta = continuation_ids(tok, template_messages(conversation[2:]), call_ids[-1])
    assert batch.prompt_ids[0] == encode_chat(tok, QUESTION, tools=TOOLS)
    assert batch.response_ids[0] == call_ids + delta + answer_ids
    assert batch.action_mask[0] == [1] * len(call_ids) + [0] * len(delta) + [1] * len(answer_ids)
    assert engine.prompts[1] == batch.prompt_ids[0] + call_ids + delta
    assert encode_chat(tok, template_messages(conversation), tools=TOOLS) != engine.prompts[1]  # why: see above


def sampled(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]


def test_reasoning_comes_back_apart_and_its_tokens_train_as_sampled(serve):
    """The agent sends its reply back without the reasoning (and Qwen3's own template drops a past
    turn's <think> too), so the conversation rendered again is not what was sampled; the record is
    what was: the prompt, the sampled tokens (the thinking included), and the template's tokens
    for the new message after them."""
    thought = "<think>\n1 plus 2 makes 3.\n</think>\n\nIt is 3."
    template = str(TEMPLATES / "qwen3_xml_tools.jinja")
    gateway, engine, tok = serve(
        [thought, thought, "You are welcome."], reasoning_parser="qwen3", chat_template=template
    )
    c = client(gateway, "think")
    whole = c.chat.completions.create(model="relay-policy", messages=QUESTION).choices[0].message
    assert whole.model_extra["reasoning_content"].strip() == "1 plus 2 makes 3." and whole.content.strip() == "It is 3."
    _, streamed = stream(client(gateway, "think-streamed"), messages=QUESTION)
    assert (streamed["reasoning_content"], streamed["content"]) == (
        whole.model_extra["reasoning_content"],
        whole.content,
    )
    more = QUESTION + [{"role": "assistant", "content": whole.content}, {"role": "user", "content": "Thanks!"}]
    c.chat.completions.create(model="relay-policy", messages=more)
    batch = finished(gateway, "think")
    first, last = sampled(tok, thought), sampled(tok, "You are welcome.")
    delta = continuation_ids(tok, more[2:], first[-1])
    assert batch.response_ids[0] == first + delta + last
    assert batch.action_mask[0] == [1] * len(first) + [0] * len(delta) + [1] * len(last)
    assert encode_chat(tok, more) != engine.prompts[2]  # why the test cannot compare with a re-render


def test_what_the_parsers_cannot_serve_is_refused_with_the_key_named(serve):
    gateway, _, _ = serve([], tool_parser="hermes", chat_template=str(QWEN3_TEMPLATE))
    url = f"{gateway.url()}/episodes/e/v1/chat/completions"
    for body, key in [
        ({"messages": QUESTION, "tools": TOOLS, "tool_choice": "required"}, "tool_choice"),
        (
            {"messages": QUESTION, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "add"}}},
            "tool_choice",
        ),
        ({"messages": QUESTION, "functions": [{"name": "add"}]}, "functions"),
    ]:
        r = httpx.post(url, json=body)
        assert r.status_code == 400 and r.json()["detail"].startswith(key)
    with pytest.raises(ValueError, match=r"rollout.endpoint.tool_parser: 'nope' is not one of vLLM's: .*hermes"):
        serve([], tool_parser="nope")
    with pytest.raises(ValueError, match="rollout.endpoint.reasoning_parser: 'nope'"):
        serve([], reasoning_parser="nope")


def test_without_tools_offered_a_tool_calls_markup_is_plain_content_streamed_or_not(serve):
    """Tool calls are parsed only where the call offers tools (and tool_choice is not "none"), as
    vLLM's server does: otherwise the markup is the answer's text."""
    gateway, _, _ = serve([HERMES_CALL] * 4, tool_parser="hermes", chat_template=str(TEMPLATES / "hermes_tools.jinja"))
    for k, extra in enumerate([{}, {"tools": TOOLS, "tool_choice": "none"}]):
        c = client(gateway, f"plain{k}")
        whole = c.chat.completions.create(model="relay-policy", messages=QUESTION, **extra)
        assert whole.choices[0].message.content == HERMES_CALL and not whole.choices[0].message.tool_calls
        assert whole.choices[0].finish_reason == "stop"
        _, streamed = stream(c, messages=QUESTION, **extra)
        assert streamed["content"] == HERMES_CALL and streamed["tool_calls"] == {}
