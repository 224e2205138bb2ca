"""Runs in the driver.
Owns prompt files, generated tasks with their held-out prompts, the SFT/RM stages' task data, and the starting
policies relay builds itself. Of orchestrator, imports only config (tests/unit/test_architecture.py).
"""
