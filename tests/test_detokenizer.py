"""IncrementalDetokenizer on the tiny byte-level BPE: streamed deltas, UTF-8 hold-back, stop strings."""

from __future__ import annotations

import random

import pytest

from rackserve.engine.detokenizer import IncrementalDetokenizer
from rackserve.models.deepseek_v4.tiny import make_tiny
from rackserve.models.tokenizer import Tokenizer

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé, naïve café — ½ ∑ façade",
    "日本語 and 中文字符 side by side",
    "emoji 🚀🧪 and 👩‍👩‍👧 family, then ASCII",
    "🚀",
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return Tokenizer(make_tiny(tmp_path_factory.mktemp("detok")))


@pytest.fixture(scope="module")
def prompt(tok):
    return tok.encode("Prompt: say something fox-free.", add_bos=True)


def stream(tok, prompt, ids, stop=(), chunk=1):
    """Feed `ids` `chunk` at a time; returns (detokenizer, deltas, flushed text)."""
    detok = IncrementalDetokenizer(tok, prompt, stop=stop)
    deltas = [detok.add(ids[i:i + chunk]) for i in range(0, len(ids), chunk)]
    return detok, deltas, detok.flush()


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_add_up_to_decode_and_never_split_a_character(tok, prompt, text):
    ids = tok.encode(text, add_bos=False)
    detok, deltas, tail = stream(tok, prompt, ids)
    assert "".join(deltas) + tail == detok.text == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas) and tail == ""
    if text != TEXTS[0]:  # the test means something: some single tokens are partial characters
        assert any("\ufffd" in tok.decode([i]) for i in ids)


def test_random_tokens_match_decode_in_any_chunking(tok, prompt):
    """Random ids (what an untrained model emits): invalid bytes and special tokens included."""
    rng = random.Random(0)
    for _ in range(30):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 60))]
        detok, deltas, tail = stream(tok, prompt, ids, chunk=rng.choice([1, 2, 3, 7]))
        assert "".join(deltas) + tail == detok.text == tok.decode(ids), ids


def test_incomplete_character_at_the_end_comes_out_on_flush(tok, prompt):
    ids = tok.encode("ok 🚀", add_bos=False)
    cut = next(n for n in range(len(ids), 0, -1) if tok.decode(ids[:n]).endswith("\ufffd"))
    detok, deltas, tail = stream(tok, prompt, ids[:cut])
    assert "".join(deltas).startswith("ok") and "\ufffd" not in "".join(deltas) and tail.endswith("\ufffd")
    assert "".join(deltas) + tail == tok.decode(ids[:cut])


def test_decoding_cost_stays_bounded(tok, prompt):
    """Each step re-decodes only a few recent tokens, not the whole output."""
    lengths = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            lengths.append(len(ids))
            return tok.decode(ids, skip_special_tokens)

    ids = tok.encode(" ".join(TEXTS * 4), add_bos=False)
    detok = IncrementalDetokenizer(Counting(), prompt)
    text = "".join(detok.add([i]) for i in ids) + detok.flush()
    assert text == tok.decode(ids) and len(ids) > 200
    assert max(lengths) <= 12


def stop_case(tok, prompt, text, stop, chunk=1):
    """Stream `text` with `stop`, checking the hold-back at every step; returns (detok, emitted, tail)."""
    ids = tok.encode(text, add_bos=False)
    detok = IncrementalDetokenizer(tok, prompt, stop=stop)
    emitted, prefixes = "", []
    for i in range(0, len(ids), chunk):
        emitted += detok.add(ids[i:i + chunk])
        prefixes.append(emitted)
        if not detok.stopped:
            # what is streamed never ends in something that may still become a stop string
            assert not any(emitted.endswith(s[:n]) for s in stop for n in range(1, len(s))), (emitted, stop)
    tail = detok.flush()
    assert emitted + tail == detok.text
    assert all(detok.text.startswith(p) for p in prefixes)  # nothing streamed is taken back
    return detok, emitted, tail


@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_stop_truncates_before_the_first_stop_string(tok, prompt, chunk):
    text = "The quick brown fox jumps over the lazy dog."
    detok, emitted, tail = stop_case(tok, prompt, text, ("lazy", "fox", "jumps"), chunk)
    assert detok.stopped and detok.stop_reason == "fox"
    assert emitted == detok.text == "The quick brown " and tail == ""
    assert detok.add(tok.encode(" more", add_bos=False)) == "" and detok.text == "The quick brown "


def test_stop_string_spanning_tokens(tok, prompt):
    text = "The quick brown fox jumps over the lazy dog."
    stop = "own fox ju"
    assert not any(stop in tok.decode([i]) for i in tok.encode(text, add_bos=False))
    detok, emitted, _ = stop_case(tok, prompt, text, (stop,))
    assert detok.stop_reason == stop and emitted == "The quick br"


def test_stop_string_at_the_very_start(tok, prompt):
    detok, emitted, tail = stop_case(tok, prompt, "The quick brown fox", ("The",))
    assert detok.stopped and emitted == tail == detok.text == ""


def test_first_stop_to_appear_wins(tok, prompt):
    # "bro" is complete before "quick brown" is, though "quick brown" starts earlier
    detok, emitted, _ = stop_case(tok, prompt, "The quick brown fox", ("quick brown", "bro"))
    assert detok.stop_reason == "bro" and emitted == "The quick "
    # two stop strings completing at the same character: the longer one, which starts earlier
    detok, emitted, _ = stop_case(tok, prompt, "The quick brown fox", ("own", "brown"))
    assert detok.stop_reason == "brown" and emitted == "The quick "


def test_multibyte_stop_strings(tok, prompt):
    detok, emitted, _ = stop_case(tok, prompt, "日本語 and 中文字符 side", ("中文", "🚀"))
    assert detok.stop_reason == "中文" and emitted == "日本語 and "


def test_held_back_prefix_is_released_when_it_does_not_complete(tok, prompt):
    # "fo" and the final "f" look like the start of "fox" but never complete it
    text = "a form of f"
    detok, emitted, tail = stop_case(tok, prompt, text, ("fox",))
    assert not detok.stopped and detok.stop_reason is None
    assert emitted == "a form of " and tail == "f" and detok.text == text


def test_stop_strings_in_the_prompt_do_not_count(tok):
    prompt = tok.encode("Say fox", add_bos=True)
    detok, emitted, tail = stop_case(tok, prompt, "x marks the spot", ("fox",))
    assert not detok.stopped and emitted + tail == "x marks the spot"


def test_stop_strings_wait_for_min_tokens(tok):
    ids = tok.encode("ab ab ab", add_bos=False)
    early = IncrementalDetokenizer(tok, [0], stop=("ab",))
    assert early.add(ids) == "" and early.stopped
    # stop strings are looked for only in the text after the first min_tokens tokens'
    late = IncrementalDetokenizer(tok, [0], stop=("ab",), min_tokens=len(ids) - 1)
    head = tok.decode(ids[:-1])
    assert "".join(late.add([t]) for t in ids[:-1]) == head and not late.stopped
    tail = tok.decode(ids)[len(head):]
    late.add(ids[-1:])
    assert late.stopped == ("ab" in tail) and late.text == head + tail.split("ab")[0]
