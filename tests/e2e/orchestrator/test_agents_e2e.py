"""Agents through the whole stack: a multi-turn environment's episodes train (asynchronously, with
evaluation), and an agent program's `openai` client calls, served by the engines through the
OpenAI-compatible endpoint, appear token for token as episodes in the next update."""

import json
import threading

import httpx
import pytest

from orchestrator.config.load import load_config
from orchestrator.loop.trainer import Trainer
from tests.helpers import REPO

pytestmark = pytest.mark.e2e


def test_environment_episodes_train_end_to_end_in_async_mode(ray_cluster, policy, tmp_path):
    """guess_number on 2-digit sums with relay's addition policy: a right sum wins at once, a wrong
    one is told higher or lower and guesses again."""
    cfg = load_config(
        REPO / "configs" / "guess_number_tiny_cpu.yaml",
        [
            f"learner.model_path={policy}",
            f"run_root={tmp_path}",
            "logging.wandb.mode=disabled",
            "data.task=addition_2digit",
            "env.options={low: 20, high: 198}",
            "logging.progress_bar=false",
            "rollout.max_model_len=64",
            "data.rollout_batch_size=8",
            "data.eval_size=8",
            "algorithm.mini_batch_size=64",
            "algorithm.micro_batch_size=64",
            "async_training.mode=one_step",
            "total_steps=2",
        ],
    )
    trainer = Trainer(cfg)
    try:
        after = trainer.run()
    finally:
        trainer.shutdown()
    steps = [
        m
        for line in (tmp_path / cfg.name / "metrics.jsonl").read_text().splitlines()
        if "env/turns_mean" in (m := json.loads(line))
    ]  # the training steps (the last line is the evaluation)
    assert len(steps) == 2 and all(m["env/turns_mean"] > 1 for m in steps)  # episodes went on after a wrong guess
    assert all(0 < m["env/observation_token_frac"] < 1 and m["env/timeouts"] == m["env/errors"] == 0 for m in steps)
    assert all(m["learner/grad_norm"] > 0 and m["reward/environment/invalid_frac"] == 0 for m in steps)
    assert 0 <= after["eval/sampled/reward/accuracy"] <= 1  # evaluation plays episodes too


def agent(url: str, episode: str, question: str, reward: float, out: dict) -> None:
    """An agent as users write them: two chat calls through the openai client, then its reward."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/episodes/{episode}/v1", api_key="unused")
    messages = [{"role": "user", "content": question}]
    first = client.chat.completions.create(model="relay-policy", messages=messages, max_tokens=6, temperature=1.0)
    messages += [
        {"role": "assistant", "content": first.choices[0].message.content},
        {"role": "user", "content": "again"},
    ]
    second = client.chat.completions.create(model="relay-policy", messages=messages, max_tokens=6)
    httpx.post(f"{url}/episodes/{episode}/reward", json={"reward": reward}).raise_for_status()
    out[episode] = (first.model_extra["relay"], second.model_extra["relay"], first.usage.prompt_tokens)


def test_openai_client_calls_become_episodes_of_the_next_update(ray_cluster, policy, tmp_path):
    cfg = load_config(
        REPO / "configs" / "grpo_tiny_cpu.yaml",
        [
            f"learner.model_path={policy}",
            f"run_root={tmp_path}",
            "logging.wandb.mode=disabled",
            "logging.progress_bar=false",
            "rollout.endpoint.enabled=true",
            "rollout.endpoint.port=0",
            "rollout.sampling.n_samples_per_prompt=1",
            "data.rollout_batch_size=4",
            "data.eval_size=8",
            "algorithm.estimator=reinforce_baseline",
            "algorithm.reinforce_baseline.baseline=batch",
            "algorithm.mini_batch_size=4",
            "algorithm.micro_batch_size=4",
            "reward.sources=[{kind: environment}]",
            "total_steps=1",
        ],
    )
    trainer = Trainer(cfg)
    try:
        url, out = ray_cluster.get(trainer.roles.gateway.url.remote()), {}
        agents = [
            threading.Thread(target=agent, args=(url, f"ep{k}", f"{10 + k}+{20 + k}=", float(k), out)) for k in range(4)
        ]
        for a in agents:
            a.start()
        seen = {}
        learner = trainer.roles.learner
        experience = learner.experience

        def spy(batch, scored):  # what the learner is given, recorded on the way
            seen["batch"], seen["scored"] = batch, scored
            return experience(batch, scored)

        learner.experience = spy
        metrics = trainer.train_step()  # waits for the 4 finished episodes
        for a in agents:
            a.join()
    finally:
        trainer.shutdown()
    batch, scored = seen["batch"], seen["scored"]
    assert len(batch) == 4 and metrics["endpoint/episodes"] == 4
    by_reward = {r: i for i, r in enumerate(batch.env_return)}
    for k in range(4):
        first, second, prompt_tokens = out[f"ep{k}"]
        i = by_reward[float(k)]  # episodes arrive in the order they finished
        ids, acts = batch.response_ids[i], batch.action_mask[i]
        n1, n2 = len(first["token_ids"]), len(second["token_ids"])
        assert len(batch.prompt_ids[i]) == prompt_tokens
        assert ids[:n1] == first["token_ids"] and ids[-n2:] == second["token_ids"]  # exactly what the engine sampled
        assert acts == [1] * n1 + [0] * (len(ids) - n1 - n2) + [1] * n2  # the agent's new message: no gradient
        assert batch.logprobs[i][:n1] == first["logprobs"] and batch.logprobs[i][-n2:] == second["logprobs"]
        assert first["policy_version"] == 0 and scored.rewards[i] == float(k)  # the posted reward is the environment's
    assert metrics["learner/grad_norm"] > 0 and metrics["env/return_mean"] == 1.5
