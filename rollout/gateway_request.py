"""What the agent endpoint does with each field of an OpenAI chat-completions request: one table,
FIELDS, which parse_request applies to every call and docs/agents.md shows row for row.

The table holds every field of the API's request (the `openai` client's completion_create_params,
checked by a test), each with the JSON types the API allows for it: a call's field is served as
the API defines it or refused with a 400 that names it, and a field the API does not have is
refused too (a misspelt one would otherwise change nothing, silently). null means "not given", for
every field. This is a training endpoint: the learner trains under rollout.sampling's distribution
(its logprobs, the ratio), so a field that would sample another one is refused, unless it asks
for that same distribution (a temperature equal to the config's).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, replace

from rollout.config import SamplingConfig

KINDS = {  # the JSON types, as Python reads them (a bool is no number)
    "number": lambda v: isinstance(v, int | float) and not isinstance(v, bool),
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "boolean": lambda v: isinstance(v, bool),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}
MAX_STOP = 4  # OpenAI's: up to 4 stop sequences a call
INT64 = (-(2**63), 2**63 - 1)  # OpenAI's seed is an int64 (and torch's generator takes it)
OFF_DISTRIBUTION = "a distribution the learner does not train under"


class Refused(ValueError):
    """A call relay does not serve (its 400); `field` names the request's field (OpenAI's error `param`)."""

    def __init__(self, field: str, why: str, where: str = ""):
        super().__init__(f"{field}{where}: {why}")
        self.field = field


@dataclass(frozen=True)
class Context:
    """What a field's check may read beside its value: the call's other fields and the run's config."""

    body: dict  # the call's fields, nulls dropped
    sampling: SamplingConfig  # rollout.sampling
    tool_parser: str  # rollout.endpoint.tool_parser ("" = off)


@dataclass(frozen=True)
class Field:
    """One row of the table: the types a field may take, what relay does with it, and the check that says so."""

    kinds: tuple[str, ...]  # the JSON types the API allows for it (null always: not given)
    how: str  # what relay does with it: docs/agents.md's table
    check: Callable[[object, Context], str] = lambda value, ctx: ""  # why a value is refused ("": served)


def equal_to_config(name: str, configured: Callable[[SamplingConfig], float]) -> Callable:
    def check(value, ctx: Context) -> str:
        want = configured(ctx.sampling)
        if float(value) == want:
            return ""
        return (
            f"{value} is refused: relay samples at the configured {want} ({name}), the distribution the "
            "learner trains under; omit it or send that value"
        )

    return check


def one_of(allowed: tuple, why: str) -> Callable:
    return lambda value, ctx: "" if value in allowed else f"{value!r} is refused: {why}"


def refused(why: str) -> Callable:
    return lambda value, ctx: f"refused: {why}"


def _messages(value: list, ctx: Context) -> str:
    if not value:
        return "a non-empty list of chat messages is required"
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise Refused("messages", "a message is an object with a string `role`", f"[{i}]")
        content = m.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise Refused("messages", f"{kind!r} parts are not served (text parts only)", f"[{i}].content[{j}]")
        elif content is not None and not isinstance(content, str):
            raise Refused("messages", "a string or a list of text parts", f"[{i}].content")
    return ""


def _positive(value: int, ctx: Context) -> str:
    return "" if value >= 1 else f"at least 1, got {value}"


def _stop(value, ctx: Context) -> str:
    stops = [value] if isinstance(value, str) else value
    if len(stops) > MAX_STOP:
        return f"at most {MAX_STOP} strings (as OpenAI's API), got {len(stops)}"
    if not all(isinstance(s, str) and s for s in stops):
        return f"non-empty strings expected, got {value!r}"
    return ""


def _seed(value: int, ctx: Context) -> str:
    return "" if INT64[0] <= value <= INT64[1] else f"{value} is outside int64, the API's seed"


def _top_logprobs(value: int, ctx: Context) -> str:
    if ctx.body.get("logprobs") is not True:
        return "needs logprobs: true (as OpenAI's API)"
    if value != 0:
        return f"{value} is refused: the engines return each sampled token's logprob, no alternatives; send 0"
    return ""


