"""POST /v1/completions."""
