"""Runs as `Learner` Ray actors, one per DeepSpeed ZeRO data-parallel rank.
Owns the policy and value, the update step, SFT and reward-model training, sending weights, and the pure RL math.
Imports only runtime, rollout.types/weight_sync and reward_service.types/rules; knows nothing of vLLM or the driver.
"""