def _tools(value: list, ctx: Context) -> str:
    if not all(isinstance(t, dict) for t in value):
        return "a list of tool objects expected"
    if value and not ctx.tool_parser:
        return (
            "set rollout.endpoint.tool_parser to the model's tool-call format (e.g. hermes, qwen3_xml) "
            "to serve them (or describe tools in the messages)"
        )
    return ""


def _response_format(value: dict, ctx: Context) -> str:
    kind = value.get("type")
    if kind == "text":
        return ""
    if kind in ("json_object", "json_schema"):
        return f"{kind!r} is refused: it constrains sampling (guided decoding), {OFF_DISTRIBUTION}"
    return f"an object with type text, json_object or json_schema, got {value!r}"


def _stream_options(value: dict, ctx: Context) -> str:
    if ctx.body.get("stream") is not True:
        return "only with stream: true (as OpenAI's API)"
    keys = ("include_usage", "include_obfuscation")
    wrong = [k for k, v in value.items() if k not in keys or not (v is None or KINDS["boolean"](v))]
    return f"{wrong[0]!r}: include_usage and include_obfuscation only, each a boolean" if wrong else ""


def _metadata(value: dict, ctx: Context) -> str:
    return "" if all(isinstance(v, str) for v in value.values()) else "string values expected"


def _modalities(value: list, ctx: Context) -> str:
    return "" if all(m == "text" for m in value) else f"{value!r} is refused: the policy answers in text only"


_TEMPERATURE = equal_to_config("rollout.sampling.temperature", lambda s: s.temperature)
_TOP_P = equal_to_config("rollout.sampling.top_p", lambda s: s.top_p)
_NO_PENALTY = equal_to_config("relay applies no such penalty", lambda s: 0.0)
_MAX_TOKENS = "at least 1; capped at `rollout.sampling.max_new_tokens` (the learner's budget); both given: the smaller"
_HINT = "accepted, unused: it changes no answer"

FIELDS: dict[str, Field] = {
    "messages": Field(
        ("array",), "required, non-empty; a content is a string or text parts (joined by newlines)", _messages
    ),
    "model": Field(("string",), "optional; any name: the run's policy answers (`/v1/models`: relay-policy)"),
    "max_tokens": Field(("integer",), _MAX_TOKENS, _positive),
    "max_completion_tokens": Field(("integer",), _MAX_TOKENS, _positive),
    "temperature": Field(("number",), "must equal `rollout.sampling.temperature`", _TEMPERATURE),
    "top_p": Field(("number",), "must equal `rollout.sampling.top_p`", _TOP_P),
    "presence_penalty": Field(("number",), "must be 0", _NO_PENALTY),
    "frequency_penalty": Field(("number",), "must be 0", _NO_PENALTY),
    "logit_bias": Field(
        ("object",),
        "must be empty",
        lambda v, ctx: (
            "refused: relay samples rollout.sampling's distribution, the one the learner trains under" if v else ""
        ),
    ),
    "n": Field(("integer",), "must be 1", one_of((1,), "one completion per call (an episode is one conversation)")),
    "stop": Field(
        ("string", "array"),
        f"up to {MAX_STOP} non-empty strings, added to `rollout.sampling.stop` (which still applies)",
        _stop,
    ),
    "seed": Field(
        ("integer",),
        "the call's sampling seed (int64; a negative one taken mod 2^63); not given: a fresh one. A seed the agent "
        "sends is the sample's whole seed: the run's `seed` does not enter it, so an agent that always sends the "
        "same one samples alike in every run",
        _seed,
    ),
    "logprobs": Field(("boolean",), "true: `choices[0].logprobs` has each sampled token's logprob, streamed or not"),
    "top_logprobs": Field(("integer",), "0 only, with logprobs true (no alternatives are sampled)", _top_logprobs),
    "tools": Field(("array",), "served with `rollout.endpoint.tool_parser` set; else refused unless empty", _tools),
    "tool_choice": Field(
        ("string", "object"),
        "auto or none; forcing a call (required, a named tool) is refused",
        one_of(
            ("auto", "none"),
            f"forcing a call constrains sampling (guided decoding), {OFF_DISTRIBUTION}; use auto or none",
        ),
    ),
    "parallel_tool_calls": Field(
        ("boolean",),
        "true only: keeping the model to one call would constrain sampling",
        one_of((True,), "relay cannot keep the model to one tool call without constraining sampling"),
    ),
    "functions": Field(
        ("array",),
        "refused unless empty (deprecated: send `tools`)",
        lambda v, ctx: "the deprecated form is not served: send `tools`" if v else "",
    ),
    "function_call": Field(
        ("string", "object"),
        "refused (deprecated: send `tool_choice`)",
        refused("the deprecated form is not served: send `tool_choice`"),
    ),
    "response_format": Field(("object",), "type `text`; `json_object` and `json_schema` are refused", _response_format),
    "stream": Field(("boolean",), "true: OpenAI's Server-Sent Events"),
    "stream_options": Field(
        ("object",),
        "with stream true; `include_usage` served; `include_obfuscation` accepted (no padding is sent)",
        _stream_options,
    ),
    "user": Field(("string",), "on `/v1`: the episode id; on `/episodes/<id>/v1`: unused (the path names it)"),
    "metadata": Field(("object",), "accepted (string values), stored nowhere", _metadata),
    "store": Field(
        ("boolean",), "false only", one_of((False,), "relay stores no completions for OpenAI's distillation or evals")
    ),
    "reasoning_effort": Field(("string",), "refused", refused("the policy's chat template decides its reasoning")),
    "verbosity": Field(("string",), "refused", refused("relay cannot set the policy's verbosity")),
    "service_tier": Field(
        ("string",), "auto or default (the one tier)", one_of(("auto", "default"), "relay serves one tier: default")
    ),
    "modalities": Field(("array",), '`["text"]` only', _modalities),
    "audio": Field(("object",), "refused", refused("the policy answers in text only")),
    "prediction": Field(("object",), "accepted, unused: a latency hint, the answer is the same without it"),
    "web_search_options": Field(("object",), "refused", refused("relay runs no web search")),
    "moderation": Field(("object",), "refused", refused("relay runs no moderation")),
    "prompt_cache_key": Field(("string",), _HINT + " (the engines cache prefixes themselves)"),
    "prompt_cache_options": Field(("object",), _HINT),
    "prompt_cache_retention": Field(("string",), _HINT),
    "safety_identifier": Field(("string",), _HINT),
}


