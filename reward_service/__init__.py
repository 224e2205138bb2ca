"""relay reward_service package."""
