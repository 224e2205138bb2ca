"""relay orchestrator package."""
