# The adapter image: the OpenAI-compatible HTTP server (`python -m adapter`) alone, in front of
# Triton's gRPC port. No torch, no transformers: in this image the adapter cannot tokenize
# itself (`--local-preprocessing` falls back), so Triton's `preprocessing` model tokenizes every
# text and chat prompt, and the adapter reads token bytes from Triton's tensors. Build from the
# repository root:
#   docker build -f docker/adapter.Dockerfile -t triton-logprobs/adapter .
#   docker run -p 9000:9000 -e ADAPTER_TRITON_URL=triton-host:8001 triton-logprobs/adapter
# Settings are the adapter's ADAPTER_* variables (docs/configuration.md) or its flags.
#
# python:3.11: the Python the test suite runs on, and one that numpy 1.26.4 (pyproject.toml's
# numpy<2) has wheels for. Pin the digest too (python:3.11-slim-bookworm@sha256:...) for builds
# that must be reproducible byte for byte.
FROM python:3.11-slim-bookworm AS build

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore

WORKDIR /src
RUN python -m venv /opt/venv

# adapter/ plus backend/ (the adapter imports backend.contract, backend.params,
# backend.structured_output and backend.chat_content, which need numpy at most); the
# engine's other modules come along as files and are never imported. The `adapter` extra is the
# adapter's dependencies (pyproject.toml); the project's own are numpy alone.
COPY pyproject.toml README.md ./
COPY backend/ backend/
COPY adapter/ adapter/
# The check fails the build if the adapter does not import here, or if torch or transformers got
# in by some dependency.
RUN /opt/venv/bin/pip install --no-cache-dir '.[adapter]' \
    && /opt/venv/bin/python -c 'import importlib.util as u, adapter.app, adapter.__main__; heavy = [m for m in ("torch", "transformers", "tokenizers") if u.find_spec(m)]; assert not heavy, heavy'

FROM python:3.11-slim-bookworm

COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    ADAPTER_HOST=0.0.0.0 \
    ADAPTER_PORT=9000

# Unprivileged, no home: the adapter writes nothing (a read-only root filesystem works).
USER 10001:10001
EXPOSE 9000
# uvicorn as the main process: SIGTERM shuts it down gracefully (docker stop, pod deletion).
ENTRYPOINT ["python", "-m", "adapter"]
