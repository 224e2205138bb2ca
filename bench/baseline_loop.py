"""The plain single-process GRPO loop that relay is measured against (issue 16).

    .venv/bin/python -m bench.baseline_loop [--config configs/grpo_tiny_cpu.yaml] [--steps 10] [key=value ...]

What a user writes with transformers and torch alone, as TRL's GRPOTrainer does it: Hugging Face
`generate` (KV cache) for the samples, a reference forward, the rule reward, group-normalised
advantages, one forward/backward over the completions, AdamW. It reads the same relay config and
trains on the same prompts with the same loss (PPO clip, k3 KL to the reference in the loss, token
mean over the mini-batch) and the same optimizer settings, in the learner's dtype (bfloat16 as
relay and PyTorch AMP do it: autocast over float32 weights, runtime.device.compute). Old logprobs
are the current ones, detached, when one epoch of one mini-batch cannot move them (TRL's rule);
otherwise a no-grad forward computes them first. Relay's own code is used only where the two must
agree exactly: the data, prompt encoding and the reward function.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from learner.config import Estimator, KLControllerKind, KLPlacement, LossAggregation, PolicyLoss
from learner.models import no_dropout_config
from orchestrator.config.load import load_config
from orchestrator.config.schema import TrainConfig
from orchestrator.data.builtin_models import resolve_model_path
from orchestrator.data.prompts import PromptSampler, load_split, policy_prompt, reward_metadata
from reward_service.service import RewardFunction
from runtime.device import compute
from runtime.prompts import encode_prompt

REPO = Path(__file__).resolve().parents[1]
PHASES = ("generate", "score", "update", "total")


def supported(cfg: TrainConfig) -> None:
    """The baseline is plain GRPO; say which setting it does not implement rather than run another algorithm."""
    a = cfg.algorithm
    wrong = {
        "algorithm.estimator": (a.estimator, Estimator.grpo),
        "algorithm.kl_placement": (a.kl_placement, KLPlacement.loss),
        "algorithm.kl_controller": (a.kl_controller, KLControllerKind.fixed),
        "algorithm.loss_aggregation": (a.loss_aggregation, LossAggregation.token_mean),
        "algorithm.policy_loss": (a.policy_loss, PolicyLoss.ppo),
        "learner.lora.rank": (cfg.learner.lora.rank, 0),
        "data.dynamic_sampling": (cfg.data.dynamic_sampling, False),
    }
    bad = [f"{k}: {v[0]!s} (needs {v[1]!s})" for k, v in wrong.items() if v[0] != v[1]]
    if bad:
        raise ValueError("bench.baseline_loop implements plain GRPO only; " + "; ".join(bad))


def token_logprobs(model, ids: torch.Tensor, attention: torch.Tensor, temperature: float, dtype: str) -> torch.Tensor:
    """log p(token t+1 | ..t) at the sampling temperature, (B, L-1), the forward computed in `dtype`."""
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    with compute(dtype, ids.device):
        logits = model(input_ids=ids, attention_mask=attention, position_ids=positions, use_cache=False).logits[:, :-1]
    return torch.gather(F.log_softmax(logits.float() / temperature, -1), -1, ids[:, 1:, None]).squeeze(-1)


class BaselineLoop:
    def __init__(self, cfg: TrainConfig, threads: int = 0):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        supported(cfg)
        if threads:
            torch.set_num_threads(threads)
        torch.manual_seed(cfg.seed)
        self.cfg, self.a, self.s = cfg, cfg.algorithm, cfg.rollout.sampling
        path = resolve_model_path(cfg.learner.model_path, cfg.run_root)
        self.dtype = cfg.learner.dtype.value
        self.tok = AutoTokenizer.from_pretrained(path)
        self.pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.tok.eos_token_id

        def load():
            return AutoModelForCausalLM.from_pretrained(path, config=no_dropout_config(path), dtype=torch.float32)

        self.policy, self.ref = load(), load().eval().requires_grad_(False)
        L = cfg.learner
        self.opt = torch.optim.AdamW(
            self.policy.parameters(), lr=L.lr, betas=tuple(L.betas), weight_decay=L.weight_decay
        )
        self.reward = RewardFunction(cfg.reward)
        self.train, self.held_out, _ = load_split(cfg.data, cfg.seed)
        self.sampler = PromptSampler(len(self.train), cfg.seed, cfg.data.shuffle)

    def _encode(self, examples: list[dict]) -> list[list[int]]:
        r = self.cfg.rollout
        ids = [
            encode_prompt(
                self.tok,
                policy_prompt(e["prompt"], self.cfg.data.apply_chat_template),
                r.max_prompt_tokens,
                r.prompt_overflow,
            )[0]
            for e in examples
        ]
        if any(i is None for i in ids):
            raise ValueError("bench.baseline_loop: a prompt is unusable (relay would skip it); use other data")
        return ids

    @torch.no_grad()
    def generate(self, examples: list[dict], greedy: bool = False):
        """(ids (B*n, P+T), attention, response mask (B*n, P+T-1) aligned with token_logprobs, texts)."""
        prompts = self._encode(examples)
        width = max(map(len, prompts))
        ids = torch.tensor([[self.pad] * (width - len(p)) + p for p in prompts])
        attention = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
        n = 1 if greedy else self.s.n_samples_per_prompt
        options = (
            {"do_sample": False}
            if greedy
            else {
                "do_sample": True,
                "temperature": self.s.temperature,
                "num_return_sequences": n,
                "top_k": self.s.top_k if self.s.top_k > 0 else None,
                "top_p": self.s.top_p,
            }
        )
        self.policy.eval()
        with compute(self.dtype, ids.device):
            out = self.policy.generate(
                input_ids=ids,
                attention_mask=attention,
                max_new_tokens=self.s.max_new_tokens,
                pad_token_id=self.pad,
                eos_token_id=self.tok.eos_token_id,
                **options,
            )
        response = out[:, width:]
        is_eos = response == self.tok.eos_token_id
        after_eos = (is_eos.cumsum(-1) - is_eos.long()) > 0  # tokens after the first EOS (which itself counts)
        keep = ~after_eos
        texts = [self.tok.decode(r[k & ~e], skip_special_tokens=True) for r, k, e in zip(response, keep, is_eos)]
        full_attention = torch.cat([attention.repeat_interleave(n, 0), keep.long()], -1)
        mask = torch.cat([torch.zeros(len(out), width - 1), keep.float()], -1)
        return out, full_attention, mask, texts

    def rewards(self, examples: list[dict], texts: list[str], n: int) -> tuple[torch.Tensor, torch.Tensor]:
        meta = [reward_metadata(e, self.cfg.data.apply_chat_template) for e in examples for _ in range(n)]
        scores = self.reward([m["prompt"] for m in meta], texts, meta)
        valid = torch.tensor([s is not None for s in scores])
        return torch.tensor([s if s is not None else 0.0 for s in scores]), valid

    def advantages(self, scores: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """GRPO: minus the group mean, over the group std (unbiased), over valid samples only."""
        n = self.s.n_samples_per_prompt
        g, v = scores.view(-1, n), valid.view(-1, n).float()
        count = v.sum(-1, keepdim=True)
        centred = (g - (g * v).sum(-1, keepdim=True) / count.clamp(min=1)) * v
        if self.a.grpo.scale_by_std:
            centred = centred / (((centred**2).sum(-1, keepdim=True) / (count - 1).clamp(min=1)).sqrt() + 1e-6)
        return torch.where(count >= 2, centred, 0.0).view(-1)

    def loss(self, ids, attention, mask, old, ref, adv, total: float) -> torch.Tensor:
        logp = token_logprobs(self.policy, ids, attention, self.s.temperature, self.dtype)
        old = logp.detach() if old is None else old
        ratio = torch.exp(logp - old)
        high = self.a.clip_eps_high or self.a.clip_eps
        pg = -torch.min(ratio * adv[:, None], ratio.clamp(1 - self.a.clip_eps, 1 + high) * adv[:, None])
        kl = torch.exp(ref - logp) - (ref - logp) - 1  # k3
        loss = pg + self.a.init_kl_coef * kl
        if self.a.entropy_coef:
            raise ValueError("bench.baseline_loop: algorithm.entropy_coef must be 0")
        return (loss * mask).sum() / total

    def step(self) -> dict[str, float]:
        t: dict[str, float] = {}
        start = time.perf_counter()
        examples = [self.train[i] for i in self.sampler.next(self.cfg.data.rollout_batch_size)]
        ids, attention, mask, texts = self.generate(examples)
        t["generate"] = time.perf_counter() - start
        with torch.no_grad():
            micro = self.a.micro_batch_size
            ref = torch.cat(
                [
                    token_logprobs(
                        self.ref, ids[i : i + micro], attention[i : i + micro], self.s.temperature, self.dtype
                    )
                    for i in range(0, len(ids), micro)
                ]
            )
            scores, valid = self.rewards(examples, texts, self.s.n_samples_per_prompt)
            mask = mask * valid[:, None]
            adv = self.advantages(scores, valid)
        t["score"] = time.perf_counter() - start - t["generate"]
        self._update(ids, attention, mask, ref, adv)
        t["total"] = time.perf_counter() - start
        t["update"] = t["total"] - t["generate"] - t["score"]
        return {**t, "reward": float(scores[valid].mean()) if valid.any() else float("nan")}

    def _update(self, ids, attention, mask, ref, adv) -> None:
        micro, mini, epochs = self.a.micro_batch_size, self.a.mini_batch_size, self.a.ppo_epochs
        old = None
        if epochs > 1 or mini < len(ids):  # the weights move before the last mini-batch: old logprobs first
            with torch.no_grad():
                self.policy.eval()
                old = torch.cat(
                    [
                        token_logprobs(
                            self.policy, ids[i : i + micro], attention[i : i + micro], self.s.temperature, self.dtype
                        )
                        for i in range(0, len(ids), micro)
                    ]
                )
        self.policy.train()
        for epoch in range(epochs):
            order = torch.randperm(len(ids))
            for i in range(0, len(ids), mini):
                rows = order[i : i + mini]
                total = max(float(mask[rows].sum()), 1e-8)
                for j in range(0, len(rows), micro):
                    r = rows[j : j + micro]
                    self.loss(
                        ids[r], attention[r], mask[r], None if old is None else old[r], ref[r], adv[r], total
                    ).backward()
                if self.cfg.learner.grad_clip > 0:
                    torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.cfg.learner.grad_clip)
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)

    def greedy_accuracy(self) -> float:
        """Mean reward of greedy answers on the held-out prompts (the accuracy for a 0/1 verifiable reward)."""
        scores = []
        for i in range(0, len(self.held_out), 64):
            part = self.held_out[i : i + 64]
            _, _, _, texts = self.generate(part, greedy=True)
            s, v = self.rewards(part, texts, 1)
            scores += s[v].tolist()
        return statistics.fmean(scores)


def run_baseline(cfg: TrainConfig, steps: int, threads: int = 0, evaluate: bool = True) -> dict:
    """{"rows": per-step timings, "before"/"after": held-out greedy accuracy (None without evaluate)}."""
    loop = BaselineLoop(cfg, threads)
    before = loop.greedy_accuracy() if evaluate else None
    rows = [loop.step() for _ in range(steps)]
    return {"rows": rows, "before": before, "after": loop.greedy_accuracy() if evaluate else None}


def medians(rows: list[dict], phases=PHASES, warmup: int = 2) -> dict[str, float]:
    timed = rows[warmup:] if len(rows) > warmup else rows
    return {ph: statistics.median(r[ph] for r in timed) for ph in phases}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default=str(REPO / "configs" / "grpo_tiny_cpu.yaml"))
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("overrides", nargs="*")
    args = p.parse_args()
    cfg = load_config(args.config, [f"run_root={REPO / 'runs'}", *args.overrides])
    out = run_baseline(cfg, args.steps)
    med = medians(out["rows"])
    for ph in PHASES:
        print(f"{ph:9s} {med[ph]:7.3f} s")
    print(f"held-out greedy accuracy {out['before']:.3f} -> {out['after']:.3f}")
    print(
        json.dumps(
            {**{f"{ph}_s": round(v, 3) for ph, v in med.items()}, "before": out["before"], "after": out["after"]}
        )
    )


if __name__ == "__main__":
    main()
