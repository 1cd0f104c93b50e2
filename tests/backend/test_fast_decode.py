"""`backend.fast_decode` against transformers' own forward, on tiny random models of each family
it claims: the same weights and slot cache, prefill of every position, ragged rows, several
decode steps."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from backend.fast_decode import PACKED_LM_HEAD_MIN_ROWS
from backend.model_runner import ModelRunner

_SIZES = {
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
FAMILIES = {
    "llama": LlamaConfig(**_SIZES),
    "llama-mha-rope-scaled": LlamaConfig(
        **{**_SIZES, "num_key_value_heads": 4},
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral": MistralConfig(**_SIZES, sliding_window=None),
    "qwen2": Qwen2Config(**_SIZES),  # biases on q/k/v
    "qwen3": Qwen3Config(**_SIZES, head_dim=16),  # per-head q/k norms
}


def _save(config: PretrainedConfig, tokenizer_dir: Path, out: Path) -> Path:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # random, and large enough that rounding differences would show
        for param in model.parameters():
            param.normal_(0, 0.2)
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


def _run(runner: ModelRunner, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Prefill each prompt into its slot (the logits of every position), then `steps` decodes
    of all rows; the logits of each."""
    out = [runner.prefill(slot, prompt, all_positions=True) for slot, prompt in enumerate(prompts)]
    positions = [len(p) for p in prompts]
    for step in range(steps):
        tokens = [(7 * step + 3 * row) % 1000 for row in range(len(prompts))]
        out.append(runner.decode(tokens, positions))
        positions = [p + 1 for p in positions]
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fast_decode_equals_transformers(family: str, model_dir: Path, tmp_path: Path) -> None:
    path = str(_save(FAMILIES[family], model_dir, tmp_path / family))
    fast = ModelRunner(path, device="cpu", max_num_seqs=4, max_model_len=128)
    slow = ModelRunner(path, device="cpu", max_num_seqs=4, max_model_len=128, fast_decode=False)
    assert fast.fast_decode_off_reason is None
    assert slow.fast_decode_off_reason == "fast_decode is off"
    prompts = [list(range(1, 12)), list(range(40, 43)), list(range(100, 130))]
    got, want = _run(fast, prompts, 6), _run(slow, prompts, 6)
    shapes = [(len(p), 1024) for p in prompts] + [(3, 1024)] * 6
    assert [tuple(t.shape) for t in got] == [tuple(t.shape) for t in want] == shapes
    for got_step, want_step in zip(got, want, strict=True):
        assert torch.isfinite(want_step).all()
        assert (got_step - want_step).abs().max().item() <= 1e-5
    last = fast.prefill(0, prompts[0])  # the last position alone
    assert last.shape == (1, 1024)
    assert (last[0] - got[0][-1]).abs().max().item() <= 1e-5


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        (GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=1024), "model type 'gpt2'"),
        (MistralConfig(**_SIZES, sliding_window=16), "sliding-window"),
        (LlamaConfig(**_SIZES, mlp_bias=True), "biases"),
    ],
)
def test_other_models_keep_transformers_decode(
    config: PretrainedConfig,
    reason: str,
    model_dir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="backend.model_runner"):
        runner = ModelRunner(str(_save(config, model_dir, tmp_path / "m")), device="cpu")
    assert runner.fast_decode_off_reason is not None
    assert reason in runner.fast_decode_off_reason
    assert f"decoding with transformers' forward: {runner.fast_decode_off_reason}" in caplog.text
    logits = _run(runner, [[1, 2, 3], [4, 5]], 2)
    assert all(torch.isfinite(step).all() for step in logits)


