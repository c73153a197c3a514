"""TextStream with SmolLM2's tokenizer: pieces add up to the tokenizer's own decode, stop strings cut it."""

from __future__ import annotations

from hstap.serve.text import REPLACEMENT, TextStream


def pieces(tokenizer, text: str, stops: list[str] = ()) -> tuple[list[str], TextStream]:
    """Push `text`'s tokens one at a time (as continuous batching delivers them); → the pieces, flush included."""
    stream = TextStream(tokenizer, stops)
    out = [stream.push([tok]) for tok in tokenizer.encode(text)]
    return out + [stream.flush()], stream


def test_pieces_add_up_to_the_decoded_text_and_never_split_a_character(tokenizer):
    text = "Dragons bake bread 🍞 at dawn, then 😀 sleep. Ünïcödé — done."
    ids = tokenizer.encode(text)
    assert any(REPLACEMENT in tokenizer.decode([tok]) for tok in ids)  # some token ends inside a character
    out, stream = pieces(tokenizer, text)
    assert "".join(out) == tokenizer.decode(ids) and not any(REPLACEMENT in p for p in out)
    assert stream.used == len(ids) and not stream.stopped


def test_a_stop_string_across_tokens_is_held_back_then_cut(tokenizer):
    text = "The cat sat on the mat and purred."
    out, stream = pieces(tokenizer, text, ["never", "sat on"])
    assert "".join(out) == "The cat " and stream.stopped and out[-1] == ""
    assert not any("s" in p for p in out)  # " sat" was held until " on" decided it
    assert stream.used == len(tokenizer.encode("The cat sat on"))


def test_an_unfinished_stop_string_comes_out_at_the_end(tokenizer):
    out, stream = pieces(tokenizer, "The cat sat", ["sat on"])
    assert out[-1] == "sat" and "".join(out) == "The cat sat" and not stream.stopped


def test_the_first_stop_string_in_the_text_wins_and_chunks_change_nothing(tokenizer):
    text = "Step one: mix. Step two: bake. END of recipe."
    ids = tokenizer.encode(text)
    stream = TextStream(tokenizer, ["END", "two:"])
    got = stream.push(ids[:5]) + stream.push(ids[5:])  # a verification's several tokens at once
    assert got == "Step one: mix. Step " and stream.stopped and stream.push(ids) == ""
