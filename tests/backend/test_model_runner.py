"""`ModelRunner` on architectures beside the default model's: its prefill and batched decode,
through the slot cache and its own masks, against each model's plain forward over the whole
sequence (transformers' own masks, no cache), past a sliding window; and the context each model
is served with."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    BloomConfig,
    Gemma2Config,
    Gemma3TextConfig,
    GenerationConfig,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
)

from backend import contract, model_runner
from backend.context_length import served_context_length
from backend.engine import Engine
from backend.model_runner import AttentionMasks, ModelRunner
from backend.triton_io import parse_request
from tests.backend.test_fast_decode import _SIZES, _save

WINDOW = 8
FAMILIES = {
    "mistral-sliding-window": MistralConfig(**_SIZES, sliding_window=WINDOW),
    "qwen2-sliding-window-on-layer-1": Qwen2Config(
        **_SIZES, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    ),
    # The window is set, but `layer_types` gives it to no layer.
    "qwen2-sliding-window-on-no-layer": Qwen2Config(
        **_SIZES, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2
    ),
    "gemma2-alternating": Gemma2Config(
        **_SIZES, head_dim=16, sliding_window=WINDOW, final_logit_softcapping=5.0
    ),
    "gemma3-alternating": Gemma3TextConfig(**_SIZES, head_dim=16, sliding_window=WINDOW),
    "phi3-sliding-window": Phi3Config(**_SIZES, sliding_window=WINDOW, pad_token_id=0),
    "gpt2-learned-positions": GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=1024),
}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_prefill_and_decode_equal_the_models_own_forward(
    family: str, model_dir: Path, tmp_path: Path
) -> None:
    path = str(_save(FAMILIES[family], model_dir, tmp_path / family))
    runner = ModelRunner(path, device="cpu", max_num_seqs=3, max_model_len=64)
    plain = AutoModelForCausalLM.from_pretrained(path).eval()
    # Ragged rows, the longest well past the window, decoding across it.
    sequences = [list(range(1, 20)), list(range(40, 43)), list(range(100, 108))]
    got = {
        row: list(runner.prefill(row, prompt, all_positions=True))
        for row, prompt in enumerate(sequences)
    }
    for step in range(6):
        tokens = [(7 * step + 3 * row) % 1000 for row in range(len(sequences))]
        logits = runner.decode(tokens, [len(s) for s in sequences])
        for row, token in enumerate(tokens):
            sequences[row].append(token)
            got[row].append(logits[row])
    for row, sequence in enumerate(sequences):
        with torch.inference_mode():
            want = plain(input_ids=torch.tensor([sequence])).logits[0]
        assert (torch.stack(got[row]) - want).abs().max().item() <= 1e-5, row


LONGROPE = {
    "rope_type": "longrope",
    "rope_theta": 10000.0,
    "short_factor": [1.0] * 8,
    "long_factor": [4.0] * 8,
}
PHI3_LONGROPE = Phi3Config(
    **_SIZES, pad_token_id=0, original_max_position_embeddings=64, rope_parameters=LONGROPE
)


@pytest.mark.parametrize(
    ("config", "requested", "served"),
    [
        (LlamaConfig(**_SIZES), 0, 256),
        (LlamaConfig(**_SIZES), 100, 100),
        (GPT2Config(n_positions=300), 0, 300),  # GPT-2 names it n_positions
        (PHI3_LONGROPE, 0, 64),
        (PHI3_LONGROPE, 32, 32),
        (BloomConfig(), 128, 128),  # ALiBi: no limit of its own
    ],
)
def test_served_context_length(config: PretrainedConfig, requested: int, served: int) -> None:
    assert served_context_length(config, requested) == served


@pytest.mark.parametrize(
    ("config", "requested", "message"),
    [
        (LlamaConfig(**_SIZES), 257, "max_model_len 257 is more than this model serves: 256"),
        (
            PHI3_LONGROPE,
            65,
            "more than this model serves: 64 (LongRoPE's original_max_position_embeddings",
        ),
        (BloomConfig(), 0, "the model's config gives no context length: set max_model_len"),
    ],
)
def test_a_context_the_engine_cannot_serve_is_refused(
    config: PretrainedConfig, requested: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        served_context_length(config, requested)


def test_the_context_reads_the_saved_config(model_dir: Path, tmp_path: Path) -> None:
    """The repository reads the folder's config, the engine the loaded model's: both agree."""
    path = _save(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=1024), model_dir, tmp_path)
    runner = ModelRunner(str(path), device="cpu", max_num_seqs=1)
    assert runner.max_model_len == served_context_length(AutoConfig.from_pretrained(path)) == 1024


@pytest.mark.parametrize("generation_config_file", [True, False])
def test_every_eos_id_of_the_model_ends_generation(
    model_dir: Path, tmp_path: Path, generation_config_file: bool
) -> None:
    """The model's eos ids (a list, as Llama 3's) from generation_config.json, or without one
    from config.json, as transformers' `generate` and vLLM stop at them; and the tokenizer's."""
    path = _save(LlamaConfig(**_SIZES, eos_token_id=[5, 7]), model_dir, tmp_path / "m")
    if not generation_config_file:
        (path / "generation_config.json").unlink()
    runner = ModelRunner(str(path), device="cpu", max_num_seqs=1, max_model_len=64)
    assert runner.eos_ids == {5, 7, runner.tokenizer.eos_token_id}


def test_generation_config_sampling_values_become_the_requests_defaults_and_cap(
    model_dir: Path, tmp_path: Path
) -> None:
    """As vLLM serves them: what generation_config.json sets apart from transformers' own
    defaults; a request's own value wins; a value out of range is left out."""
    path = _save(LlamaConfig(**_SIZES), model_dir, tmp_path / "m")
    GenerationConfig(
        do_sample=True,
        temperature=0.7,
        top_k=1,
        top_p=0.8,
        min_p=-1.0,
        repetition_penalty=1.05,
        max_new_tokens=5,
    ).save_pretrained(path)
    runner = ModelRunner(str(path), device="cpu", max_num_seqs=1, max_model_len=64)
    assert dict(runner.sampling_defaults) == {
        "temperature": 0.7,
        "top_k": 1,
        "top_p": pytest.approx(0.8),
        "repetition_penalty": pytest.approx(1.05),
    }
    limits = Engine(runner).limits
    prompt = {contract.INPUT_IDS: np.array([1, 2, 3], dtype=np.int32)}
    params = parse_request(prompt, limits)
    assert (params.temperature, params.top_k, params.min_p) == (0.7, 1, 0.0)
    own = parse_request({**prompt, contract.TOP_K: np.array([0], dtype=np.int32)}, limits)
    assert own.top_k == 0 and own.temperature == 0.7
    # max_new_tokens caps every request's MAX_TOKENS, as vLLM's get_max_tokens
    assert params.max_tokens == 5
    capped = parse_request({**prompt, contract.MAX_TOKENS: np.array([9], dtype=np.int32)}, limits)
    assert capped.max_tokens == 5
    fewer = parse_request({**prompt, contract.MAX_TOKENS: np.array([2], dtype=np.int32)}, limits)
    assert fewer.max_tokens == 2
    plain = ModelRunner(str(model_dir), device="cpu", max_num_seqs=1, max_model_len=64)
    assert plain.sampling_defaults == ()
    assert parse_request(prompt, Engine(plain).limits).temperature == 1.0
    assert parse_request(prompt, Engine(plain).limits).max_tokens == 16


