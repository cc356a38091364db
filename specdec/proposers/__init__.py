"""Proposers: one file per method, registered by name in :data:`PROPOSERS`. ``hybrid`` and ``auto``, which
compose these, are policies (:mod:`specdec.policy`) and register themselves there."""

from specdec.proposers.base import (
    EMPTY_PROPOSAL, PROPOSERS, DraftCost, Outcome, Proposal, Proposer, ProposerContext, ProposerEntry, drafter_kinds,
    is_draft_kind, register,
)
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.ngram import NgramProposer
from specdec.proposers.suffix import SuffixProposer

__all__ = ["EMPTY_PROPOSAL", "PROPOSERS", "DraftCost", "DraftModelProposer", "NgramProposer",
           "Outcome", "Proposal", "Proposer", "ProposerContext", "ProposerEntry", "SuffixProposer", "drafter_kinds",
           "is_draft_kind", "register"]
