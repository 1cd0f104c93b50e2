"""Malformed tensors straight to Triton: every request ends (an error or a valid stream) and the
server keeps serving."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from backend import contract
from tests.streaming import Streamer

INPUTS = sorted(contract.MODELS["llm"].inputs)
DTYPES = [np.int32, np.int64, np.float32, np.bool_, object]
INTS = st.sampled_from([0, 1, 2, 5, 20, 21, 1023, 1024, -1, -(2**31), 2**31 - 1])
FLOATS = st.sampled_from([0.0, 0.5, 1.0, -1.0, 100.0, 1e30, float("nan"), float("inf")])
BYTES = st.sampled_from([b"", b"stop", b"\xff\xfe", "你好".encode(), b"\x00" * 3])


@st.composite
def tensor(draw: st.DrawFn) -> np.ndarray:
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 3), min_size=1, max_size=2)))
    size = int(np.prod(shape))
    if dtype is object:
        values = draw(st.lists(BYTES, min_size=size, max_size=size))
        array = np.empty(size, dtype=object)
        array[:] = values
        return array.reshape(shape)
    if dtype is np.bool_:
        return np.array(draw(st.lists(st.booleans(), min_size=size, max_size=size))).reshape(shape)
    if dtype is np.float32:
        values = draw(st.lists(FLOATS, min_size=size, max_size=size))
    else:
        values = draw(st.lists(INTS, min_size=size, max_size=size))
    return np.array(values, dtype=dtype).reshape(shape)


@st.composite
def request(draw: st.DrawFn) -> dict[str, np.ndarray]:
    names = draw(st.lists(st.sampled_from(INPUTS), max_size=6, unique=True))
    arrays = {name: draw(tensor()) for name in names}
    if draw(st.booleans()):  # often a valid prompt, so the other inputs get checked too
        arrays[contract.INPUT_IDS] = np.array([1, 2, 3], dtype=np.int32)
    arrays.setdefault(contract.MAX_TOKENS, np.array([2], dtype=np.int32))
    return arrays


@settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
@given(arrays=request())
def test_malformed_requests_end_and_the_server_keeps_serving(triton_server, arrays):
    streamer = Streamer(triton_server.grpc_url)
    try:
        result = streamer.run("llm", arrays, timeout=60)
        if result.error is None:
            assert result.responses, "a stream without responses"
            assert len(result.token_ids) <= max(
                int(np.asarray(arrays[contract.MAX_TOKENS]).max()), 0
            )
        else:
            assert result.error.strip(), "an error without a message"
        good = streamer.run(
            "llm",
            {
                contract.INPUT_IDS: np.array([4, 5], np.int32),
                contract.MAX_TOKENS: np.array([2], np.int32),
                contract.IGNORE_EOS: np.array([True]),
            },
        )
        assert good.error is None and len(good.token_ids) == 2
    finally:
        streamer.close()
