"""Load benchmark of the serving stack against `transformers serve`: `python -m bench.run`."""
