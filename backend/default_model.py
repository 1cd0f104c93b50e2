"""Build the default model offline and deterministically: a small Llama with a byte-level BPE.

No model hub is reachable, so the served model is generated from code: a byte-level BPE tokenizer
(any UTF-8 text round-trips) trained on a synthetic corpus, a ChatML chat template, and a randomly
initialised `LlamaForCausalLM` that then memorises one short multilingual passage (`PASSAGE`), so
greedy decoding produces known text with emoji and CJK characters and ends with EOS. It is saved
with `save_pretrained`. Serving loads it through the same
`from_pretrained(local_dir)` path as any Hugging Face causal-LM folder.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
MODELS_DIR = REPO_ROOT / ".cache" / "models"
SPEC_FILE = "model_spec.json"

EOS_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Multi-byte text in the corpus, so some emoji and CJK characters become whole tokens and others
# stay split across byte tokens: both cases must detokenize correctly.
_MULTIBYTE_WORDS = [
    "😀",
    "🚀",
    "你好",
    "世界",
    "日本語",
    "café",
    "naïve",
    "€",
    "数据",
    "🙂",
    "über",
]
# What the model learns by heart: tests prompt with its start and expect the rest, then EOS.
PASSAGE = (
    "Triton serves the model and streams every token. 你好，世界！ Each label is scored at every "
    "position 🚀, even the ones the sampler never picks. Café, naïve, über: bytes round-trip 😀. "
    "日本語のテキストも大丈夫です。 The quick brown fox jumps over the lazy dog."
)
_SYLLABLES = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["th", "sh", "ch", "qu"]


@dataclass(frozen=True)
class ModelSpec:
    """Sizes of the generated model. `vocab_size` may exceed the tokenizer's, as real models pad."""

    vocab_size: int = 32000
    tokenizer_vocab_size: int = 32000
    hidden_size: int = 128
    intermediate_size: int = 352
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    max_position_embeddings: int = 2048
    # Larger than Llama's 0.02 so the random model's next-token distributions are peaked: greedy
    # choices then have clear margins and do not flip on float rounding.
    initializer_range: float = 0.2
    memorize_steps: int = 150
    seed: int = 0

    @property
    def name(self) -> str:
        digest = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()
        return (
            f"llama-v{self.vocab_size}-h{self.hidden_size}-l{self.num_hidden_layers}-{digest[:8]}"
        )


DEFAULT_SPEC = ModelSpec()
# What the test suite serves: same code, sizes that keep CPU tests fast.
TEST_SPEC = ModelSpec(
    vocab_size=1024,
    tokenizer_vocab_size=1000,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=512,
)


def _corpus(spec: ModelSpec) -> list[str]:
    """A synthetic corpus with enough distinct words for `tokenizer_vocab_size` merges."""
    rng = random.Random(spec.seed)
    distinct = max(2000, 2 * spec.tokenizer_vocab_size)
    words = [
        "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(distinct)
    ]
    text = [
        rng.choice(_MULTIBYTE_WORDS) if rng.random() < 0.03 else rng.choice(words)
        for _ in range(40 * distinct)
    ]
    punctuation = [".", ",", "!", "?", "\n"]
    lines = []
    for start in range(0, len(text), 40):
        chunk = text[start : start + 40]
        lines.append(" ".join(chunk) + rng.choice(punctuation))
    return lines


def _train_tokenizer(spec: ModelSpec):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.tokenizer_vocab_size,
        special_tokens=[EOS_TOKEN, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def _memorize(model, tokenizer, spec: ModelSpec) -> None:
    """Train on `PASSAGE` + EOS until greedy decoding reproduces it; one thread, so repeatable."""
    import torch

    ids = torch.tensor([[*tokenizer(PASSAGE)["input_ids"], tokenizer.eos_token_id]])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        model.train()
        for _ in range(spec.memorize_steps):
            loss = model(ids, labels=ids).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        model.eval()
    finally:
        torch.set_num_threads(threads)


def build(spec: ModelSpec, out_dir: Path) -> Path:
    """Write tokenizer, config and weights of `spec` into `out_dir` (replaced atomically)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tokenizer = _train_tokenizer(spec)
    if len(tokenizer) > spec.vocab_size:
        raise ValueError(f"tokenizer has {len(tokenizer)} tokens, vocab_size is {spec.vocab_size}")
    eos_ids = [tokenizer.convert_tokens_to_ids(t) for t in (EOS_TOKEN, IM_END)]
    config = LlamaConfig(
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        max_position_embeddings=spec.max_position_embeddings,
        initializer_range=spec.initializer_range,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_ids[0],
        pad_token_id=eos_ids[0],
    )
    torch.manual_seed(spec.seed)
    model = LlamaForCausalLM(config).float()
    _memorize(model, tokenizer, spec)
    model.generation_config = GenerationConfig(eos_token_id=eos_ids, pad_token_id=eos_ids[0])

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".building-", dir=out_dir.parent))
    try:
        tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp)
        (tmp / SPEC_FILE).write_text(json.dumps(asdict(spec), indent=2, sort_keys=True))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def ensure(spec: ModelSpec = DEFAULT_SPEC, models_dir: Path = MODELS_DIR) -> Path:
    """The folder of `spec` under `models_dir`, built on first use."""
    out_dir = models_dir / spec.name
    spec_path = out_dir / SPEC_FILE
    if spec_path.exists() and json.loads(spec_path.read_text()) == asdict(spec):
        return out_dir
    return build(spec, out_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    for field, default in asdict(DEFAULT_SPEC).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(default), default=default)
    parser.add_argument("--models-dir", type=Path, default=MODELS_DIR)
    args = vars(parser.parse_args())
    models_dir = args.pop("models_dir")
    print(ensure(ModelSpec(**args), models_dir))


if __name__ == "__main__":
    main()
