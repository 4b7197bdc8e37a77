"""Cross-check of kvsim's scheduler against a real vLLM engine: driver, harness and recorded scenarios."""
