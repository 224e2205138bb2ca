"""A reward judged by a language model (`kind: judge`): each (prompt, response) is put in the source's
template (a rubric; the reference answer where the data has one), the judge answers greedily, and its
verdict is parsed: a number in `score_range` (scaled to [0, 1]) or one of `choices` (its score).

A verdict that cannot be parsed, and a judge that fails or runs past the source's deadline
(combine.run_source), make the sample "could not judge", never a score. Verdicts are cached by
question (the filled template): one asked once is not asked again (the judge is frozen and greedy).
The judge is a model folder (`model_path`) on its own frozen vLLM engine (`judge_engine: vllm`, the
default: the engine core in a child process of the scoring service, the template's shared prefix in its
prefix cache) or run by transformers in the scoring service's process; or any OpenAI-compatible server
(`url`: its /v1/completions, e.g. `vllm serve`). `judge/*` counts each call's judgements, cache hits,
parse failures and seconds. The cache is part of the scoring service's state (checkpointed, rewound with a
learner replay, given to a restarted service), so `judge/*` of a resumed or replayed run are those of an
uninterrupted one; it keeps each question's digest, not its text.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import threading
import time
import urllib.request
from collections import OrderedDict
from dataclasses import dataclass, field

from reward_service.config import RewardSource

CACHE_SIZE = 100_000  # verdicts kept
TOP_TOKENS = 20  # verdict probability: the first tokens read (vLLM's default max_logprobs)
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_SLOT = re.compile(r"\{(prompt|response|answer)\}")


@dataclass
class JudgeResult:
    """A judge's call: a score per sample (None: could not judge) and its counts (judge/*)."""

    scores: list[float | None]
    counts: dict[str, float] = field(default_factory=dict)


def judge_prompt(template: str, prompt: str, response: str, answer) -> str:
    """The template filled in one pass: {prompt}, {response} and {answer} ("None" where the data has no answer).
    One pass: a response that itself holds "{answer}" must not have the reference put into it."""
    values = {"prompt": prompt, "response": response, "answer": str(answer)}
    return _SLOT.sub(lambda m: values[m[1]], template)


def parse_verdict(text: str | dict[str, float], cfg: RewardSource) -> float | None:
    """The verdict in the judge's answer: the first number, scaled from score_range to [0, 1] (None if
    outside it), or the choice that appears first (whole words, any case); None if there is none. Under
    verdict probability the answer is the judge's top first tokens and their probabilities (top_tokens)."""
    if cfg.verdict == "probability":
        return choice_probability(text, cfg.choices, cfg.judge_min_choice_mass)
    if cfg.verdict == "number":
        m = _NUMBER.search(text)
        low, high = cfg.score_range
        if m is None or not low <= float(m[0]) <= high:
            return None
        return (float(m[0]) - low) / (high - low)
    found = [(m.start(), c) for c in cfg.choices for m in [re.search(rf"\b{re.escape(c)}\b", text, re.IGNORECASE)] if m]
    return cfg.choices[min(found)[1]] if found else None


def choice_probability(tokens: dict[str, float], choices: dict[str, float], min_mass: float = 0.0) -> float | None:
    """The choices' scores weighted by the judge's probability of each as its first token (a token read
    stripped, any case), over the choices among its top tokens; None if their probabilities sum to less than
    min_mass (or to 0): the judge meant to say something else, and a ratio of two small numbers is no verdict."""
    mass = dict.fromkeys(choices, 0.0)
    for token, p in tokens.items():
        for c in choices:
            if token.strip().lower() == c.lower():
                mass[c] += p
    total = sum(mass.values())
    return sum(p * choices[c] for c, p in mass.items()) / total if total > 0 and total >= min_mass else None


def check_choice_tokens(tokenizer, choices: dict[str, float]) -> None:
    """verdict probability reads single first tokens: each choice must be one token of the judge's tokenizer,
    bare or after a space, else its probability would never be counted and the others' would win."""
    for c in choices:
        if not any(len(tokenizer(v, add_special_tokens=False).input_ids) == 1 for v in (c, " " + c)):
            raise ValueError(
                f"judge choices: {c!r} is several tokens of the judge's tokenizer (verdict probability reads one "
                "first token); pick one-token words, or verdict: choice"
            )


def digest(question: str) -> str:
    """A question's cache key: 128 bits of its SHA-256, so a checkpointed cache holds no text."""
    return hashlib.sha256(question.encode()).hexdigest()[:32]


