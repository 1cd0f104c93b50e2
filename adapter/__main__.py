"""`python -m adapter`: serve the OpenAI API on uvicorn; flags override `ADAPTER_*` variables."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

import uvicorn

from adapter.app import create_app
from adapter.settings import AdapterSettings


def parse_args(argv: Sequence[str] | None = None) -> dict[str, object]:
    """The flags given on the command line (absent ones leave the environment's value)."""
    parser = argparse.ArgumentParser(prog="python -m adapter", description=__doc__)
    for name, field in AdapterSettings.model_fields.items():
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            default=None,
            type=type(field.default) if isinstance(field.default, int | float) else str,
            help=f"{field.description} (env ADAPTER_{name.upper()}; default {field.default!r})",
        )
    return {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}


def main(argv: Sequence[str] | None = None) -> None:
    settings = AdapterSettings(**parse_args(argv))
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    uvicorn.run(
        create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level
    )


if __name__ == "__main__":
    main()
