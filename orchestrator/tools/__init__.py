"""Commands around training: the memory planner (relay plan), plots, and relay eval."""