def test_a_model_the_cache_cannot_serve_is_refused_at_load(model_dir: Path, tmp_path: Path) -> None:
    """Bloom's ALiBi is built from a 2-D padding mask: it fails through the slot cache."""
    config = BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=1024)
    path = str(_save(config, model_dir, tmp_path / "bloom"))
    with pytest.raises(ValueError, match="BloomForCausalLM is not supported by the engine"):
        ModelRunner(path, device="cpu", max_num_seqs=1, max_model_len=64)


def test_logits_that_differ_from_the_models_own_are_refused_at_load(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = str(_save(LlamaConfig(**_SIZES), model_dir, tmp_path / "llama"))
    ModelRunner(path, device="cpu", max_num_seqs=1, fast_decode=False)  # as it is: accepted

    def attend_to_every_key(self: AttentionMasks, positions: torch.Tensor, kv_len: int):
        return torch.zeros(positions.shape[0], 1, positions.shape[1], kv_len)

    monkeypatch.setattr(AttentionMasks, "causal", attend_to_every_key)
    with pytest.raises(ValueError, match="its logits differ from its own forward's by up to"):
        ModelRunner(path, device="cpu", max_num_seqs=1, fast_decode=False)


def test_a_kv_cache_larger_than_the_free_memory_is_refused(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The cache is allocated up front for every slot's whole context."""
    monkeypatch.setattr(model_runner, "free_memory", lambda device: 2**20)
    with pytest.raises(ValueError, match=r"needs .* GiB, and 0\.0 GiB are free on cpu: lower"):
        ModelRunner(str(model_dir), device="cpu", max_num_seqs=16, max_model_len=512)
    ModelRunner(str(model_dir), device="cpu", max_num_seqs=1, max_model_len=8)  # fits in 1 MiB
