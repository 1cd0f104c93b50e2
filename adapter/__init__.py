"""OpenAI-compatible HTTP adapter in front of the Triton `preprocessing` and `llm` models."""