class JudgeSource:
    """Owns the judge backend, the cache of its verdicts and the source's config."""

    def __init__(self, cfg: RewardSource, backend):
        self.cfg, self.backend = cfg, backend
        self.cache: OrderedDict[str, float | None] = OrderedDict()  # the filled template's digest -> verdict

    def state_dict(self) -> dict:
        return {"verdicts": list(self.cache.items())}  # oldest first, as the cache drops them

    def load_state_dict(self, state: dict) -> None:
        self.cache = OrderedDict((key, verdict) for key, verdict in state["verdicts"])

    def score(self, prompts: list[str], responses: list[str], metadata: list[dict]) -> JudgeResult:
        """Counts, over this call's samples: judged (new questions sent to the judge, each once), cache_hits
        (samples whose question was asked before, in this call or an earlier one), parse_failures (answers
        with no verdict), too_long (questions over the judge's context, never sent), seconds (the call)."""
        start = time.perf_counter()
        questions = [
            judge_prompt(self.cfg.template, p, r, m.get("answer")) for p, r, m in zip(prompts, responses, metadata)
        ]
        keys = [digest(q) for q in questions]
        todo = list(dict.fromkeys(k for k in keys if k not in self.cache))  # a group's samples often repeat
        text = dict(zip(keys, questions))
        ask = self.backend.top_tokens if self.cfg.verdict == "probability" else self.backend.generate
        answers = ask([text[k] for k in todo]) if todo else []
        if len(answers) != len(todo):
            raise ValueError(f"the judge gave {len(answers)} answers for {len(todo)} questions")
        failures = too_long = 0
        for key, answer in zip(todo, answers):
            verdict = None if answer is None else parse_verdict(answer, self.cfg)
            too_long += answer is None
            failures += answer is not None and verdict is None
            self.cache[key] = verdict
        scores = [self.cache[k] for k in keys]  # before the oldest verdicts leave the cache
        while len(self.cache) > CACHE_SIZE:
            self.cache.popitem(last=False)
        counts = {
            "judge/judged": float(len(todo) - too_long),
            "judge/cache_hits": float(len(keys) - len(todo)),
            "judge/parse_failures": float(failures),
            "judge/too_long": float(too_long),
            "judge/seconds": time.perf_counter() - start,
        }
        return JudgeResult(scores, counts)


def as_chat(tokenizer, texts: list[str], chat: bool) -> list[str]:
    """Each filled template as one user turn of the tokenizer's chat template (if chat and it has one)."""
    if not (chat and tokenizer.chat_template):
        return texts
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True)
        for t in texts
    ]


def token_probs(tokens: list[str], probs: list[float]) -> dict[str, float]:
    """First-token text -> probability, summed over tokens that decode alike."""
    out: dict[str, float] = {}
    for t, p in zip(tokens, probs):
        out[t] = out.get(t, 0.0) + p
    return out


class LocalJudge:
    """A causal LM folder run greedily in this process by transformers."""

    def __init__(self, path: str, max_new_tokens: int, micro_batch_size: int, device, dtype: str, chat: bool = True):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
        self.max_new_tokens, self.micro_batch_size, self.device = max_new_tokens, micro_batch_size, device
        self.chat = chat
        config = self.model.config  # GPT-2 names its context n_positions
        self.context = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)

    def _fits(self, texts: list[str], max_new_tokens: int) -> list[bool]:
        """Which texts, with the answer's tokens, fit the model's context (the others are not judged)."""
        chat = self.chat and bool(self.tokenizer.chat_template)
        if not self.context:
            return [True] * len(texts)
        rendered = as_chat(self.tokenizer, texts, chat)
        return [
            len(self.tokenizer(t, add_special_tokens=not chat).input_ids) + max_new_tokens <= self.context
            for t in rendered
        ]

    def _run(self, texts: list[str], **kwargs):
        """(batch, output) of model.generate per micro-batch: it derives positions from the left-padded mask."""
        import torch

        chat = self.chat and bool(self.tokenizer.chat_template)  # a chat template holds its own special tokens
        texts = as_chat(self.tokenizer, texts, chat)
        for s in range(0, len(texts), self.micro_batch_size):
            part = texts[s : s + self.micro_batch_size]
            batch = self.tokenizer(part, return_tensors="pt", padding=True, add_special_tokens=not chat)
            with torch.no_grad():
                yield (
                    batch,
                    self.model.generate(
                        **batch.to(self.device),
                        do_sample=False,
                        pad_token_id=self.tokenizer.pad_token_id,
                        return_dict_in_generate=True,
                        **kwargs,
                    ),
                )

    def generate(self, texts: list[str]) -> list[str | None]:
        fits, out = self._fits(texts, self.max_new_tokens), []
        for batch, gen in self._run(kept(texts, fits), max_new_tokens=self.max_new_tokens):
            out += self.tokenizer.batch_decode(gen.sequences[:, batch.input_ids.shape[1] :], skip_special_tokens=True)
        return in_place(fits, out)

    def top_tokens(self, texts: list[str]) -> list[dict[str, float] | None]:
        fits, out = self._fits(texts, 1), []
        for _, gen in self._run(kept(texts, fits), max_new_tokens=1, output_logits=True):
            first = gen.logits[0].float().softmax(-1)  # the first new token's distribution, one row per text
            top = first.topk(min(TOP_TOKENS, first.shape[-1]), -1)
            for ids, row in zip(top.indices.tolist(), top.values.tolist()):
                out.append(token_probs([self.tokenizer.decode([i]) for i in ids], row))
        return in_place(fits, out)


