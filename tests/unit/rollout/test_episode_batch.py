"""Multi-turn episodes as a training batch: text reward sources read the model's own last turn
(never an observation's words), every length and diversity metric counts the model's tokens only,
and only a spent token budget counts as clipped (running out of turns does not). The real loop
(rollout.episodes.play) on a scripted engine."""

import asyncio
from types import SimpleNamespace

from envs.base import Environment
from envs.config import EnvConfig
from learner.tiny_gpt import DEFAULT_ALPHABET, char_tokenizer
from orchestrator.loop.step_metrics import batch_metrics
from orchestrator.tools.evaluate import distinct_n, evaluate_policy
from reward_service.types import ScoredBatch
from rollout.config import RolloutConfig, SamplingConfig
from rollout.episodes import EpisodeSeeds, PromptShard, play, start_episodes, to_batch

# each episode's turns, by its prompt
TURNS = {"solve": ["call 1+2", "3"], "ramble": ["hmm", "hmm"], "cut": ["abcdefghijkl", "mnopqrstuvwx"]}


class ScriptedEngine:
    """AsyncEngine.generate for play(): each episode's next scripted turn, EOS-closed unless it fills max_tokens."""

    def __init__(self, tok):
        self.tok = tok

    async def generate(self, prompt_ids, params):
        outs = []
        for ids, p in zip(prompt_ids, params):
            prompt = self.tok.decode(ids)
            name = next(n for n in TURNS if n in prompt)
            text = TURNS[name][prompt.count("<|assistant|>") - 1]  # one generation prompt per turn so far
            ids = self.tok.encode(text, add_special_tokens=False)[: p.max_tokens]
            finish = "length" if len(ids) >= p.max_tokens else "stop"
            ids += [self.tok.eos_token_id] if finish == "stop" else []
            done = SimpleNamespace(
                token_ids=ids, logprobs=[{t: SimpleNamespace(logprob=-0.5)} for t in ids], finish_reason=finish, text=""
            )
            outs.append(SimpleNamespace(outputs=[done]))
        return outs


class Tool(Environment):
    """Prints a number the model did not write (42); rewards the answer 3."""

    def step(self, action):
        if action == "3":
            return None, 1.0, True, {}
        return "the tool printed 42", 0.0, False, {}


def play_batch():
    tok = char_tokenizer(DEFAULT_ALPHABET + "<|>")
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    cfg = RolloutConfig(max_prompt_tokens=64, sampling=SamplingConfig(max_new_tokens=10, n_samples_per_prompt=1))
    prompts = [[{"role": "user", "content": name}] for name in TURNS]
    episodes, _ = start_episodes(
        Tool, PromptShard(prompts, [{}] * 3), 1, EpisodeSeeds(lambda i: i, lambda i, k: 0), tok, cfg, 5.0
    )
    env = EnvConfig(name="tool", max_turns=2, max_episode_tokens=60, step_timeout_s=5.0, observation_role="tool")
    asyncio.run(play(ScriptedEngine(tok), tok, episodes, cfg.sampling, False, env, env.response_tokens(10)))
    return to_batch(episodes, []), tok


def test_text_sources_read_the_models_last_turn_and_lengths_count_its_tokens():
    batch, tok = play_batch()
    cut = batch.response_text[2]  # the last turn got what was left of the episode's 60 tokens
    assert batch.response_text == ["3", "hmm", cut] and 0 < len(cut) < 10 and "mnopqrstuvwx".startswith(cut)
    # "42" is the tool's, never the model's answer
    assert batch.finish_reason == ["stop", "turns", "length"]  # solved; out of turns; the token budget ran out
    eos = 1
    model = [len("call 1+2") + eos + len("3") + eos, 2 * (len("hmm") + eos), 10 + len(cut)]
    assert batch.model_lengths == model and all(o > m for o, m in zip(batch.response_lengths, model))
    assert batch.model_ids[0] == tok.encode("call 1+2", add_special_tokens=False) + [tok.eos_token_id] + tok.encode(
        "3", add_special_tokens=False
    ) + [tok.eos_token_id]
    scored = ScoredBatch(
        [1.0, 0.0, 0.0], {}, [True] * 3, [False] * 3, [[0.0] * n for n in batch.response_lengths], raw=[1.0, 0.0, 0.0]
    )
    m = batch_metrics(batch, scored)
    assert m["response/length_mean"] == sum(model) / 3 and m["response/length_max"] == max(model)
    assert m["response/clipped_frac"] == 1 / 3  # only the episode whose token budget ran out
    # but its first turn was cut at max_new_tokens (10 of "abcdefghijkl") and the episode went on: counted too
    assert batch.turns == [2, 2, 2] and batch.clipped_turns == [0, 0, 2]
    assert m["response/clipped_turn_frac"] == 2 / 6


def test_evaluation_lengths_and_diversity_count_the_models_tokens():
    batch, _ = play_batch()
    scored = ScoredBatch(
        [0.0] * 3, {}, [True] * 3, [False] * 3, [[0.0] * n for n in batch.response_lengths], raw=[0.0] * 3
    )
    ev = evaluate_policy(
        lambda p, greedy: batch,
        lambda *a: scored,
        [""] * 3,
        [{}] * 3,
        False,
        1.0,
        lambda b: [[0.0] * n for n in b.response_lengths],
    )
    m = ev.metrics
    assert m["eval/sampled/response/length_mean"] == sum(batch.model_lengths) / 3
    assert m["eval/sampled/distinct_1"] == distinct_n(batch.model_ids, 1) != distinct_n(batch.response_ids, 1)
