"""Agents through the whole stack: a multi-turn environment's episodes train (asynchronously, with
evaluation), and an agent program's `openai` client calls, served by the engines through the
OpenAI-compatible endpoint, appear token for token as episodes in the next update."""

import json
import threading

import httpx
import pytest
from transformers import AutoTokenizer

from orchestrator.config.load import load_config
from orchestrator.loop.trainer import Trainer
from runtime.prompts import encode_chat
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


# a template in the tiny policy's alphabet that renders `tools` and tool results (its own renders contents only)
TOOL_TEMPLATE = (
    "{% if tools %}tools: {% for t in tools %}{{ t.function.name }}"
    "({{ t.function.parameters.properties | join(', ') }}){% endfor %}\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}result: {% endif %}{{ m.content }}\n{% endfor %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers.",
            "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}},
        },
    }
]


def agent(url: str, episode: str, question: str, reward: float, out: dict) -> None:
    """An agent as users write them, through the openai client: a streamed call offering a tool, the
    tool's result sent back (the tiny policy never calls it, so as the agent's own next message),
    a second call, then its reward."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/episodes/{episode}/v1", api_key="unused")
    messages = [{"role": "user", "content": question}]
    chunks = list(
        client.chat.completions.create(
            model="relay-policy",
            messages=messages,
            max_tokens=6,
            temperature=1.0,
            tools=TOOLS,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    messages += [
        {"role": "assistant", "content": text},
        {"role": "tool", "tool_call_id": "call_0", "content": "42"},
    ]
    second = client.chat.completions.create(model="relay-policy", messages=messages, max_tokens=6, tools=TOOLS)
    httpx.post(f"{url}/episodes/{episode}/reward", json={"reward": reward}).raise_for_status()
    out[episode] = (chunks[-2].model_extra["relay"]["completion"], second.model_extra["relay"], chunks[-1].usage)


def streamed_and_whole(url: str, question: str, seed: int) -> tuple[list[list[int]], str, dict]:
    """The same call streamed and not, with the same seed, each in an episode of its own (never ended)."""
    from openai import OpenAI

    def create(episode: str, **extra):
        client = OpenAI(base_url=f"{url}/episodes/{episode}/v1", api_key="unused")
        messages = [{"role": "user", "content": question}]
        return client.chat.completions.create(model="relay-policy", messages=messages, max_tokens=8, seed=seed, **extra)

    chunks = list(create("streamed", stream=True))
    whole = create("whole")
    pieces = [c.model_extra["relay"]["token_ids"] for c in chunks]
    return pieces, "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), whole


def test_openai_client_calls_become_episodes_of_the_next_update(ray_cluster, policy, tmp_path):
    """Through the real engine: a streamed call gives the non-streamed one's tokens and text (same
    seed), and every agent's calls (tools offered, a tool result sent back) train token for token."""
    template = tmp_path / "tools.jinja"
    template.write_text(TOOL_TEMPLATE)
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
            "rollout.endpoint.tool_parser=hermes",
            f"rollout.endpoint.chat_template={template}",
            "rollout.max_prompt_tokens=40",  # the tools the template writes before the question
            "rollout.endpoint.wait_timeout_s=240",  # an agent that failed ends the step soon, saying so
        ],
    )
    trainer = Trainer(cfg)
    try:
        url, out = ray_cluster.get(trainer.roles.gateway.url.remote()), {}
        pieces, streamed_text, whole = streamed_and_whole(url, "12+34=", seed=5)
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
    assert sum(pieces, []) == whole.model_extra["relay"]["token_ids"] and len(pieces) > 2  # token for token
    assert streamed_text == whole.choices[0].message.content
    tokenizer = AutoTokenizer.from_pretrained(policy)
    tokenizer.chat_template = TOOL_TEMPLATE
    for k in range(4):
        first, second, usage = out[f"ep{k}"]
        i = by_reward[float(k)]  # episodes arrive in the order they finished
        ids, acts = batch.response_ids[i], batch.action_mask[i]
        n1, n2 = len(first["token_ids"]), len(second["token_ids"])
        question = [{"role": "user", "content": f"{10 + k}+{20 + k}="}]
        assert batch.prompt_ids[i] == encode_chat(tokenizer, question, tools=TOOLS)  # the tools in the template
        assert len(batch.prompt_ids[i]) == usage.prompt_tokens
        assert ids[:n1] == first["token_ids"] and ids[-n2:] == second["token_ids"]  # exactly what the engine sampled
        assert tokenizer.decode(ids[n1:-n2]) == "\nresult: 42\n"  # the tool result, as the template writes it
        assert acts == [1] * n1 + [0] * (len(ids) - n1 - n2) + [1] * n2  # the agent's new message: no gradient
        assert batch.logprobs[i][:n1] == first["logprobs"] and batch.logprobs[i][-n2:] == second["logprobs"]
        assert first["policy_version"] == 0 and scored.rewards[i] == float(k)  # the posted reward is the environment's
    assert metrics["learner/grad_norm"] > 0 and metrics["env/return_mean"] == 1.5