def kept(texts: list, fits: list[bool]) -> list:
    return [t for t, ok in zip(texts, fits) if ok]


def in_place(fits: list[bool], results: list) -> list:
    """One result per fitting text, put back in the texts' order; None where a text did not fit (not judged)."""
    results = iter(results)
    return [next(results) if ok else None for ok in fits]


class VLLMJudge:
    """The judge's own frozen vLLM engine: greedy, the batch in one call. Its engine core runs in a child
    process, so vLLM's CPU thread binding (it pins threads and disables torch.set_num_threads in the
    process that runs the model) stays out of the scoring service's reference forward."""

    def __init__(self, cfg: RewardSource, device, dtype: str):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.judge_kv_cache_gb)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # relay eval runs it in the terminal's process
        from vllm import LLM, SamplingParams  # imported late: the environment above must be in place first

        extra = {"gpu_memory_utilization": cfg.judge_gpu_memory_utilization} if device.type == "cuda" else {}
        self.llm = LLM(
            model=cfg.model_path,
            dtype=dtype,
            enforce_eager=True,
            max_model_len=cfg.judge_max_model_len or None,  # None: the model's own context
            enable_prefix_caching=True,  # the template's shared text (rubric, few-shot examples) is computed once
            seed=0,
            max_logprobs=TOP_TOKENS,
            **extra,
        )
        self.params = SamplingParams(temperature=0.0, max_tokens=cfg.judge_max_tokens)
        self.first = SamplingParams(temperature=0.0, max_tokens=1, logprobs=TOP_TOKENS)
        self.tokenizer, self.chat = self.llm.get_tokenizer(), cfg.judge_chat_template
        self.context = self.llm.llm_engine.model_config.max_model_len
        # one call at a time: a call abandoned at its deadline still runs, and vLLM's LLM hands each call the
        # requests that finish while it runs, whichever call made them
        self.lock = threading.Lock()

    def _run(self, texts: list[str], params) -> list:
        """Each text's completion; None for one too long for the engine's context (not judged). Tokenized
        here, as LocalJudge does: special tokens added only to raw text (a chat template holds its own)."""
        from vllm.inputs import TokensPrompt

        chat = self.chat and bool(self.tokenizer.chat_template)
        ids = [self.tokenizer(t, add_special_tokens=not chat).input_ids for t in as_chat(self.tokenizer, texts, chat)]
        fits = [len(x) + params.max_tokens <= self.context for x in ids]
        with self.lock:
            prompts = [TokensPrompt(prompt_token_ids=x) for x in kept(ids, fits)]
            outs = self.llm.generate(prompts, params, use_tqdm=False)
        if len(outs) != sum(fits):
            raise ValueError(f"the judge's engine gave {len(outs)} completions for {sum(fits)} prompts")
        return in_place(fits, [o.outputs[0] for o in outs])

    def generate(self, texts: list[str]) -> list[str | None]:
        return [o.text if o else None for o in self._run(texts, self.params)]

    def top_tokens(self, texts: list[str]) -> list[dict[str, float] | None]:
        return [
            token_probs(
                [t.decoded_token or "" for t in o.logprobs[0].values()],
                [math.exp(t.logprob) for t in o.logprobs[0].values()],
            )
            if o
            else None
            for o in self._run(texts, self.first)
        ]


class OpenAIJudge:
    """Any OpenAI-compatible server: one /v1/completions request of the whole batch, greedy, under the
    source's timeout (the service's deadline stops a server that trickles)."""

    def __init__(self, url: str, model: str, max_new_tokens: int, timeout_s: float):
        self.url, self.model, self.max_new_tokens, self.timeout_s = url.rstrip("/"), model, max_new_tokens, timeout_s

    def _complete(self, texts: list[str], **extra) -> list[dict]:
        body = {"model": self.model, "prompt": texts, "max_tokens": self.max_new_tokens, "temperature": 0.0} | extra
        request = urllib.request.Request(
            f"{self.url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
            choices = json.loads(reply.read())["choices"]
        if len(choices) != len(texts):
            raise ValueError(f"the judge at {self.url} gave {len(choices)} completions for {len(texts)} prompts")
        return sorted(choices, key=lambda c: c.get("index", 0))

    def generate(self, texts: list[str]) -> list[str]:
        return [c["text"] for c in self._complete(texts)]

    def top_tokens(self, texts: list[str]) -> list[dict[str, float]]:
        """The completions API's top_logprobs of the first token ({} where the server gave none)."""
        out = []
        for c in self._complete(texts, max_tokens=1, logprobs=TOP_TOKENS):
            first = ((c.get("logprobs") or {}).get("top_logprobs") or [{}])[0] or {}
            out.append({t: math.exp(lp) for t, lp in first.items()})
        return out
