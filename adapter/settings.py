"""The adapter's settings: environment variables `ADAPTER_*`, overridden by the CLI."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class AdapterSettings(BaseSettings):
    """Where to listen, which Triton to talk to, under which name to serve the model, who may
    call it, and the limits that keep one client from taking the server down."""

    model_config = SettingsConfigDict(env_prefix="ADAPTER_")

    host: str = Field(default="0.0.0.0", description="Interface the HTTP server binds.")
    port: int = Field(default=9000, ge=0, le=65535, description="HTTP port.")
    triton_url: str = Field(
        default="localhost:8001",
        description="Triton gRPC endpoints, `host:port` or a comma-separated list "
        "`host1:8001,host2:8001`; a name resolving to several addresses (re-resolved every 30 s) "
        "is one replica per address. Requests go round-robin over the replicas that are ready.",
    )
    served_model_name: str | None = Field(
        default=None,
        description="Model id of the API (`model` field, /v1/models). Default: the last path "
        "component of the `llm` model's `model_path` config parameter.",
    )
    preprocessing_model: str = Field(
        default="preprocessing",
        description="Triton model that tokenizes text and chat prompts the adapter does not "
        "(`local_preprocessing`).",
    )
    local_preprocessing: bool = Field(
        default=True,
        description="Tokenize text and chat prompts in the adapter, with the `llm` model's "
        "tokenizer and chat template read from its `model_path`, where it is absolute and this "
        "host has that folder and `transformers` (as `make serve` does; the adapter's image "
        "does not): a Triton round trip less per request. Elsewhere, or when false, "
        "`preprocessing` does it.",
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

    # Access
    api_key: SecretStr | None = Field(
        default=None,
        description="Required as `Authorization: Bearer <key>` on /v1/*, /tokenize, "
        "/detokenize and /generative_scoring. Unset or empty: no key needed. Prefer the "
        "environment variable: a flag shows in the process list.",
    )
    metrics_api_key: SecretStr | None = Field(
        default=None,
        description="Required as `Authorization: Bearer <key>` on /metrics. Unset: /metrics "
        "is open, like /health.",
    )

    # Limits
    max_request_body_bytes: int = Field(
        default=4 * 1024 * 1024, gt=0, description="Larger request bodies get a 413."
    )
    max_tokens_cap: int = Field(
        default=4096,
        gt=0,
        description="Largest `max_tokens` / `max_completion_tokens` (400 above it); also chat's "
        "limit when the request sets none (or the context, when smaller).",
    )
    max_n: int = Field(
        default=16, ge=1, le=128, description="Largest `n` (choices per prompt); 400 above it."
    )
    max_concurrent_requests: int = Field(
        default=64,
        ge=0,
        description="Generation, tokenize and scoring requests served at once; 0: no limit.",
    )
    max_queued_requests: int = Field(
        default=128,
        ge=0,
        description="Requests waiting for one of those slots; beyond it a 429 with Retry-After.",
    )
    request_timeout_s: float = Field(
        default=600.0,
        ge=0,
        description="Deadline of a generation, tokenize or scoring request from its arrival, "
        "queueing included: its Triton requests are cancelled, a 504 (or, once a stream "
        "started, an error event and [DONE]) answers. 0: none.",
    )
    drain_timeout_s: float = Field(
        default=20.0,
        ge=0,
        description="On SIGTERM: how long in-flight requests may take to finish before they "
        "are cancelled (streams get an error event and [DONE]); new requests get 503.",
    )

    @field_validator("api_key", "metrics_api_key")
    @classmethod
    def _empty_is_unset(cls, value: SecretStr | None) -> SecretStr | None:
        """An empty value (`ADAPTER_API_KEY=`) means no key, not a key that is empty."""
        return value if value is not None and value.get_secret_value().strip() else None
