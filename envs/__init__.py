"""Environments for multi-turn rollouts: the model acts, the environment answers, over several turns.

The rollout workers run them (rollout/episodes.py); this package imports none of relay's others.
"""
