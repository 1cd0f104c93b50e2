"""The adapter's settings: environment variables `ADAPTER_*`, overridden by the CLI."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class AdapterSettings(BaseSettings):
    """Where to listen, which Triton to talk to, and under which name to serve the model."""

    model_config = SettingsConfigDict(env_prefix="ADAPTER_")

    host: str = Field(default="0.0.0.0", description="Interface the HTTP server binds.")
    port: int = Field(default=9000, ge=0, le=65535, description="HTTP port.")
    triton_url: str = Field(
        default="localhost:8001", description="Triton gRPC endpoint, `host:port`."
    )
    served_model_name: str | None = Field(
        default=None,
        description="Model id of the API (`model` field, /v1/models). Default: the last path "
        "component of the `llm` model's `model_path` config parameter.",
    )
    preprocessing_model: str = Field(
        default="preprocessing", description="Triton model that tokenizes text and chat prompts."
    )
    llm_model: str = Field(
        default="llm", description="Triton generation model; holds the config parameters."
    )
    triton_timeout_s: float = Field(
        default=5.0, gt=0, description="Deadline of Triton's health and config calls."
    )
    log_level: Literal["critical", "error", "warning", "info", "debug"] = Field(
        default="info", description="Log level of the adapter and uvicorn."
    )
