"""The stop-sequence matcher of the Chat Completions API: held-back tails, stops across
pieces, the earliest of several, and the whole-text cut."""

from __future__ import annotations

from gptoss_serve.server.stop_sequences import StopSequences


def _stream(stops: tuple[str, ...], pieces: list[str]) -> tuple[str, bool]:
    matcher = StopSequences(stops)
    sent = "".join(matcher.feed(piece) for piece in pieces)
    if not matcher.stopped:
        sent += matcher.flush()
    return sent, matcher.stopped


def test_a_stop_split_over_pieces_is_never_sent() -> None:
    matcher = StopSequences(("END",))
    assert matcher.feed("abc E") == "abc "  # "E" may begin the stop: held back
    assert matcher.feed("N") == ""
    assert matcher.feed("Dxyz") == "" and matcher.stopped
    assert matcher.feed("more") == ""


def test_a_held_tail_that_does_not_become_a_stop_is_sent() -> None:
    assert _stream(("END",), ["abc E", "Nd", "!"]) == ("abc ENd!", False)
    assert _stream(("END",), ["abc EN"]) == ("abc EN", False)  # flushed at the end


def test_the_earliest_of_several_stops_wins() -> None:
    assert _stream(("world", "lo w"), ["hello world"]) == ("hel", True)
    assert _stream(("b", "abc"), ["xa", "bc"]) == ("x", True)  # "abc" begins first


def test_a_stop_at_the_start_and_empty_sequences() -> None:
    assert _stream(("ab",), ["ab", "c"]) == ("", True)
    assert _stream(("",), ["abc"]) == ("abc", False)  # an empty sequence stops nothing


def test_cut_a_whole_text() -> None:
    matcher = StopSequences(("\n\n", "###"))
    assert matcher.cut("one\ntwo###three\n\nfour") == "one\ntwo"
    assert matcher.cut("no stop here") == "no stop here"


def test_unicode_pieces() -> None:
    assert _stream(("👋x",), ["hi 👋", "x there"]) == ("hi ", True)
    assert _stream(("é!",), ["caf", "é", "?"]) == ("café?", False)
