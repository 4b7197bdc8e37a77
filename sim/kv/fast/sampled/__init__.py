"""Fast mode by row sampling: the token-level manager on a sample of the rows, and LeanKV's compiled decode steps on it."""
