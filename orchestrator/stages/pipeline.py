"""`relay pipeline CONFIG`: the classic three-stage RLHF recipe, each stage's output feeding the next.

SFT (demonstrations)           -> runs/<name>/sft/model
RM  (preference pairs), from the SFT model          -> runs/<name>/rm/model
PPO: policy = SFT model, reward = the RM (a critic, if any, may start from the RM) -> runs/<name>/ppo
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from learner.supervised import RM, SFT
from orchestrator.config.load import ConfigError
from orchestrator.config.rules_learner import critic_path_used
from orchestrator.config.schema import PipelineConfig, TrainConfig
from orchestrator.config.validate import validate
from orchestrator.stages.supervised import run_stage
from reward_service.config import SourceKind


def run_pipeline(cfg: PipelineConfig) -> dict:
    sft_cfg = dataclasses.replace(cfg.sft, name=f"{cfg.name}/sft", run_root=cfg.run_root)
    sft_model = run_stage(sft_cfg, SFT)
    rm_learner = dataclasses.replace(cfg.rm.learner, model_path=cfg.rm.learner.model_path or str(sft_model))
    rm_model = run_stage(
        dataclasses.replace(cfg.rm, name=f"{cfg.name}/rm", run_root=cfg.run_root, learner=rm_learner), RM
    )
    ppo = ppo_stage(cfg, sft_model, rm_model)
    from orchestrator.loop.trainer import Trainer

    trainer = Trainer(ppo)
    try:
        after = trainer.run()
    finally:
        trainer.shutdown()
    print(f"relay pipeline: SFT {sft_model}, RM {rm_model}, PPO run {Path(ppo.run_root) / ppo.name}", flush=True)
    return after


def ppo_stage(cfg: PipelineConfig, sft_model: Path, rm_model: Path) -> TrainConfig:
    """The PPO section with the earlier stages' paths filled in where it left them empty: the policy
    (and reference) is the SFT model; reward_model sources and a critic initialised from a reward
    model get the RM."""
    ppo = cfg.ppo
    sources = [
        dataclasses.replace(s, model_path=s.model_path or str(rm_model)) if s.kind == SourceKind.reward_model else s
        for s in ppo.reward.sources
    ]
    learner = dataclasses.replace(ppo.learner, model_path=ppo.learner.model_path or str(sft_model))
    if critic_path_used(ppo):
        learner = dataclasses.replace(learner, critic_model_path=learner.critic_model_path or str(rm_model))
    ppo = dataclasses.replace(
        ppo,
        name=f"{cfg.name}/ppo",
        run_root=cfg.run_root,
        learner=learner,
        reward=dataclasses.replace(ppo.reward, sources=sources),
    )
    for key, problem in validate(ppo):
        raise ConfigError(f"ppo.{key}: {problem}")
    return ppo
