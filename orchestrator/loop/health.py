"""Training health: the signs of a run going wrong that RLHF practice teaches, read from the metric
stream after every step, each said once, in one line, with its likely cause and the knob to turn.

Each sign is a pure function of the recent steps' metrics (oldest first), the first steps' (the run's own
baseline) and the held-out evaluation before training, returning what it saw or None. A sign warns when
it turns on, and again only after it has cleared; `health/<sign>` counts its warnings (in metrics.jsonl
and wandb). Thresholds are `health.*` in the config (HealthConfig). A sign whose metrics a run does not
report (a value loss without a critic, the groups' spread with one sample a prompt) stays silent.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from orchestrator.config.schema import HealthConfig

Rows = list[dict[str, float]]


@dataclass(frozen=True)
class Sign:
    """One sign: its name (health/<name>), how to see it, and what to tell the user."""

    name: str
    check: Callable[[HealthConfig, Health], str | None]  # what it saw in the Health's records, or None
    advice: str  # the likely cause and the knob


def _values(rows: Rows, key: str) -> list[float]:
    return [r[key] for r in rows if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])]


def _held(cfg: HealthConfig, rows: Rows, key: str, test: Callable[[float], bool]) -> list[float] | None:
    """The last `patience` values of `key` if there are that many and each passes `test`, else None."""
    last = _values(rows, key)[-cfg.patience :]
    return last if len(last) == cfg.patience and all(test(v) for v in last) else None


def _halves(rows: Rows, key: str) -> tuple[float, float] | None:
    """The means of the older and the newer half of the window's values of `key`."""
    v = _values(rows, key)
    if len(v) < 4:
        return None
    return statistics.fmean(v[: len(v) // 2]), statistics.fmean(v[len(v) // 2 :])


def kl_band(cfg: HealthConfig, h: Health) -> str | None:
    if last := _held(cfg, h.recent, "kl/ref", lambda v: v > cfg.kl_high):
        return f"the per-token KL to the reference stayed over {cfg.kl_high} ({last[-1]:.3f}): the policy drifts"
    if h.seen < cfg.window + cfg.patience:  # the policy starts at the reference: a small KL early on is no sign
        return None
    if last := _held(cfg, h.recent, "kl/ref", lambda v: v < cfg.kl_low):
        return f"the per-token KL to the reference stayed under {cfg.kl_low} ({last[-1]:.4f}): the policy barely moves"
    return None


def _fell(cfg: HealthConfig, h: Health, key: str, share: float, what: str) -> str | None:
    """`key` held under `share` of its first steps' mean for `patience` steps."""
    start = _values(h.first, key)
    if len(start) < cfg.window:
        return None
    base = statistics.fmean(start)
    if last := _held(cfg, h.recent, key, lambda v: v < share * base):
        return f"{what} fell to {last[-1]:.4f}, under {share:g}x its first steps' {base:.4f}"
    return None


def entropy_collapse(cfg: HealthConfig, h: Health) -> str | None:
    return _fell(cfg, h, "learner/entropy", cfg.entropy_floor, "the entropy")


def length_hacking(cfg: HealthConfig, h: Health) -> str | None:
    length, reward = _halves(h.recent, "response/length_mean"), _halves(h.recent, "reward/mean")
    if len(h.recent) < cfg.window or not length or not reward or length[0] <= 0:
        return None
    rise, gain = length[1] / length[0] - 1, reward[1] - reward[0]
    if rise > cfg.length_rise and abs(gain) < cfg.reward_flat:  # a falling reward is another trouble
        return f"the response length rose {rise:.0%} over {len(h.recent)} steps while the reward moved {gain:+.3f}"
    return None


def diversity_collapse(cfg: HealthConfig, h: Health) -> str | None:
    return _fell(cfg, h, "response/distinct_2", cfg.distinct_floor, "distinct-2 of the responses")


HELD_OUT = ("eval/greedy/reward/accuracy", "eval/sampled/reward/accuracy", "eval/sampled/reward/mean")


def reward_hacking(cfg: HealthConfig, h: Health) -> str | None:
    key = next((k for k in HELD_OUT if k in h.before and k in h.latest), None)
    train_then, train_now = _values(h.first, "reward/mean"), _values(h.recent, "reward/mean")
    if key is None or len(train_then) < cfg.window or not train_now:
        return None
    gain = statistics.fmean(train_now) - statistics.fmean(train_then)
    then, now = h.before[key], h.latest[key]
    prompts = h.before.get("eval/prompts")
    # an accuracy over P prompts moves by its noise, 2 sqrt(p (1 - p) / P), between two evaluations
    noise = 2 * math.sqrt(then * (1 - then) / prompts) if prompts and "accuracy" in key and 0 <= then <= 1 else 0
    if gain > cfg.reward_flat and then - now > max(cfg.held_out_drop, noise):
        name = key.removeprefix("eval/")
        return f"the training reward rose {gain:+.3f} while the held-out {name} fell {then:.3f} -> {now:.3f}"
    return None


def no_signal_groups(cfg: HealthConfig, h: Health) -> str | None:
    if last := _held(cfg, h.recent, "reward/zero_spread_groups", lambda v: v > cfg.zero_spread_max):
        return f"{last[-1]:.0%} of the prompt groups had all their samples score alike: they give no signal"
    return None


def value_loss_explosion(cfg: HealthConfig, h: Health) -> str | None:
    start, now = _values(h.first, "loss/value"), [r.get("loss/value") for r in h.recent[-1:]]
    if len(start) < cfg.window or not now or now[0] is None:
        return None
    base = statistics.median(start)
    if not math.isfinite(now[0]) or now[0] > cfg.value_loss_factor * max(base, 1e-8):
        return (
            f"the value loss reached {now[0]:.4g}, over {cfg.value_loss_factor:g}x its first steps' median {base:.4g}"
        )
    return None


def logprob_gap(cfg: HealthConfig, h: Health) -> str | None:
    start = _values(h.first, "rollout/logprob_gap")
    if len(start) < cfg.window:
        return None
    limit = max(cfg.logprob_gap_factor * statistics.median(start), cfg.logprob_gap_min)
    if last := _held(cfg, h.recent, "rollout/logprob_gap", lambda v: v > limit):
        return f"the sampler-learner logprob gap grew to {last[-1]:.4f}, over {limit:.4f}"
    return None


SIGNS = [
    Sign(
        "kl_band",
        kl_band,
        "the KL penalty against the learning rate: algorithm.init_kl_coef (or target_kl), learner.lr",
    ),
    Sign(
        "entropy_collapse",
        entropy_collapse,
        "the policy turns deterministic and stops exploring: lower learner.lr, raise algorithm.entropy_coef "
        "or algorithm.init_kl_coef",
    ),
    Sign(
        "length_hacking",
        length_hacking,
        "the reward pays for length, not quality: a length_penalty source or reward.overlong_max_tokens, "
        "algorithm.loss_aggregation, a lower rollout.sampling.max_new_tokens",
    ),
    Sign(
        "diversity_collapse",
        diversity_collapse,
        "mode collapse, the samples repeat each other: raise algorithm.init_kl_coef, lower learner.lr",
    ),
    Sign(
        "reward_hacking",
        reward_hacking,
        "the policy exploits the reward, not the task: a better reward model (its data, an ensemble), "
        "a higher algorithm.init_kl_coef, fewer steps",
    ),
    Sign(
        "no_signal_groups",
        no_signal_groups,
        "the prompts are too easy or too hard for the policy: data.dynamic_sampling, more "
        "rollout.sampling.n_samples_per_prompt, or other data",
    ),
    Sign(
        "value_loss_explosion",
        value_loss_explosion,
        "the critic diverges: lower learner.critic_lr (learner.lr with a shared head), "
        "algorithm.gae.value_clip_eps, algorithm.gae.whiten_rewards",
    ),
    Sign(
        "logprob_gap",
        logprob_gap,
        "the engine and the learner disagree on the policy (stale or broken weight sync, dtype): "
        "check the weight sync, lower async_training.max_staleness, set algorithm.off_policy.correction",
    ),
]


READ = {  # the metrics the signs read: all a Health keeps of a step
    "kl/ref",
    "learner/entropy",
    "response/length_mean",
    "reward/mean",
    "response/distinct_2",
    "reward/zero_spread_groups",
    "loss/value",
    "rollout/logprob_gap",
    *HELD_OUT,
}


def applicable(cfg) -> set[str]:
    """The signs that mean something for a TrainConfig: zero-spread groups only where a group baseline
    makes them signal-free (GRPO, RLOO) with 4 or more samples a prompt (with 2, half the groups of any
    accuracy score alike) and no dynamic sampling (which drops them before the batch is measured); the
    logprob gap only in sync mode (asynchronous modes add the samples' staleness to it)."""
    from learner.config import Estimator
    from orchestrator.config.schema import AsyncMode

    names = {s.name for s in SIGNS}
    grouped = cfg.algorithm.estimator in (Estimator.grpo, Estimator.rloo)
    if not grouped or cfg.rollout.sampling.n_samples_per_prompt < 4 or cfg.data.dynamic_sampling:
        names.discard("no_signal_groups")
    if cfg.async_training.mode != AsyncMode.sync:
        names.discard("logprob_gap")
    return names


class Health:
    """Owns the window of recent step metrics, the first steps' (the baseline), the held-out evaluation
    before training, which signs are on, and how often each warned."""

    def __init__(self, cfg: HealthConfig, say: Callable[[str], None] = print, signs: set[str] | None = None):
        """signs: the names of the signs that apply to the run (applicable); None: all."""
        self.cfg, self.say = cfg, say
        self.signs = [s for s in SIGNS if signs is None or s.name in signs]
        self.recent: Rows = []
        self.first: Rows = []
        self.before: dict[str, float] = {}  # the held-out evaluation before training (the trainer sets it)
        self.latest: dict[str, float] = {}  # the latest held-out evaluation during training
        self.active: set[str] = set()
        self.seen = 0  # steps observed
        self.counts = {s.name: 0 for s in SIGNS}

    def observe(self, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """Take a step's metrics; say each sign that turned on; return the health/* counts to log."""
        if not self.cfg.enabled:
            return {}
        row = {k: float(v) for k, v in metrics.items() if k in READ and isinstance(v, (int, float))}
        self.recent, self.seen = (self.recent + [row])[-self.cfg.window :], self.seen + 1
        if len(self.first) < self.cfg.window:
            self.first.append(row)
        self.latest |= {k: v for k, v in row.items() if k in HELD_OUT}
        return self._check(step, self.signs)

    def final(self, step: int, evaluation: dict[str, float]) -> dict[str, float]:
        """The evaluation after the last step (a run may evaluate held out only then): the sign that
        reads held-out figures checked on it; returns the health/* counts."""
        if not self.cfg.enabled:
            return {}
        self.latest |= {k: float(v) for k, v in evaluation.items() if k in HELD_OUT}
        return self._check(step, [sign for sign in self.signs if sign.check is reward_hacking])

    def _check(self, step: int, signs: list[Sign]) -> dict[str, float]:
        for sign in signs:
            seen = sign.check(self.cfg, self)
            if not seen:
                self.active.discard(sign.name)  # cleared: warns again if it comes back
            elif sign.name not in self.active:
                self.active.add(sign.name)
                self.counts[sign.name] += 1
                self.say(f"relay health: step {step}: {sign.name}: {seen}. Likely cause, knob: {sign.advice}")
        return {f"health/{name}": float(n) for name, n in self.counts.items()}

    def state_dict(self) -> dict:
        return {"recent": self.recent, "first": self.first, "latest": self.latest, "seen": self.seen} | {
            "active": sorted(self.active),
            "counts": self.counts,
        }

    def load_state_dict(self, state: dict | None) -> None:
        """A checkpoint's health state (none in one saved before health existed: start afresh)."""
        state = state or {}
        self.recent, self.first, self.latest = state.get("recent", []), state.get("first", []), state.get("latest", {})
        self.seen = state.get("seen", 0)
        self.active, self.counts = set(state.get("active", [])), {s.name: 0 for s in SIGNS} | state.get("counts", {})
