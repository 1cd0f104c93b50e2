"""`python -m adapter`: serve the OpenAI API on uvicorn; flags override `ADAPTER_*` variables."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from typing import Any

import uvicorn

from adapter.app import create_app
from adapter.context import RequestIdFilter
from adapter.settings import AdapterSettings
from adapter.shutdown import GracefulServer

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"
"""Every line names the request it is about ("-" for none): the X-Request-Id of the response."""
SHUTDOWN_BACKSTOP_S = 5
"""uvicorn's own bound on open connections after the drain (which already ended the requests)."""


def parse_args(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """The flags given on the command line (absent ones leave the environment's value)."""
    parser = argparse.ArgumentParser(prog="python -m adapter", description=__doc__)
    for name, field in AdapterSettings.model_fields.items():
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            dest=name,
            default=None,
            # a bool's text ("false") is parsed by pydantic: bool("false") would be True
            type=type(field.default)
            if isinstance(field.default, int | float) and not isinstance(field.default, bool)
            else str,
            help=f"{field.description} (env ADAPTER_{name.upper()}; default {field.default!r})",
        )
    return {k: v for k, v in vars(parser.parse_args(argv)).items() if v is not None}


def configure_logging(level: str) -> None:
    """One handler on the root logger, uvicorn's loggers included, each line with its request."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter(LOG_FORMAT))
    handler.addFilter(RequestIdFilter())
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def main(argv: Sequence[str] | None = None) -> None:
    settings = AdapterSettings(**parse_args(argv))
    configure_logging(settings.log_level)
    app = create_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=None,  # uvicorn's loggers propagate to the handler above
        access_log=False,  # the middleware logs each request, with its id
        timeout_graceful_shutdown=SHUTDOWN_BACKSTOP_S,
    )
    GracefulServer(config, app.state.lifecycle, settings.drain_timeout_s).run()


if __name__ == "__main__":
    main()
