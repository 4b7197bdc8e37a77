"""Bulk steps: the engine's exact multi-step advance over stretches where the schedule is known."""
