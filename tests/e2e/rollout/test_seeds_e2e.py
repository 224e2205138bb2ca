"""The run seed reaches the engines: two run seeds sample one prompt differently, one seed alike
(real vLLM workers on Ray)."""

from rollout.config import SamplingConfig


def test_two_run_seeds_sample_one_prompt_differently_and_one_seed_alike(ray_cluster, tiny_model):
    # one prompt repeated (as guess_number's prompts are): only the run seed can tell the samples apart
    from rollout.config import RolloutConfig
    from rollout.pool import RolloutPool

    cfg = RolloutConfig(
        max_model_len=64,
        max_prompt_tokens=16,
        sampling=SamplingConfig(max_new_tokens=8, n_samples_per_prompt=2, temperature=1.0),
    )
    prompts = ["12+34=?"] * 4
    pools = {seed: RolloutPool(cfg, tiny_model, num_workers=1, seed=seed) for seed in (0, 1)}
    try:
        first = {seed: pool.generate(prompts, step=0).response_ids for seed, pool in pools.items()}
        assert pools[0].generate(prompts, step=0).response_ids == first[0]
        assert first[0] != first[1]
        pinned = SamplingConfig(max_new_tokens=8, n_samples_per_prompt=2, temperature=1.0, seed=7)
        assert (
            pools[0].generate(prompts, step=0, sampling=pinned).response_ids
            == pools[1].generate(prompts, step=0, sampling=pinned).response_ids
        )  # an explicit override
    finally:
        for pool in pools.values():
            pool.shutdown()
