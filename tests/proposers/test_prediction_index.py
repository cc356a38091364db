"""Where the output stands in a client's prediction (specdec.proposers.prediction): aligned from the first
output token, re-aligned after an edit on the longest output suffix found in the prediction, nearest after
where the alignment was lost."""

from __future__ import annotations

from specdec.proposers.prediction import PredictionIndex

PROMPT = [90, 91, 92]


def index(prediction, n_min=1, n_max=3):
    p = PredictionIndex(prediction, n_min, n_max)
    p.prepare(len(PROMPT))
    return p


def test_aligned_from_the_first_output_token():
    p = index([1, 2, 3, 4, 5])
    assert p.lookup(PROMPT, 3) == [1, 2, 3]  # before any output: the prediction's start
    assert p.lookup(PROMPT + [1, 2], 2) == [3, 4]
    assert p.lookup(PROMPT + [1, 2, 3, 4, 5], 4) == []  # used up


def test_a_changed_token_realigns_on_the_next_match():
    p = index(list(range(1, 11)))
    assert p.lookup(PROMPT + [1, 2, 99], 3) == []  # 99 is nowhere in the prediction
    assert p.lookup(PROMPT + [1, 2, 99, 4], 3) == [5, 6, 7]


def test_a_deletion_and_an_insertion_realign():
    p = index(list(range(1, 11)))
    assert p.lookup(PROMPT + [1, 2, 5], 2) == [6, 7]  # 3 and 4 left out
    q = index(list(range(1, 11)))
    assert q.lookup(PROMPT + [1, 2, 50, 51], 2) == []  # inserted text
    assert q.lookup(PROMPT + [1, 2, 50, 51, 3], 2) == [4, 5]  # back in the prediction


def test_the_occurrence_after_the_edit_is_preferred():
    prediction = [5, 6, 7, 1, 2, 5, 6, 8]  # "5 6" twice
    p = index(prediction)
    assert p.lookup(PROMPT + [5, 6, 7, 1, 2], 1) == [5]
    assert p.lookup(PROMPT + [5, 6, 7, 1, 2, 40, 5, 6], 2) == [8]  # the second "5 6", after the loss point
    q = index(prediction)
    assert q.lookup(PROMPT + [40, 5, 6], 1) == [7]  # lost at the start: the first occurrence


def test_longest_suffix_first_and_a_cut_back_output_starts_over():
    p = index([1, 2, 3, 9, 2, 4])
    assert p.lookup(PROMPT + [7, 3, 9, 2], 1) == [4]  # "3 9 2" beats the first lone "2"
    assert p.lookup(PROMPT, 2) == [1, 2]  # the output was cut back to nothing: aligned from the top again
    p.prepare(len(PROMPT) + 2)  # a longer prompt (another chunk): the output starts after it
    assert p.lookup(PROMPT + [7, 7], 2) == [1, 2]
