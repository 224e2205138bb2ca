"""What every process of relay needs at run time, whatever its role: the device and precision it
computes in and its malloc environment (device), logprob and entropy math on logits (logprobs),
profiling and busy time (profiling), the run's random streams (seeds), prompt encoding (prompts),
and helpers for Ray actors (actors).

Rollout workers, the scoring service, the learner ranks and the driver all import it; it imports
none of relay's other packages (tests/unit/test_architecture.py), so any of them may.
"""
