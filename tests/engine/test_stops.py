"""Streaming stop strings and UTF-8 reassembly."""
from __future__ import annotations

from engine.runtime.stops import StopMatcher, Utf8Decoder


def run(stops: list[str], pieces: list[str]) -> tuple[list[str], bool, str]:
    """Feed pieces until a stop; returns (emitted per feed, stopped, flushed)."""
    m = StopMatcher(stops)
    out = []
    for piece in pieces:
        text, hit = m.feed(piece)
        out.append(text)
        if hit:
            return out, True, ""
    return out, False, m.flush()


def test_stop_across_piece_boundaries():
    out, hit, _ = run(["</end>"], ["Hello </", "en", "d> tail"])
    assert hit and out == ["Hello ", "", ""]


def test_holds_back_only_a_possible_stop_prefix():
    m = StopMatcher(["STOP"])
    assert m.feed("abc S") == ("abc ", False)
    assert m.feed("T") == ("", False)
    assert m.feed("x") == ("STx", False)  # the prefix turned out not to be a stop
    assert m.flush() == ""


def test_overlapping_prefix():
    out, hit, _ = run(["ab"], ["a", "a", "b", "never"])
    assert hit and out == ["", "a", ""]
    assert run(["ab"], ["aab"])[0] == ["a"]


def test_earliest_stop_wins():
    assert run(["world", "lo w"], ["hello world"])[0] == ["hel"]
    out, hit, _ = run(["world", "lo w"], ["hel", "lo", " ", "wor", "ld"])
    assert hit and "".join(out) == "hel"


def test_stop_spanning_many_pieces():
    stop = "<|im_end|>"
    out, hit, _ = run([stop], ["ok"] + list(stop) + ["more"])
    assert hit and "".join(out) == "ok"


def test_no_stop_flush_returns_remainder():
    out, hit, rest = run(["###"], ["one ", "two #", "#"])
    assert not hit
    assert "".join(out) == "one two " and rest == "##"


def test_empty_stops_are_ignored():
    assert run(["", "x"], ["abc"]) == (["abc"], False, "")
    assert run([], ["abc"]) == (["abc"], False, "")


def test_nothing_after_a_stop():
    m = StopMatcher(["x"])
    assert m.feed("axb") == ("a", True)
    assert m.feed("more") == ("", True)
    assert m.flush() == ""


def test_utf8_split_byte_by_byte():
    text = "é😀 ok"
    d = Utf8Decoder()
    pieces = [d.feed(bytes([b])) for b in text.encode()]
    assert "".join(pieces) + d.flush() == text
    assert pieces[:2] == ["", "é"]  # never half a character
    assert pieces[2:6] == ["", "", "", "😀"]


def test_utf8_unfinished_character_becomes_replacement():
    d = Utf8Decoder()
    assert d.feed(b"a\xf0\x9f") == "a"
    assert d.flush() == "\ufffd"
