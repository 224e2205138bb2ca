"""Runs as the driver process (the `relay` CLI, inside a Ray job).
Owns config loading and validation, placement, the loop, evaluation, checkpoint/resume, tracking and the stages.
May import every other package; contains no algorithm math (learner.algorithms owns it).
"""
