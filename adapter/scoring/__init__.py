"""POST /generative_scoring (vLLM's)."""
