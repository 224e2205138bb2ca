"""Runs as `RolloutWorker` Ray actors (one vLLM engine each, behind `RolloutPool`) and the agent endpoint beside them.
Owns sampling, behaviour logprobs and each token's policy version, episodes, the engines' sleep/wake, and receiving
weights (it defines the sync protocol). Imports only runtime and envs: never learner, reward_service, orchestrator.
"""
