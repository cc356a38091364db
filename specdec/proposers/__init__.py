"""Proposers: one file per method, registered by name in :data:`PROPOSERS`."""

from specdec.proposers.base import EMPTY_PROPOSAL, PROPOSERS, Proposal, Proposer
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.hybrid import HybridProposer
from specdec.proposers.ngram import NgramProposer

__all__ = ["EMPTY_PROPOSAL", "PROPOSERS", "Proposal", "Proposer", "DraftModelProposer", "HybridProposer",
           "NgramProposer"]
