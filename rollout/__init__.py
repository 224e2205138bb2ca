"""relay rollout package."""
