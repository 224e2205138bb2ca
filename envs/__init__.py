"""Runs inside the rollout workers, which play its environments in multi-turn episodes (rollout/episodes.py).
Owns the `Environment` interface, its deadlines, the built-in environments and lookup by name.
Imports only runtime: never rollout, reward_service, learner or orchestrator.
"""
