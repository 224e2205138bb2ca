"""REINFORCE with a baseline on CartPole-v1, driven by relay's math core.

A check of learner/algorithms.py on a task with a known answer: returns-to-go from
`discounted_returns`, the baseline from `reinforce_baseline_advantages`, normalisation from
`masked_whiten`. Solves CartPole (100-episode moving average >= 475) on one CPU core.

    python examples/cartpole_reinforce.py [--episodes 2000] [--seed 0]
"""

from __future__ import annotations

import argparse
import time
from collections import deque

import gymnasium as gym
import torch
from torch import nn

from learner.algorithms import discounted_returns, masked_mean, masked_whiten, reinforce_baseline_advantages


def run_episodes(env, policy, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Play n episodes; return padded (n, T) observations, actions, rewards and the mask."""
    obs_l, act_l, rew_l = [], [], []
    for i in range(n):
        obs, _ = env.reset(seed=seed + i)
        observations, actions, rewards, done = [], [], [], False
        while not done:
            o = torch.as_tensor(obs, dtype=torch.float32)
            with torch.no_grad():
                a = torch.distributions.Categorical(logits=policy(o)).sample().item()
            obs, r, terminated, truncated, _ = env.step(a)
            observations.append(o), actions.append(a), rewards.append(r)
            done = terminated or truncated
        (
            obs_l.append(torch.stack(observations)),
            act_l.append(torch.tensor(actions)),
            rew_l.append(torch.tensor(rewards)),
        )
    T = max(len(a) for a in act_l)
    mask = torch.stack([(torch.arange(T) < len(a)).float() for a in act_l])
    pad = lambda xs, shape: torch.stack([torch.cat([x, x.new_zeros(T - len(x), *shape)]) for x in xs])  # noqa: E731
    return pad(obs_l, (4,)), pad(act_l, ()), pad(rew_l, ()).float(), mask


def train(
    episodes: int,
    seed: int = 0,
    batch: int = 8,
    lr: float = 1e-2,
    gamma: float = 0.99,
    target: float = 475.0,
    log_every: int = 0,
) -> list[float]:
    """Train until `episodes` are played or the moving average reaches `target`; return the averages."""
    torch.manual_seed(seed)
    env = gym.make("CartPole-v1")
    policy = nn.Sequential(nn.Linear(4, 64), nn.Tanh(), nn.Linear(64, 2))
    opt = torch.optim.Adam(policy.parameters(), lr=lr)
    window, history, played = deque(maxlen=100), [], 0
    while played < episodes:
        obs, actions, rewards, mask = run_episodes(env, policy, batch, seed * 100_000 + played)
        played += batch
        window.extend(rewards.sum(-1).tolist())
        history.append(sum(window) / len(window))
        returns = discounted_returns(rewards, mask, gamma)
        valid = mask > 0
        adv = torch.zeros_like(returns)
        adv[valid] = reinforce_baseline_advantages(returns[valid], baseline="batch")  # one episode per 'prompt'
        adv = masked_whiten(adv, mask)
        logp = torch.log_softmax(policy(obs), -1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)
        loss = -masked_mean(logp * adv, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if log_every and (played // batch) % log_every == 0:
            print(f"episodes {played:5d}  moving average {history[-1]:6.1f}", flush=True)
        if len(window) == 100 and history[-1] >= target:
            break
    return history


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=3000)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    start = time.time()
    history = train(args.episodes, args.seed, log_every=10)
    print(
        f"final 100-episode moving average {history[-1]:.1f} after {len(history) * 8} episodes, "
        f"{time.time() - start:.0f} s"
    )


if __name__ == "__main__":
    main()
