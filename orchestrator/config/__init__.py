"""The typed config tree (schema), loading it from YAML with overrides (load), validating it once,
the named method recipes, and printing it with each field's docstring (docs)."""
