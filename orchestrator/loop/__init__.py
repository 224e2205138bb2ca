"""Runs in the driver.
Owns the training loop and the objects it drives: the trainer, roles, batch sources, dynamic sampling, evaluation,
checkpoints, recovery, tracking, signals, health and profiling. Contains no algorithm math (learner.algorithms).
"""
