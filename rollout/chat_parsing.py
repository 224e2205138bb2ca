"""Tool calls and reasoning in the agent endpoint's completions, through vLLM's own parsers.

`rollout.endpoint.tool_parser` and `reasoning_parser` name parsers of the installed vLLM (its
`vllm/tool_parsers` and `vllm/reasoning` registries: "hermes", "qwen3_xml", "qwen3", ...), composed
the way vLLM's OpenAI server composes them (`ParserManager.get_parser`). A completion's text becomes
the assistant message the agent gets (content, `tool_calls`, `reasoning_content`); its tokens are
recorded as they were sampled whatever the parsers make of them. Also here: the messages as chat
templates take them, and when a call's messages repeat the episode's recorded ones.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass


class ChatParsers:
    """vLLM's tool-call and reasoning parsers, by their config names ("" = off), for one tokenizer."""

    def __init__(self, tokenizer, tool_parser: str = "", reasoning_parser: str = ""):
        self.tokenizer, self.tool_parser, self.reasoning_parser = tokenizer, tool_parser, reasoning_parser
        self.parser_cls = (
            _parser_class(tokenizer, tool_parser, reasoning_parser) if tool_parser or reasoning_parser else None
        )
        # a call without tools (or with tool_choice "none") is parsed for reasoning alone, streamed or not
        self.no_tools_cls = _parser_class(tokenizer, "", reasoning_parser) if reasoning_parser else None

    def start(self, body: dict) -> ParsedCall:
        """One call's parsing state; ValueError (its 400) for a call vLLM's request type refuses."""
        if self.parser_cls is None:
            return ParsedCall(None, None, False)
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        try:
            request = ChatCompletionRequest(
                model="relay", messages=body["messages"], tools=body.get("tools"), tool_choice=body.get("tool_choice")
            )
        except Exception as e:  # noqa: BLE001 - pydantic's validation error, whatever its type
            raise ValueError(f"messages: {' '.join(str(e).split())[:300]}") from None
        auto_tools = bool(self.tool_parser) and bool(request.tools) and request.tool_choice != "none"
        parser_cls = self.parser_cls if auto_tools else self.no_tools_cls
        if parser_cls is None:
            return ParsedCall(None, None, False)
        parser = parser_cls(self.tokenizer, request.tools)
        return ParsedCall(parser, parser.adjust_request(request), auto_tools)

    def message(self, call: ParsedCall, text: str, tokens: list[int]) -> dict:
        """The assistant message of a finished completion."""
        if call.parser is None:
            return {"role": "assistant", "content": text}
        reasoning, content, tool_calls = call.parser.parse(
            text, call.request, enable_auto_tools=call.auto_tools, model_output_token_ids=tokens
        )
        calls = [
            {"id": c.id or _call_id(), "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in tool_calls or []
        ]
        return self._assistant(content, reasoning, calls)

    def deltas(self, call: ParsedCall, pieces: list[tuple[str, list[int]]], prompt_ids: list[int]) -> list[dict]:
        """The streamed deltas of a completion cut into `pieces` (text, its token ids), one per piece
        (empty where the parser holds text back, e.g. inside a tool call's markup)."""
        if call.parser is None:
            return [{"content": text} if text else {} for text, _ in pieces]
        out = []
        for k, (text, ids) in enumerate(pieces):
            delta = call.parser.parse_delta(text, ids, call.request, prompt_ids, finished=k == len(pieces) - 1)
            out.append(_delta_dict(delta) if delta is not None else {})
        return out

    def streamed_message(self, deltas: list[dict]) -> dict:
        """The assistant message a client builds from `deltas` (what it sends back when it continues)."""
        content = "".join(d.get("content") or "" for d in deltas)
        reasoning = "".join(d.get("reasoning_content") or "" for d in deltas)
        calls: dict[int, dict] = {}
        for d in deltas:
            for c in d.get("tool_calls") or []:
                call = calls.setdefault(
                    c["index"], {"id": None, "type": "function", "function": {"name": "", "arguments": ""}}
                )
                call["id"] = call["id"] or c.get("id")
                call["function"]["name"] += (c.get("function") or {}).get("name") or ""
                call["function"]["arguments"] += (c.get("function") or {}).get("arguments") or ""
        return self._assistant(content, reasoning or None, [calls[i] for i in sorted(calls)])

    def _assistant(self, content: str | None, reasoning: str | None, calls: list[dict]) -> dict:
        message = {"role": "assistant", "content": content or (None if calls else "")}
        if calls:
            message["tool_calls"] = calls
        if self.reasoning_parser:
            message["reasoning_content"] = reasoning
        return message


@dataclass
class ParsedCall:
    """One call's parser (None: no parser configured), vLLM's request for it, and whether tool calls
    are parsed (tools given, tool_choice not "none")."""

    parser: object
    request: object
    auto_tools: bool


def _parser_class(tokenizer, tool_parser: str, reasoning_parser: str):
    """vLLM's composed parser class, or ValueError naming the key and the names vLLM knows."""
    from vllm.parser.parser_manager import ParserManager
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager

    for key, name, known in (
        ("tool_parser", tool_parser, ToolParserManager.list_registered()),
        ("reasoning_parser", reasoning_parser, ReasoningParserManager.list_registered()),
    ):
        if name and name not in known:
            raise ValueError(f"rollout.endpoint.{key}: {name!r} is not one of vLLM's: {', '.join(known)}")
    try:
        return ParserManager.get_parser(
            tool_parser_name=tool_parser or None,
            reasoning_parser_name=reasoning_parser or None,
            enable_auto_tools=bool(tool_parser),
            tokenizer=tokenizer,
        )
    except TypeError as e:  # the tokenizer lacks the parser's markers
        raise ValueError(f"rollout.endpoint.tool_parser/reasoning_parser: {e}") from None


def _delta_dict(delta) -> dict:
    out = {}
    if delta.content:
        out["content"] = delta.content
    if delta.reasoning:
        out["reasoning_content"] = delta.reasoning
    if delta.tool_calls:
        out["tool_calls"] = [c.model_dump(exclude_none=True) for c in delta.tool_calls]
    return out


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates take them (as vLLM's server passes them): a tool call's arguments
    as a dict rather than the JSON string of the OpenAI API, a missing content as ""."""
    out = []
    for m in messages:
        m = {**m, "content": m.get("content") or ""}
        if m.get("tool_calls"):
            m["tool_calls"] = [_with_dict_arguments(c) for c in m["tool_calls"]]
        out.append(m)
    return out


def _with_dict_arguments(call: dict) -> dict:
    function = dict(call.get("function") or {})
    if isinstance(function.get("arguments"), str):
        try:
            function["arguments"] = json.loads(function["arguments"])
        except json.JSONDecodeError:
            pass  # the template gets it as sampled
    return {**call, "function": function}


def same_messages(sent: list[dict], recorded: list[dict]) -> bool:
    """The agent sent back the recorded conversation: the same roles and contents, and the same tool
    calls (name and arguments; ids and the JSON's spacing aside)."""
    return len(sent) == len(recorded) and all(
        a.get("role") == b.get("role")
        and (a.get("content") or "") == (b.get("content") or "")
        and _calls(a) == _calls(b)
        for a, b in zip(sent, recorded)
    )


def _calls(message: dict) -> list:
    out = []
    for c in message.get("tool_calls") or []:
        function = c.get("function") or {}
        arguments = function.get("arguments")
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except json.JSONDecodeError:
            pass
        out.append((function.get("name"), arguments))
    return out
