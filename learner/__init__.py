"""relay learner package."""
