"""Fleet planning: sweeps, capacity searches, the configuration planner and reports."""
