"""What the training loop drives, built for a run: the data split, Ray, the roles, the batch source
and the evaluator on them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from orchestrator.config.correction import resolve_corrections
from orchestrator.config.lora import resolve_lora_sync
from orchestrator.config.schema import TrainConfig
from orchestrator.data.builtin_models import resolve_model_path, resolve_run_judges
from orchestrator.data.prompts import load_split
from orchestrator.loop.batches import EndpointBatches, PromptBatches
from orchestrator.loop.evaluator import Evaluator
from orchestrator.loop.roles import Roles, init_ray, start_roles
from orchestrator.tools.suites import load_suites


@dataclass
class LoopParts:
    """What the loop drives, built by start_parts (tests build it from small real parts)."""

    roles: Roles
    batches: PromptBatches | EndpointBatches
    evaluator: Evaluator
    skipped_lines: int  # data lines load_split skipped


def start_parts(cfg: TrainConfig, run_dir: Path) -> LoopParts:
    """The data split (bad data fails first), Ray, every role, and the batch source and evaluator on them."""
    train, held_out, skipped_lines = load_split(cfg.data, cfg.seed)
    suites = load_suites(cfg, train)
    model_path = resolve_model_path(cfg.learner.model_path, cfg.run_root)
    resolve_run_judges(cfg)
    resolve_corrections(cfg)  # load_config did, and said so; a config built in code gets the same choice
    for line in resolve_lora_sync(cfg):  # a config built in code: said here (load_config said a file's)
        print(f"relay: {line}", flush=True)
    init_ray(cfg)
    r = start_roles(cfg, model_path)
    if r.gateway is not None:  # an agent program's finished episodes, not data prompts
        batches = EndpointBatches(cfg, r.gateway)
    else:
        batches = PromptBatches(cfg, train, r.rollout, r.scoring, r.restart_rollout)
    evaluator = Evaluator(cfg, held_out, run_dir, r.rollout, r.scoring, r.learner, suites)
    return LoopParts(r, batches, evaluator, skipped_lines)
