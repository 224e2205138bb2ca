"""Prompts and tasks: reading prompt files, generated tasks with their held-out prompts, task data for
the SFT/RM stages, and the starting policies relay builds itself."""
