"""``--explain``: one line per ``auto`` step that states every option's price, the choice and why; turning it on
never changes a choice."""

from __future__ import annotations

import logging
import re

import numpy as np
from policy_helpers import GREEDY, FrozenCost, copy_text, cpu_seconds, feedback

from specdec.policy.auto import AutoProposer, log
from specdec.proposers import EMPTY_PROPOSAL

OPTION = re.compile(r"(?P<name>[\w:]+)(?: k=(?P<k>\d+))?(?: \+\d+ tree)? (?P<tokens>[\d.]+) tok / "
                    r"(?P<ms>[\d.]+) ms = (?P<rate>[\d.]+) tok/s")


def run(text, prompt_len, explain: bool, caplog):
    """Drive ``auto`` over a scripted greedy text (the target is the text); returns its proposals and the
    log lines it wrote."""
    cost = FrozenCost(cpu_seconds)
    p = AutoProposer(cost_model=cost)
    p.prepare(text[:prompt_len])
    context, proposals = list(text[:prompt_len]), []
    caplog.clear()
    with caplog.at_level(logging.DEBUG if explain else logging.WARNING, logger=log.name):
        while len(context) < len(text) - 1:
            proposal = p.propose(context, min(8, len(text) - len(context) - 1), GREEDY, np.random.default_rng(0))
            proposals.append((tuple(proposal.tokens), proposal.kind))
            truth, a = text[len(context):], 0
            while a < len(proposal.tokens) and proposal.tokens[a] == truth[a]:
                a += 1
            context += truth[: a + 1]
            if proposal.tokens:
                feedback(p, cost, context, proposal, a)
    return proposals, [r.getMessage() for r in caplog.records if r.name == log.name]


def test_explain_prints_one_line_a_step_that_names_the_choice_and_changes_nothing(caplog):
    text = copy_text(seed=3)
    quiet, none = run(text, 150, False, caplog)
    explained, lines = run(text, 150, True, caplog)
    assert none == []
    assert explained == quiet  # the same choices with the log on
    assert len(lines) == len(explained)
    kinds = set()
    for (tokens, kind), line in zip(explained, lines):
        options, _, chosen = line.partition(" -> ")
        priced = {m["name"]: m for m in OPTION.finditer(options)}
        assert "plain" in priced, line
        plain_rate = float(priced["plain"]["rate"])
        assert float(priced["plain"]["tokens"]) == 1.0
        reason = re.fullmatch(r"(.+) \((.+)\)", chosen)
        assert reason, line
        if not tokens:
            assert chosen.startswith("plain ("), line
            continue
        kinds.add(kind)
        name, k = re.match(r"([\w:]+) k=(\d+)", chosen).groups()
        assert (name, int(k)) == (kind, len(tokens)), line
        if "probe" not in chosen:  # a choice on the merits beats plain at the prices the line shows
            assert float(priced[name]["rate"]) > plain_rate, line
            assert "the best option" in reason.group(2)
    assert any(kind.startswith("ngram") for kind in kinds)  # the copy was drafted, and explained
    assert any(line.partition(" -> ")[2].startswith("plain (") for line in lines)  # and the novel text was plain


def test_explain_before_the_first_measurement_says_so(caplog):
    p = AutoProposer()  # a fresh cost model: S(1) unknown
    p.prepare([1, 2, 3, 1, 2])
    with caplog.at_level(logging.DEBUG, logger=log.name):
        proposal = p.propose([1, 2, 3, 1, 2], 4, GREEDY, np.random.default_rng(0))
    assert proposal == EMPTY_PROPOSAL
    assert [r.getMessage() for r in caplog.records] == ["auto @5: plain (S(1) not measured yet: a plain step measures it)"]


def test_explain_is_refused_where_auto_makes_no_decisions(capsys):
    from specdec.cli import main

    assert main(["generate", "hello", "--method", "ngram", "--explain"]) != 0
    err = capsys.readouterr().err
    assert "--explain" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_explain_and_stream_are_one_or_the_other(capsys):
    from specdec.cli import main

    assert main(["generate", "hello", "--explain", "--stream"]) != 0
    err = capsys.readouterr().err
    assert "--explain" in err and "--stream" in err and len(err.strip().splitlines()) == 1
