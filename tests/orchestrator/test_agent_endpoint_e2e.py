"""An agent program trained through the OpenAI-compatible endpoint: its `openai` client calls are
served by the engines and appear, token for token, as episodes in the next update."""
import threading
from pathlib import Path

import httpx
import pytest

from orchestrator.load_config import load_config
from orchestrator.trainer import Trainer

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]


def agent(url: str, episode: str, question: str, reward: float, out: dict) -> None:
    """An agent as users write them: two chat calls through the openai client, then its reward."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/episodes/{episode}/v1", api_key="unused")
    messages = [{"role": "user", "content": question}]
    first = client.chat.completions.create(model="relay-policy", messages=messages, max_tokens=6, temperature=1.0)
    messages += [{"role": "assistant", "content": first.choices[0].message.content}, {"role": "user", "content": "again"}]
    second = client.chat.completions.create(model="relay-policy", messages=messages, max_tokens=6)
    httpx.post(f"{url}/episodes/{episode}/reward", json={"reward": reward}).raise_for_status()
    out[episode] = (first.model_extra["relay"], second.model_extra["relay"], first.usage.prompt_tokens)


def test_openai_client_calls_become_episodes_of_the_next_update(ray_cluster, policy, tmp_path):
    cfg = load_config(REPO / "configs" / "grpo_tiny_cpu.yaml", [
        f"learner.model_path={policy}", f"run_root={tmp_path}", "logging.wandb.mode=disabled",
        "logging.progress_bar=false", "rollout.endpoint.enabled=true", "rollout.endpoint.port=0",
        "rollout.sampling.n_samples_per_prompt=1", "data.rollout_batch_size=4", "data.eval_size=8",
        "algorithm.estimator=reinforce_baseline", "algorithm.reinforce_baseline=batch",
        "algorithm.mini_batch_size=4", "algorithm.micro_batch_size=4", "reward.sources=[{kind: environment}]",
        "total_steps=1"])
    trainer = Trainer(cfg)
    try:
        url, out = ray_cluster.get(trainer.gateway.url.remote()), {}
        agents = [threading.Thread(target=agent, args=(url, f"ep{k}", f"{10 + k}+{20 + k}=", float(k), out))
                  for k in range(4)]
        for a in agents:
            a.start()
        seen = {}
        update = trainer.learner.update

        def spy(batch, scored, step):  # what the learner is given, recorded on the way
            seen["batch"], seen["scored"] = batch, scored
            return update(batch, scored, step)

        trainer.learner.update = spy
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