@pytest.mark.parametrize("tied", [False, True])
def test_cpu_lm_head_is_column_major_with_the_same_logits(
    tied: bool, model_dir: Path, tmp_path: Path
) -> None:
    """The runner re-lays the output projection on CPU (docs/design.md, "The engine step"):
    same values, transposed storage, and prefill and decode logits equal to the model as
    loaded; a tied input embedding keeps its row-major weight."""
    path = str(_save(LlamaConfig(**_SIZES, tie_word_embeddings=tied), model_dir, tmp_path / "m"))
    loaded = AutoModelForCausalLM.from_pretrained(path).eval()
    runner = ModelRunner(path, device="cpu", max_num_seqs=2, max_model_len=128)
    head = runner.model.get_output_embeddings().weight
    embed = runner.model.get_input_embeddings().weight
    assert head.stride() == (1, 1024)
    assert torch.equal(head, loaded.get_output_embeddings().weight)
    assert embed.stride() == (64, 1)
    assert torch.equal(embed, loaded.get_input_embeddings().weight)
    prompt = list(range(5, 25))
    with torch.inference_mode():
        want = loaded(input_ids=torch.tensor([prompt])).logits[0]
    got = runner.prefill(0, prompt[:-1], all_positions=True)
    assert (got - want[:-1]).abs().max().item() <= 1e-5
    got_next = runner.decode([prompt[-1]], [len(prompt) - 1])
    assert (got_next[0] - want[-1]).abs().max().item() <= 1e-5


def test_cpu_logits_of_several_rows_come_from_the_packed_lm_head(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From `PACKED_LM_HEAD_MIN_ROWS` rows the CPU logits go through oneDNN's packed weight
    (docs/design.md, "The engine step"), fewer through `F.linear`; either way they match the
    final norm and lm_head computed in float64."""
    path = str(_save(LlamaConfig(**_SIZES), model_dir, tmp_path / "m"))
    runner = ModelRunner(path, device="cpu", max_num_seqs=2, max_model_len=128)
    fast = runner._fast
    assert fast is not None
    packed_calls: list[int] = []
    packed = torch.ops.mkldnn._linear_pointwise

    def spy(x: torch.Tensor, *args: object) -> torch.Tensor:
        packed_calls.append(x.shape[0])
        return packed(x, *args)

    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", spy)
    norm = runner.model.model.norm
    weight = runner.model.get_output_embeddings().weight.double()
    generator = torch.Generator().manual_seed(0)
    for rows in (1, PACKED_LM_HEAD_MIN_ROWS - 1, PACKED_LM_HEAD_MIN_ROWS, 16):
        hidden = torch.randn(rows, _SIZES["hidden_size"], generator=generator)
        h64 = hidden.double()
        h64 = h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
        want = (norm.weight.double() * h64) @ weight.T
        with torch.inference_mode():
            got = fast._logits(hidden)
        assert (got.double() - want).abs().max().item() <= 1e-5
    assert packed_calls == [PACKED_LM_HEAD_MIN_ROWS, 16]


@pytest.mark.parametrize("fast_decode", [True, False])
def test_before_lm_head_runs_once_late_in_the_forward(
    fast_decode: bool, model_dir: Path, tmp_path: Path
) -> None:
    """`decode`'s hook (the engine starts its logprob gathers there): once per decode, after the
    layers and before the lm_head with `fast_decode`, before the forward otherwise; the logits
    are those of a decode without it."""
    path = str(_save(FAMILIES["llama"], model_dir, tmp_path / "m"))
    hooked, plain = (
        ModelRunner(path, device="cpu", max_num_seqs=2, max_model_len=64, fast_decode=fast_decode)
        for _ in range(2)
    )
    events: list[str] = []
    if fast_decode:
        assert hooked._fast is not None
        lm_head = hooked._fast._logits

        def logits(hidden: torch.Tensor) -> torch.Tensor:
            events.append("lm_head")
            return lm_head(hidden)

        hooked._fast._logits = logits  # type: ignore[method-assign]
    prompts = [list(range(1, 9)), list(range(30, 34))]
    _run(hooked, prompts, 0)
    _run(plain, prompts, 0)
    positions = [len(p) for p in prompts]
    events.clear()  # the prefills' lm_head
    got = hooked.decode([5, 6], positions, before_lm_head=lambda: events.append("hook"))
    want = plain.decode([5, 6], positions)
    assert events == (["hook", "lm_head"] if fast_decode else ["hook"])
    assert torch.equal(got, want)
