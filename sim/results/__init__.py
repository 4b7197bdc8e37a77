"""What a run measures and writes: step and request logs, vLLM-style metrics, output files."""