@dataclass(frozen=True)
class ChatRequest:
    """One call as relay serves it."""

    body: dict  # the call's fields: nulls dropped, a message's text parts joined into its content
    sampling: SamplingConfig  # rollout.sampling with the call's stop strings, max tokens and seed


def parse_request(body: dict, sampling: SamplingConfig, tool_parser: str = "") -> ChatRequest:
    """The call as relay serves it, or Refused (its 400) naming the first field it cannot serve."""
    given = {k: v for k, v in body.items() if v is not None}  # null: not given
    for key in given:
        if key not in FIELDS:
            raise Refused(key, "not a field of OpenAI's chat-completions request (rollout/gateway_request.py)")
    if "messages" not in given:
        raise Refused("messages", "a non-empty list of chat messages is required")
    ctx = Context(given, sampling, tool_parser)
    for key, value in given.items():
        field = FIELDS[key]
        if not any(KINDS[kind](value) for kind in field.kinds):
            raise Refused(key, f"expected {' or '.join(field.kinds)}, got {value!r}")
        why = field.check(value, ctx)
        if why:
            raise Refused(key, why)
    given["messages"] = [_joined(m) for m in given["messages"]]
    return ChatRequest(given, call_sampling(given, sampling))


def call_sampling(body: dict, sampling: SamplingConfig) -> SamplingConfig:
    """A served call's sampling: rollout.sampling's, one sample, the run's stop strings and the call's,
    its token cap (never above the config's) and its seed."""
    stop = body.get("stop", [])
    stop = [stop] if isinstance(stop, str) else stop  # a string is one stop sequence, not its characters
    caps = [body[k] for k in ("max_tokens", "max_completion_tokens") if k in body]
    return replace(
        sampling,
        n_samples_per_prompt=1,
        stop=list(dict.fromkeys([*sampling.stop, *stop])),
        max_new_tokens=min([*caps, sampling.max_new_tokens]),
        # into [0, 2**63): vLLM reads a seed of -1 as none, and keeps seeds as int64
        seed=body["seed"] % 2**63 if "seed" in body else uuid.uuid4().int % 2**31,
    )


def _joined(message: dict) -> dict:
    """A message whose content is text parts, with them joined by newlines (as vLLM's server joins them)."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    return {**message, "content": "\n".join(part["text"] for part in content)}
