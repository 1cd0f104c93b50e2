"""StopStringMatcher (stop strings across deltas) and token_stop_reason (ids and limits)."""

from __future__ import annotations

import itertools

import pytest

from backend.stopping import LENGTH, STOP, StopStringMatcher, token_stop_reason


def feed(stops: list[str], deltas: list[str]) -> tuple[list[str], int | None]:
    """(emitted pieces, index of the delta that reported the stop), flushing when none did."""
    matcher = StopStringMatcher(stops)
    emitted = []
    for index, delta in enumerate(deltas):
        text, stop = matcher.push(delta)
        emitted.append(text)
        if stop is not None:
            return emitted, index
    emitted.append(matcher.flush())
    return emitted, None


def test_without_stops_text_passes_through() -> None:
    matcher = StopStringMatcher([])
    assert matcher.push("abc") == ("abc", None)
    assert matcher.push("STOP") == ("STOP", None)
    assert matcher.flush() == ""


def test_a_stop_spanning_deltas_is_found_and_cut() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("abc ST") == ("abc", None)  # " ST" may begin the stop: held
    assert matcher.push("O") == (" ", None)  # holds the last 3: "STO"
    assert matcher.push("P and more") == ("", "STOP")


def test_the_stop_itself_and_what_follows_are_never_emitted() -> None:
    emitted, index = feed(["</s>"], ["Hello", " wor", "ld</", "s> tail"])
    assert "".join(emitted) == "Hello world"
    assert index == 3


@pytest.mark.parametrize("stops", [["world", "lo"], ["lo", "world"]])
def test_several_stops_cut_at_the_earliest(stops: list[str]) -> None:
    assert StopStringMatcher(stops).push("hello world") == ("hel", "lo")


@pytest.mark.parametrize(
    ("stops", "text", "cut", "included", "stop"),
    [
        (["abc", "b"], "xxabc", "xxa", "xxab", "b"),  # a shorter one inside a longer one
        (["toke", "ok"], "y toke", "y t", "y tok", "ok"),
        (["y to", " t"], "y to", "y", "y t", " t"),
        (["ab", "b"], "xab", "x", "xab", "ab"),  # both end together: the first listed
    ],
)
def test_of_stops_ending_in_one_delta_the_one_that_ends_first_wins(
    stops: list[str], text: str, cut: str, included: str, stop: str
) -> None:
    """As if the text came a character at a time, whatever the tokens (vLLM's
    `check_stop_strings`); it used to be the one that starts first."""
    assert StopStringMatcher(stops).push(text) == (cut, stop)
    assert StopStringMatcher(stops, include_stop=True).push(text) == (included, stop)


def test_held_text_that_turns_out_not_to_stop_is_released() -> None:
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("aSTO") == ("a", None)
    assert matcher.push("x") == ("S", None)  # keeps the last 3 characters "TOx"
    assert matcher.flush() == "TOx"


TEXT = "one STOP two"


def test_no_split_ever_emits_part_of_a_stop_that_completes_later() -> None:
    end = TEXT.index("STOP") + len("STOP")
    splits = [c for n in (1, 2, 3) for c in itertools.combinations(range(1, len(TEXT)), n)]
    for cuts in splits:
        bounds = (0, *cuts, len(TEXT))
        deltas = [TEXT[a:b] for a, b in itertools.pairwise(bounds)]
        emitted, index = feed(["STOP", "xyz"], deltas)
        assert "".join(emitted) == "one ", deltas
        # Reported by the delta holding the stop's last character, not earlier or later.
        assert index == next(i for i, b in enumerate(bounds[1:]) if b >= end), deltas


def test_include_stop_emits_the_stop_and_nothing_after_it() -> None:
    matcher = StopStringMatcher(["STOP", "zz"], include_stop=True)
    assert matcher.push("one ST") == ("one", None)
    assert matcher.push("OP two zz") == (" STOP", "STOP")


def test_include_stop_at_one_start_takes_the_shorter_stop() -> None:
    assert StopStringMatcher(["abc", "ab"], include_stop=True).push("xabcd") == ("xab", "ab")


def test_flush_without_a_stop_returns_every_character_once() -> None:
    emitted, index = feed(["STOP", "ST!"], ["S", "T", "O", "p", " ", "ST"])
    assert index is None
    assert "".join(emitted) == "STOp ST"


def test_under_min_tokens_no_stop_is_looked_for_and_one_that_ended_there_is_not_found_later() -> (
    None
):
    """vLLM checks stop strings once the output exceeds min_tokens, in the new text only."""
    matcher = StopStringMatcher(["STOP"])
    assert matcher.push("a STOP b", search=False) == ("a STO", None)  # held: "P b"
    assert matcher.push("c", search=True) == ("P", None)  # "STOP" ended before: not a stop
    assert matcher.push(" ST", search=False) == (" bc", None)  # held: " ST"
    assert matcher.push("OP!", search=True) == (" ", "STOP")  # began under it, ends now


def test_stop_id_wins_over_length() -> None:
    assert (
        token_stop_reason(
            7, generated=4, total_len=10, max_tokens=4, max_model_len=10, stop_ids=frozenset({7})
        )
        == STOP
    )


@pytest.mark.parametrize(
    ("generated", "total_len", "expected"),
    [
        (3, 9, None),  # below both limits
        (4, 9, LENGTH),  # max_tokens reached
        (3, 10, LENGTH),  # context full
        (5, 11, LENGTH),
    ],
)
def test_length_limits(generated: int, total_len: int, expected: str | None) -> None:
    reason = token_stop_reason(
        5,
        generated=generated,
        total_len=total_len,
        max_tokens=4,
        max_model_len=10,
        stop_ids=frozenset({0, 2}),
    )
    assert reason == expected
