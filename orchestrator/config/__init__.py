"""Runs in the driver (and in every command that reads a config).
Owns the typed config tree (schema), loading YAML with overrides, validating it once, the named method recipes,
and printing it with each field's docstring. Imports no other group of orchestrator (tests/unit/test_architecture.py).
"""
