"""IncrementalDetokenizer: split characters held back, joined deltas == one decode of all bytes."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from backend import default_model
from backend.detokenizer import IncrementalDetokenizer
from backend.token_bytes import token_bytes_table
from tests.reference import tokenizer

EMOJI = "😀".encode()  # 4 bytes
E_ACUTE = "é".encode()  # 2 bytes
# Byte strings a byte-level BPE can produce: whole characters, pieces of them, invalid bytes.
TABLE = [
    b"<skip>",
    b"a",
    b" caf",
    E_ACUTE[:1],
    E_ACUTE[1:],
    EMOJI[:1],
    EMOJI[1:3],
    EMOJI[3:],
    EMOJI,
    "你".encode(),
    "你".encode()[:2],
    "你".encode()[2:],
    b"\xff",  # never valid in UTF-8
    b"\x80",  # a stray continuation byte
    b"",
]
SKIP = frozenset({0})


def detok() -> IncrementalDetokenizer:
    return IncrementalDetokenizer(TABLE, SKIP)


def test_a_split_character_is_held_back_until_complete() -> None:
    d = detok()
    assert d.push(2) == " caf"
    assert d.push(3) == ""  # first byte of é
    assert d.push(4) == "é"
    assert [d.push(i) for i in (5, 6, 7)] == ["", "", "😀"]
    assert d.push(8) == "😀"
    assert d.flush() == ""


def test_skipped_ids_add_no_text_even_inside_a_split_character() -> None:
    d = detok()
    assert d.push(0) == ""
    assert d.push(10) == ""
    assert d.push(0) == ""
    assert d.push(11) == "你"


@pytest.mark.parametrize("seed", range(20))
def test_joined_deltas_equal_one_decode_with_replacement(seed: int) -> None:
    rng = random.Random(seed)
    ids = [rng.randrange(len(TABLE)) for _ in range(rng.randint(1, 30))]
    d = detok()
    deltas = [d.push(i) for i in ids]
    deltas.append(d.flush())
    data = b"".join(TABLE[i] for i in ids if i not in SKIP)
    assert "".join(deltas) == data.decode("utf-8", errors="replace")


def test_invalid_bytes_become_replacement_characters_at_once() -> None:
    d = detok()
    assert d.push(12) == "\ufffd"
    assert d.push(13) == "\ufffd"
    assert d.push(1) == "a"


def test_a_broken_character_is_replaced_when_the_next_token_cannot_continue_it() -> None:
    d = detok()
    assert d.push(5) == ""  # 1 of 4 emoji bytes
    assert d.push(1) == "\ufffda"


def test_flush_of_an_incomplete_tail_gives_one_replacement_character() -> None:
    d = detok()
    assert d.push(1) == "a"
    assert d.push(5) == ""
    assert d.push(6) == ""  # 3 of 4 emoji bytes held
    assert d.flush() == "\ufffd"
    assert d.flush() == ""


def test_the_test_models_passage_streams_without_a_split_character(model_dir: Path) -> None:
    tok = tokenizer(model_dir)
    table = token_bytes_table(tok, 1024)
    ids = tok(default_model.PASSAGE)["input_ids"]
    d = IncrementalDetokenizer(table, frozenset(tok.all_special_ids))
    deltas = [d.push(i) for i in ids]
    assert d.flush() == ""
    assert "".join(deltas) == default_model.PASSAGE
    assert not any("\ufffd" in delta for delta in deltas)
    # The passage has characters split across tokens: some deltas must have been empty.
    assert "" in deltas
