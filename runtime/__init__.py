"""Imported by every process, whatever its role: rollout workers, scoring service, learner ranks and the driver.
Owns device and precision, logprob/entropy math, profiling, seeds, prompt encoding, Ray actor helpers, the watchdog.
Imports none of relay's other packages (tests/unit/test_architecture.py), so any of them may import it.
"""
