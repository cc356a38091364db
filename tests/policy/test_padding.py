"""The padding row put to work (issues 46, 47): where the target pads a one-token step to two rows (exact
numerics), a step ``auto`` prices plain carries a free guess (the n-gram continuation) in that row instead,
except one plain step in :data:`~specdec.policy.auto.PLAIN_EVERY`, which keeps ``S(1)`` measured; elsewhere
plain stays plain. Greedy text is unchanged (the same-output tests; here: an exact tiny engine, auto against
plain)."""

from __future__ import annotations

import pytest
from policy_helpers import GREEDY, FrozenCost, cpu_seconds

from specdec.params import SamplingParams, SpecConfig
from specdec.policy.auto import PLAIN_EVERY, AutoProposer
from specdec.types import ALONE

CONTEXT = [5, 6, 7, 8, 5, 6, 7, 9, 5, 6]  # "5 6" seen before: the n-gram continuation is 7


def plain_steps(padded: bool, n: int) -> list:
    p = AutoProposer(cost_model=FrozenCost(cpu_seconds), padded_steps=padded)
    p.prepare(CONTEXT)
    p.choose = lambda *a, **kw: p.cost.plain(True, ALONE)  # every step priced plain (prose, here)
    return [p.propose(CONTEXT, 4, GREEDY, None) for _ in range(n)]


def test_a_plain_step_carries_the_n_gram_guess_where_steps_are_padded():
    steps = plain_steps(True, 2 * PLAIN_EVERY)
    guesses = [s for s in steps if s.tokens]
    assert len(guesses) == 2 * (PLAIN_EVERY - 1)  # every PLAIN_EVERY-th stays plain, measuring S(1)
    assert all(s.tokens == [7] and s.kind.startswith("ngram") for s in guesses)
    assert not steps[PLAIN_EVERY - 1].tokens


def test_plain_stays_plain_where_a_draft_would_cost_a_row():
    assert not any(s.tokens for s in plain_steps(False, 2 * PLAIN_EVERY))


def test_no_guess_before_s1_is_measured():
    p = AutoProposer(padded_steps=True)  # a fresh cost model: S(1) unknown, the first steps measure it
    p.prepare(CONTEXT)
    assert not p.propose(CONTEXT, 4, GREEDY, None).tokens


def plain_choice(self, offers, greedy, load=ALONE):
    return self.cost.plain(greedy, load)


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=48),
                                    SamplingParams(max_tokens=48, temperature=0.8, seed=3)], ids=["greedy", "seeded"])
def test_the_guesses_change_no_output(tiny_target_path, tiny_draft_path, params, monkeypatch):
    from server_helpers import tiny_engine

    # every step priced plain, as prose is: which steps auto speculates on otherwise depends on the CPU's timings
    monkeypatch.setattr(AutoProposer, "choose", plain_choice)

    engine = tiny_engine(tiny_target_path, tiny_draft_path, n_seq_max=2, backend="ik_llama.cpp")
    try:
        assert engine.target.numerics == "exact"
        prompt = "1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2"
        plain = engine.generate(prompt, params, SpecConfig(method="none"))
        auto = engine.generate(prompt, params, SpecConfig(method="auto"))
        assert auto.token_ids == plain.token_ids
        # every step was priced plain, so each draft verified was a free guess in the padding row
        assert auto.stats.proposed > 0
    finally:
        engine.close()
