"""The draft-model proposer where its drafter allows nothing: a row of ``-inf`` logits everywhere (an FR-Spec
drafter whose whole set a grammar forbids) ends the proposal instead of failing the request."""

import numpy as np
import pytest
from fake_lm import TableLM

from specdec.backends.cache import SequenceCache
from specdec.params import SamplingParams
from specdec.proposers import DraftModelProposer
from specdec.verify.base import RandomDraws


class Forbidding(TableLM):
    """A table model whose logits are ``-inf`` everywhere from the ``after``-th position on."""

    def __init__(self, after: int, **kwargs):
        super().__init__(**kwargs)
        self.after = after

    def logits_after(self, context):
        row = super().logits_after(context)
        return np.full_like(row, -np.inf) if len(context) >= self.after else row


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8)])
def test_a_row_without_a_finite_logit_ends_the_proposal(params):
    context = [3, 12, 36, 13, 5]
    prop = DraftModelProposer(SequenceCache(Forbidding(after=len(context) + 2)))
    try:
        prop.prepare(context)
        p = prop.propose(context, 4, params, RandomDraws(np.random.default_rng(0)))
    finally:
        prop.close()
    assert len(p.tokens) == 2 and p.draft_cost.evals == 3  # two drafts, then the row that allows nothing
    assert p.probs is None or p.probs.shape == (2, 40)
