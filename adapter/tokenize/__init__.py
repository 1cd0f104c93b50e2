"""POST /tokenize and /detokenize (vLLM's)."""
