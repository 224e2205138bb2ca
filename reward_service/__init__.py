"""Runs as the frozen `ScoringService` Ray actor(s), behind `ScoringPool`, restarted by the pool.
Owns rewards (rules, reward models, judges, user functions, remote HTTP) and the reference policy's logprobs.
Holds no optimizer state; imports only runtime and rollout.types (the batch it scores), never learner or orchestrator.
"""
