"""A scripted proposer shared by the tests: it proposes the continuation of a known token sequence (the
target's own greedy text, say), wrong at chosen output positions, so a test decides what gets accepted."""

from __future__ import annotations

from specdec.proposers import Proposal
from specdec.proposers.base import DraftCost
from specdec.types import ALONE, Load


class ScriptedProposer:
    """Proposes ``script[pos:pos+k]`` after ``prompt_len`` prompt tokens, each token at an output position in
    ``wrong_at`` replaced by the next id (mod ``vocab``), under proposal kind ``kind``.

    Attributes:
        calls: ``(output position, drafts)`` of each proposal.
        loads: The load each proposal was told shares the call.
    """

    def __init__(self, prompt_len: int, script, wrong_at=(), vocab: int = 256, kind: str | None = None):
        self.prompt_len, self.script, self.wrong_at = prompt_len, list(script), set(wrong_at)
        self.vocab, self.kind = vocab, kind
        self.calls: list[tuple[int, int]] = []
        self.loads: list[Load] = []

    def prepare(self, context):
        pass

    def propose(self, context, k, params, draws, load: Load = ALONE) -> Proposal:
        pos = len(context) - self.prompt_len
        toks = [(self.script[j] + 1) % self.vocab if j in self.wrong_at else self.script[j]
                for j in range(pos, min(pos + k, len(self.script)))]
        self.calls.append((pos, len(toks)))
        self.loads.append(load)
        return Proposal(tokens=toks, kind=self.kind if toks else None)

    def observe(self, outcome):
        pass

    def close(self):
        pass


class ScriptedDrafter:
    """A drafter that proposes the true ``text`` with every ``miss``-th draft wrong (the policy prices it by its
    statistics; it stands in for a draft model's tokens); with ``token_seconds``, it reports that many seconds a
    drafted token (what the cost model times a drafter by)."""

    def __init__(self, text: list[int], miss: int = 7, token_seconds: float | None = None):
        self.text, self.miss, self.token_seconds = text, miss, token_seconds

    def prepare(self, context):
        pass

    def catchup(self, context):
        return 1

    def propose(self, context, k, params, draws, kind="draft"):
        truth = self.text[len(context): len(context) + k]
        tokens = [t if (len(context) + i) % self.miss else t + 1 for i, t in enumerate(truth)]
        cost = None if self.token_seconds is None else DraftCost(k, 1, k * self.token_seconds, kind)
        return Proposal(tokens=tokens, kind=kind, draft_cost=cost)

    def close(self):
        pass
