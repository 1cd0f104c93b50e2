# The Triton image: NVIDIA's Triton container running this project's model repository through the
# project's launcher (`python -m backend.launcher`, as `make serve` does), Triton alone: the OpenAI
# adapter is docker/adapter.Dockerfile. Build from the repository root:
#   docker build -f docker/triton.Dockerfile -t triton-logprobs/triton .
# Serve a Hugging Face causal-LM folder mounted at /models (or, when it has no config.json, the
# default model, built there on first start):
#   docker run --gpus all --shm-size 1g -v "$PWD/models:/models" -p 8001:8001 triton-logprobs/triton
#
# Base image, pinned: 26.11 = Triton 2.75.0 (GitHub release v2.75.0, "corresponding to NGC
# container 26.11", 2026-11-17). The 26.xx Triton containers are built on CUDA 13 (release notes:
# 26.02 CUDA 13.1.1, 26.04 CUDA 13.2.1, 26.06 CUDA 13.3.0; compute capability 7.5 and later) and
# NVIDIA's 26.xx CUDA DL base is Ubuntu 24.04 with Python 3.12 (CUDA DL release notes 26.03). The
# Python-backend stub in /opt/tritonserver/backends/python runs that image's python3, so the
# project goes into the image's system Python. The build checks the Python version below rather
# than trusting these notes. To move to a newer tag, change it here and rebuild: the checks fail
# loudly if the Python changed.
FROM nvcr.io/nvidia/tritonserver:26.11-py3

# PIP_BREAK_SYSTEM_PACKAGES: Ubuntu 24.04 marks its python3 externally managed (PEP 668); the stub
# can only use the system interpreter, and this single-purpose image owns it, so pip may write
# there. HF_HUB_OFFLINE: models are local folders (the mounted volume), never a hub download.
ENV PIP_BREAK_SYSTEM_PACKAGES=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PYTHONUNBUFFERED=1 \
    HF_HUB_OFFLINE=1

WORKDIR /opt/triton-logprobs

# A C compiler and the Python headers: OpenAI-Triton compiles its CUDA launcher stubs with the
# system compiler the first time a kernel runs (the logprob kernel, at the engine's warm-up), and
# fails with "Failed to find C compiler" in images without one. pip for the system Python: the
# base image has it for the Python backend; listed so the build does not depend on that. The pins
# name Ubuntu 24.04's series (gcc 13, glibc 2.39, Python 3.12, pip 24.0), so security updates
# install while another base Ubuntu fails here, as the Python check below would.
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        gcc=4:13.2.* libc6-dev=2.39-* python3-dev=3.12.* python3-pip=24.0* \
    && rm -rf /var/lib/apt/lists/*

# Dependencies first (their layer is cached across source changes). --only-binary: a missing wheel
# (for instance numpy 1.26.4 on a Python other than 3.12) fails the build instead of compiling.
# The first command logs the base image's own Python and numpy, for the record: the stub's numpy is
# the one pinned in requirements-triton.txt (< 2), whatever the base image shipped.
COPY docker/requirements-triton.txt docker/
RUN python3 -c 'import sys; print("base image python", sys.version)' \
    && (python3 -c 'import numpy; print("base image numpy", numpy.__version__)' \
        || echo "base image has no numpy") \
    && python3 -c 'import sys; assert sys.version_info[:2] == (3, 12), "numpy<2 wheels need CPython 3.12, found " + sys.version' \
    && python3 -m pip install --no-cache-dir --only-binary=:all: -r docker/requirements-triton.txt

# The engine (backend, kernels) and the model repository template. Editable install: the launcher
# finds model_repository/ and writes the served copy relative to the source tree
# (backend.repository.TEMPLATE), so the tree stays here and site-packages points at it. The adapter
# package is not copied: it runs in its own image.
COPY pyproject.toml README.md ./
COPY backend/ backend/
COPY kernels/ kernels/
COPY model_repository/ model_repository/
COPY docker/triton-entrypoint.sh /usr/local/bin/triton-entrypoint
# The import check runs without a GPU (torch and OpenAI-Triton import on CPU) and fails the build
# if the installed stack does not fit together; it prints the versions the stub will see.
RUN python3 -m pip install --no-cache-dir --no-deps -e . \
    && command -v cc && python3 -c 'import numpy, torch, transformers, backend.launcher, kernels; print("numpy", numpy.__version__, "torch", torch.__version__, "cuda", torch.version.cuda, "transformers", transformers.__version__)' \
    && mkdir -p /models \
    && chown 1000:1000 /models

# Unprivileged: uid 1000 is the image's triton-server user (Triton's build.py creates it with uid
# and gid 1000 and gives it the server's files). /models is owned by it, so a named volume mounted
# there (initialised from this folder) is writable for the default-model build.
# The launcher writes the served repository and the logs to $RUN_DIR; OpenAI-Triton caches
# compiled kernels in $TRITON_CACHE_DIR.
ENV MODEL_PATH=/models \
    RUN_DIR=/tmp/triton-logprobs \
    TRITON_CACHE_DIR=/tmp/triton-cache
USER 1000:1000

# HTTP (health, generate_stream), gRPC (the adapter, tritonclient), metrics (Prometheus, HPA).
EXPOSE 8000 8001 8002

# The base image's ENTRYPOINT (NVIDIA's entrypoint script: banner, CUDA compatibility checks) is
# kept and runs this command; launcher flags go after it (compose `command:`, Kubernetes `args:`):
#   ["triton-entrypoint", "--set", "max_num_seqs=32"]
CMD ["triton-entrypoint"]
