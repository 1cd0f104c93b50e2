"""The raw bytes of every token id, so logprobs can report real bytes and text is decoded exactly.

Byte-level BPE (GPT-2, Llama 3, Qwen) spells bytes as printable characters; SentencePiece (Llama 2,
Mistral, T5) writes "▁" for a space and "<0xAB>" for byte fallback. Ids past the tokenizer's
vocabulary (a padded embedding matrix) have no bytes.
"""

from __future__ import annotations

import json
import re
from typing import Any

from transformers import PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


def _decoder_parts(tokenizer: PreTrainedTokenizerBase) -> list[dict[str, Any]]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return []
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    return list(decoder.get("decoders", [decoder]))


def token_bytes_table(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> list[bytes]:
    """`table[id]` is the UTF-8 (possibly partial) byte string of token `id`, for every model id.
    A SentencePiece token keeps its leading space: the text of a continuation is the tokens'
    bytes joined (decode() of a token alone drops it, which would join "▁Hello▁world" without
    the space)."""
    n = min(len(tokenizer), vocab_size)
    tokens = tokenizer.convert_ids_to_tokens(list(range(n)))
    added = {i: t.content for i, t in tokenizer.added_tokens_decoder.items()}
    parts = _decoder_parts(tokenizer)
    decoders = {part.get("type", "") for part in parts}
    table: list[bytes] = []
    if "ByteLevel" in decoders:
        byte_of = {char: byte for byte, char in bytes_to_unicode().items()}
        for i, token in enumerate(tokens):
            if i in added or token is None:
                table.append((added.get(i) or "").encode())
            else:
                table.append(bytes(byte_of[c] for c in token if c in byte_of))
    elif decoders & {"ByteFallback", "Replace", "Metaspace"}:
        # Metaspace (T5, XGLM and some Llama conversions) names its own space character.
        space = next(
            (p.get("replacement", "▁") for p in parts if p.get("type") == "Metaspace"), "▁"
        )
        for i, token in enumerate(tokens):
            if i in added or token is None:
                table.append((added.get(i) or "").encode())
            elif match := _BYTE_FALLBACK.match(token):
                table.append(bytes([int(match.group(1), 16)]))
            else:
                table.append(token.replace(space, " ").encode())
    else:
        table = [str(tokenizer.decode([i])).encode() for i in range(n)]
    table.extend(b"" for _ in range(vocab_size - n))
    return table


def special_token_ids(tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    """Ids whose text is not returned (skip_special_tokens): the named special tokens and every
    added token marked special, such as a chat template's role markers."""
    added = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    return frozenset(tokenizer.all_special_ids) | added
