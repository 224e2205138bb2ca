"""The learner ranks of `relay sft` and `relay rm`: the RL learner's DeepSpeed engine (ZeRO 0-3,
Ray actors, one per rank) around a causal LM trained on the response tokens only, or a
sequence classifier with one scalar output trained with the Bradley-Terry loss.

Batches arrive whole (tensors); each rank takes rows rank, rank+world, ... and micro-batches them.
Losses are sums divided by the mini-batch's global count (tokens or pairs) and scaled to undo
DeepSpeed's mean over micro-batches and ranks, so any sharding gives the same update.
"""

from __future__ import annotations

import torch

from learner import algorithms as A
from learner.checkpoint import _gathered
from learner.config import LearnerConfig, SupervisedTrainConfig
from learner.engine import RankAddress, init_distributed, make_engine
from learner.group import RankPlacement, start_ranks
from learner.models import load_model, no_dropout_config
from learner.precision import policy_function
from learner.worker import seed_everything
from runtime import watchdog
from runtime.device import collective_backend, compute, process_device
from runtime.logprobs import chunked_logprobs

SFT, RM = "sft", "rm"


def build_model(cfg: LearnerConfig, kind: str, pad_token_id: int | None) -> torch.nn.Module:
    """The trained model: a causal LM (SFT) or a one-output sequence classifier (RM), without
    dropout, the learner's weight dtype (learner.models.load_model; cfg.dtype is the compute dtype), with gradient
    checkpointing when configured and the attention kernel of learner.attn_implementation (as the policy and
    critic; the stages pad their rows, learner.packing is the RL forwards')."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    config = no_dropout_config(cfg.model_path)
    if kind == RM:
        config.num_labels, config.pad_token_id = 1, pad_token_id  # pad marks each sequence's end
        model = load_model(AutoModelForSequenceClassification.from_pretrained, cfg, cfg.model_path, config=config)
    else:
        model = load_model(AutoModelForCausalLM.from_pretrained, cfg, cfg.model_path, config=config)
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


class SupervisedLearner:
    """One data-parallel rank of `relay sft` / `relay rm` (a Ray actor): owns its device, its process
    group, the trained model (a causal LM, or a scalar reward model) and its DeepSpeed engine."""

    def __init__(self, cfg: LearnerConfig, train: SupervisedTrainConfig, kind: str, seed: int, address: RankAddress):
        from transformers import AutoTokenizer

        rank, world_size = address.rank, address.world_size
        if address.threads:
            torch.set_num_threads(address.threads)
        self.device = process_device()
        init_distributed(address, collective_backend(self.device))
        seed_everything(seed + rank)
        self.cfg, self.train, self.kind, self.rank, self.world = cfg, train, kind, rank, world_size
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model_path)
        model = build_model(cfg, kind, self.tokenizer.pad_token_id)
        self.grad_accum = train.batch_size // (train.micro_batch_size * world_size)
        self.engine = make_engine(model, cfg, cfg.lr, train.micro_batch_size, self.grad_accum)

    def ready(self) -> bool:
        return True

    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        """One optimizer step on a mini-batch. Returns this rank's sums (the group adds them up)."""
        self.engine.train()
        total = float(batch["loss_mask"].sum()) if self.kind == SFT else float(len(batch["chosen_ids"]))
        scale = self.grad_accum * self.world
        parts = []
        for rows in self._micro_batches(batch):
            loss_sum, stats = self._loss(batch, rows)
            self.engine.backward(loss_sum / total * scale)
            self.engine.step()
            stats.pop("rewards", None)
            parts.append(stats)
        sums = _add(parts)
        sums["grad_norm"] = float(self.engine.get_global_grad_norm() or 0.0) if self.rank == 0 else 0.0
        return sums

    @torch.no_grad()
    def evaluate(self, batch: dict[str, torch.Tensor]) -> dict:
        """This rank's loss sums on its share of `batch`, and (RM) every reward it computed."""
        self.engine.eval()
        return _add([self._loss(batch, rows)[1] for rows in self._micro_batches(batch)])

    def _micro_batches(self, batch: dict[str, torch.Tensor]):
        n = len(next(iter(batch.values())))
        mine = torch.arange(self.rank, n, self.world)
        for j in range(0, len(mine), self.train.micro_batch_size):
            yield mine[j : j + self.train.micro_batch_size]

    def _loss(self, batch: dict[str, torch.Tensor], rows: torch.Tensor) -> tuple[torch.Tensor, dict]:
        if self.kind == SFT:
            with compute(self.cfg.dtype, self.device, policy_function(self.cfg).weights):
                logits = self.engine(
                    input_ids=batch["input_ids"][rows], attention_mask=batch["attention_mask"][rows]
                ).logits
            ids = batch["input_ids"][rows]  # A.sft_loss_sum, without a float32 (B, L, V) copy of the logits
            logprobs = chunked_logprobs(logits[:, :-1], ids[:, 1:], 1.0, self.cfg.logprob_chunk_tokens)
            loss_sum = -A.masked_sum(logprobs, batch["loss_mask"][rows])
            return loss_sum, {"loss_sum": loss_sum.item(), "count": float(batch["loss_mask"][rows].sum())}
        chosen = self._reward(batch["chosen_ids"][rows], batch["chosen_attention"][rows])
        rejected = self._reward(batch["rejected_ids"][rows], batch["rejected_attention"][rows])
        loss_sum = A.bradley_terry_loss(chosen, rejected, self.train.margin).sum()
        return loss_sum, {
            "loss_sum": loss_sum.item(),
            "count": float(len(rows)),
            "correct": float((chosen > rejected).sum()),
            "rewards": chosen.tolist() + rejected.tolist(),
        }

    def _reward(self, ids: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        with compute(self.cfg.dtype, self.device, policy_function(self.cfg).weights):
            return self.engine(input_ids=ids, attention_mask=attention).logits[:, 0].float()

    def save(self, path: str) -> None:
        """The model as a plain Hugging Face folder, with its tokenizer (rank 0 writes)."""
        with _gathered(self.engine.module, self.cfg.zero_stage == 3):  # collective under ZeRO-3
            if self.rank == 0:
                self.engine.module.save_pretrained(path, safe_serialization=True)
                self.tokenizer.save_pretrained(path)


class SupervisedGroup:
    """The ranks of one sft/rm run behind one call per phase (launch all, ray.get once)."""

    def __init__(self, cfg: LearnerConfig, train: SupervisedTrainConfig, kind: str, world_size: int, seed: int):
        self.ranks = start_ranks(
            SupervisedLearner,
            world_size,
            lambda rank, addr, port, threads: (
                cfg,
                train,
                kind,
                seed,
                RankAddress(rank, world_size, addr, port, threads),
            ),
            RankPlacement(threads=cfg.threads),
        )

    def _all(self, method: str, *args) -> list:

        return watchdog.get([getattr(r, method).remote(*args) for r in self.ranks])

    def train_step(self, batch: dict[str, torch.Tensor]) -> dict[str, float]:
        return _add(self._all("train_step", batch))

    def evaluate(self, batch: dict[str, torch.Tensor]) -> dict:
        return _add(self._all("evaluate", batch))

    def save(self, path: str) -> None:
        self._all("save", path)

    def shutdown(self) -> None:
        import ray

        for r in self.ranks:
            ray.kill(r)
        self.ranks = []


def _add(parts: list[dict]) -> dict:
    out: dict = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, [] if isinstance(v, list) else 0.0) + v
    return out
