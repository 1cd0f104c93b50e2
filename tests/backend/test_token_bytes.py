"""token_bytes_table: the exact bytes of every model id (byte-level BPE, byte fallback and
Metaspace decoders)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from backend import default_model
from backend.detokenizer import IncrementalDetokenizer
from backend.token_bytes import token_bytes_table
from tests.reference import tokenizer

VOCAB_SIZE = 1024  # the test model pads its 1000-token tokenizer to 1024 ids
TEXTS = [
    default_model.PASSAGE,
    "😀🚀🙂 emoji only",
    "日本語のテキスト 数据 你好，世界！",
    "  leading spaces, tabs\tand\nnewlines\n",
    "€ café naïve über ¿qué? ﬁ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
]


@pytest.fixture
def table(model_dir: Path) -> list[bytes]:
    return token_bytes_table(tokenizer(model_dir), VOCAB_SIZE)


def test_one_entry_per_model_id_and_padding_has_no_bytes(table: list[bytes]) -> None:
    assert len(table) == VOCAB_SIZE
    assert table[1000:] == [b""] * 24
    assert all(table[i] for i in range(3, 1000))  # every real token has bytes


@pytest.mark.parametrize("text", TEXTS)
def test_token_bytes_concatenate_to_the_utf8_text(
    table: list[bytes], model_dir: Path, text: str
) -> None:
    ids = tokenizer(model_dir)(text)["input_ids"]
    assert b"".join(table[i] for i in ids) == text.encode("utf-8")


def test_special_tokens_give_their_content(table: list[bytes]) -> None:
    assert table[:3] == [b"<|endoftext|>", b"<|im_start|>", b"<|im_end|>"]


def test_complete_tokens_agree_with_the_tokenizers_decode(
    table: list[bytes], model_dir: Path
) -> None:
    tok = tokenizer(model_dir)
    partial = 0
    for i in range(3, 1000):
        try:
            text = table[i].decode("utf-8")
        except UnicodeDecodeError:
            partial += 1  # a piece of a multi-byte character: decode() would show U+FFFD
            continue
        assert tok.decode([i]) == text, i
    assert partial > 0  # the test tokenizer does split characters


def byte_fallback_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-style (Llama 2) tokenizer: "▁" for spaces, <0xAB> byte tokens."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    vocab.update({"▁": 259, "▁hello": 260, "é": 261, "wor▁ld": 262})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


def test_byte_fallback_tokens_give_their_byte_and_spaces_their_space() -> None:
    table = token_bytes_table(byte_fallback_tokenizer(), 266)
    assert table[:3] == [b"<unk>", b"<s>", b"</s>"]
    assert table[3:259] == [bytes([b]) for b in range(256)]
    assert table[259:263] == [b" ", b" hello", "é".encode(), b"wor ld"]
    assert table[263:] == [b"", b"", b""]


def metaspace_tokenizer(prepend_scheme: str) -> PreTrainedTokenizerFast:
    """A T5/XGLM-style Unigram tokenizer whose decoder is Metaspace (no Replace/ByteFallback)."""
    vocab = [("<unk>", 0.0), ("<s>", 0.0), ("</s>", 0.0)]
    vocab += [(piece, -1.0) for piece in ("▁Hello", "▁world", "▁", "wor", "ld", "!")]
    backend = Tokenizer(models.Unigram(vocab, unk_id=0))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme=prepend_scheme)
    backend.decoder = decoders.Metaspace(prepend_scheme=prepend_scheme)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


@pytest.mark.parametrize("prepend_scheme", ["always", "first"])
def test_a_metaspace_decoders_continuation_keeps_its_spaces(prepend_scheme: str) -> None:
    """Generated text is what decode() of prompt + output adds to decode() of the prompt, as
    vLLM returns it; decode() of each token alone drops its space ("Helloworld")."""
    tok = metaspace_tokenizer(prepend_scheme)
    table = token_bytes_table(tok, len(tok))
    assert table[3:9] == [b" Hello", b" world", b" ", b"wor", b"ld", b"!"]
    prompt = tok.encode("Hello", add_special_tokens=False)
    output = tok.encode("Hello world wor ld!", add_special_tokens=False)[1:]
    detokenizer = IncrementalDetokenizer(table, frozenset(tok.all_special_ids))
    text = "".join(detokenizer.push(i) for i in output) + detokenizer.flush()
    expected = tok.decode(prompt + output)[len(tok.decode(prompt)) :]
    assert text == expected == " world wor ld!"
