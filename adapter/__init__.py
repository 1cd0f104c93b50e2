"""OpenAI-compatible HTTP adapter in front of the Triton `ensemble` / `llm` models."""
