#!/usr/bin/env bash
# The Triton container's command: serve the model folder at $MODEL_PATH with the project's
# launcher, the same code path as `make serve`, on the image's own tritonserver, Triton alone
# (--adapter-port 0: the adapter is its own container).
#
# $MODEL_PATH (default /models, a mounted volume) is a Hugging Face causal-LM folder when it holds
# a config.json. Otherwise the default model is built into it (or found there, built by an earlier
# start) and served: `python -m backend.default_model --models-dir DIR` prints its folder. A path
# that does not exist (a typo, a volume not mounted) is refused, not filled with the default.
# The launcher waits $READY_TIMEOUT_S (900) for the model to load, as long as the Kubernetes
# startup probe and compose's start_period allow.
# Arguments are launcher flags, appended last so they override these defaults, e.g.
#   triton-entrypoint --set max_num_seqs=32 --set kv_cache_memory_mb=20000
# The variables below default to the image's layout; tests point them at the bundled server.
set -euo pipefail

model_path="${MODEL_PATH:-/models}"
if [[ ! -d "${model_path}" ]]; then
    echo "triton-entrypoint: MODEL_PATH ${model_path} does not exist: mount a model folder there" \
        "(one with a config.json), or leave MODEL_PATH at /models for the default model" >&2
    exit 2
fi
if [[ ! -f "${model_path}/config.json" ]]; then
    echo "triton-entrypoint: no config.json in ${model_path}; using the default model there" >&2
    # The builder prints the model folder as its last line of output.
    model_path="$(python3 -m backend.default_model --models-dir "${model_path}" | tail -n 1)"
fi

# exec: the launcher becomes the container's main process and gets its SIGTERM, on which it stops
# tritonserver and the backend stubs (docker stop, pod deletion).
exec python3 -m backend.launcher \
    --model-path "${model_path}" \
    --host "${TRITON_HOST:-0.0.0.0}" \
    --tritonserver "${TRITONSERVER:-/opt/tritonserver/bin/tritonserver}" \
    --backend-directory "${TRITON_BACKEND_DIRECTORY:-/opt/tritonserver/backends}" \
    --run-dir "${RUN_DIR:-/tmp/triton-logprobs}" \
    --ready-timeout "${READY_TIMEOUT_S:-900}" \
    --adapter-port 0 \
    "$@"
