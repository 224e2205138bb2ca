"""Can a judge model tell a right answer from a near miss? The question a `kind: judge` preset stands on.

    .venv/bin/python -m bench.judge_probe [--model builtin://smollm2-135m-instruct] [--pairs 64]

For 2-digit sums, each right answer and a near miss (the sum moved by 1-10, the mistakes the tiny policy
makes) go through each template, with the reference answer in it, as relay's judge sends them: the three
instructions as a chat turn, and the few-shot template of configs/judge_tiny_cpu.yaml as raw text (its
judge_chat_template: false). Two readings of the judge:
  greedy   its answer, parsed as yes / no (reward_service.judge.parse_verdict's rule: the first word found)
  p(yes)   P(yes) / (P(yes) + P(no)) at its first answer token, and the AUC of that over the pairs
            (1.0: it always ranks the right answer above the miss; 0.5: chance)
Prints a table and a final JSON line.
"""

from __future__ import annotations

import argparse
import json
import random

import torch

TEMPLATES = [  # (template, sent as a chat turn)
    (
        "Reference answer: {answer}\nStudent answer: {response}\nDoes the student answer match the reference? "
        "Answer yes or no.",
        True,
    ),
    ("Is {response} equal to {answer}? Answer with yes or no.", True),
    ("What is {prompt}? Someone answered {response}. Is that correct? Answer yes or no.", True),
]
PRESET = "configs/judge_tiny_cpu.yaml"  # its judge's few-shot template, probed raw as the preset sends it


def pairs(n: int, seed: int) -> list[tuple[str, str, str, bool]]:
    """(prompt, response, answer, right) for n sums: the right answer and a near miss of each."""
    rng, out = random.Random(seed), []
    for _ in range(n):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        miss = a + b + rng.choice([-1, 1]) * rng.randint(1, 10)
        out += [(f"{a}+{b}", str(a + b), str(a + b), True), (f"{a}+{b}", str(miss), str(a + b), False)]
    return out


def auc(right: list[float], wrong: list[float]) -> float:
    return sum((r > w) + 0.5 * (r == w) for r in right for w in wrong) / (len(right) * len(wrong))


def probe(model, tokenizer, template: str, chat: bool, items) -> dict:
    from reward_service.judge import as_chat, judge_prompt

    texts = as_chat(tokenizer, [judge_prompt(template, p, r, a) for p, r, a, _ in items], chat)
    enc = tokenizer(texts, return_tensors="pt", padding=True)
    with torch.no_grad():
        first = model(**enc).logits[:, -1].log_softmax(-1).exp()
        out = model.generate(**enc, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    words = tokenizer.batch_decode(out[:, enc.input_ids.shape[1] :], skip_special_tokens=True)
    ids = {
        w: [
            tokenizer(v, add_special_tokens=False).input_ids[0]
            for v in (w, w.capitalize(), " " + w, " " + w.capitalize())
        ]
        for w in ("yes", "no")
    }
    p_yes = (first[:, ids["yes"]].sum(-1) / (first[:, ids["yes"]].sum(-1) + first[:, ids["no"]].sum(-1))).tolist()
    said = [w.strip().lower().split(",")[0].split(".")[0].split(" ")[0] for w in words]
    right = [i for i, it in enumerate(items) if it[3]]
    wrong = [i for i, it in enumerate(items) if not it[3]]
    return {
        "yes_when_right": sum(said[i] == "yes" for i in right) / len(right),
        "yes_when_wrong": sum(said[i] == "yes" for i in wrong) / len(wrong),
        "unparsed": sum(s not in ("yes", "no") for s in said) / len(said),
        "auc_p_yes": auc([p_yes[i] for i in right], [p_yes[i] for i in wrong]),
    }


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from orchestrator.config.load import load_config
    from orchestrator.data.builtin_models import resolve_model_path
    from reward_service.config import SourceKind

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="builtin://smollm2-135m-instruct")
    ap.add_argument("--pairs", type=int, default=64)
    args = ap.parse_args()
    path = resolve_model_path(args.model, "runs")
    tokenizer = AutoTokenizer.from_pretrained(path, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    items, rows = pairs(args.pairs, seed=0), []
    preset = next(s for s in load_config(PRESET, []).reward.sources if s.kind == SourceKind.judge)
    print(f"{'template':60s} {'yes|right':>9s} {'yes|miss':>9s} {'unparsed':>9s} {'AUC p(yes)':>10s}")
    for template, chat in TEMPLATES + [(preset.template, preset.judge_chat_template)]:
        row = {"template": template, "chat": chat, **probe(model, tokenizer, template, chat, items)}
        rows.append(row)
        name = template[:58] if chat else f"{PRESET} (8 worked examples, raw)"
        print(
            f"{name.replace(chr(10), ' ')!s:60s} {row['yes_when_right']:9.3f} {row['yes_when_wrong']:9.3f} "
            f"{row['unparsed']:9.3f} {row['auc_p_yes']:10.3f}"
        )
    print(json.dumps({"model": args.model, "pairs": args.pairs, "rows": rows}))


if __name__ == "__main__":
    main()
