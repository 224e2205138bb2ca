"""Runs in the driver or as CLI commands around training.
Owns the memory planner (relay plan), plots, and relay eval with its report and suites.
`relay plan` must not build, download or load anything; evaluation never changes a run's state.
"""
