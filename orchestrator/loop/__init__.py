"""The training loop and the objects it drives: the trainer, the roles, batch sources, dynamic sampling,
evaluation during training, checkpoints, tracking, signals and profiling."""
