"""Verifiers: one file each, one registry, one signature.

:data:`VERIFIERS` maps a name to a :class:`~specdec.verify.base.Verifier` whose ``fn(candidates, rows,
rng)`` judges a step's candidates against the target's rows. ``greedy`` (temperature 0), ``token``
(speculative sampling, Leviathan et al. 2023) and ``block`` (Sun et al. 2024) judge one chain; ``gumbel``
(drafter-invariant, Daliri et al. 2024) judges one or several candidates of any kind by the position noise;
``tree`` judges several candidates by the target's own token (greedy requests), and ``multi`` several
sampled or point-mass candidates by recursive rejection sampling (SpecInfer, Miao et al. 2024).
:func:`select_verifier` and :func:`multi_candidate_verifier` are the one place that decides which a
sequence uses. Verifiers know token ids and arrays, never proposers or models.
"""

from __future__ import annotations

from specdec.params import SAMPLING_VERIFIERS, SamplingParams, SpecConfig
from specdec.verify.base import Draft, RandomDraws, TargetRows, Verifier, VerifyResult, single_chain
from specdec.verify.block import block_acceptance, block_residual, verify_block
from specdec.verify.greedy import greedy, verify_greedy
from specdec.verify.gumbel import NoiseDraws, PositionNoise
from specdec.verify.multi import next_residual, verify_multi
from specdec.verify.token import accept_probability, residual_distribution, verify_speculative
from specdec.verify.tree import verify_tree

VERIFIERS: dict[str, Verifier] = {
    "greedy": Verifier("greedy", greedy, sampling=False),
    "token": Verifier("token", single_chain(verify_speculative), sampling=True),
    "block": Verifier("block", single_chain(verify_block), sampling=True),
    "gumbel": Verifier("gumbel", verify_tree, sampling=True, multi=True, noise=True),
    "tree": Verifier("tree", verify_tree, sampling=False, multi=True),
    "multi": Verifier("multi", verify_multi, sampling=True, multi=True),
}
"""Verifiers by name; the ``sampling`` ones are the choices of ``SpecConfig.verify``."""
assert tuple(name for name, v in VERIFIERS.items() if v.sampling) == SAMPLING_VERIFIERS, (
    "specdec.params.SAMPLING_VERIFIERS, which SpecConfig checks, must list the sampling verifiers in this order")

SEEDED_VERIFIER = "gumbel"
"""The verifier of seeded sampled requests when ``SpecConfig.verify`` is not given: the same seed gives the
same text whatever the proposer, k, batch or timing, equal to seeded plain decoding."""

UNSEEDED_VERIFIER = "block"
"""The verifier of unseeded sampled requests when ``SpecConfig.verify`` is not given (it accepts at least
as many drafts as ``token`` and, measured on the default pair, more than ``gumbel``)."""


def select_verifier(params: SamplingParams, spec: SpecConfig) -> Verifier:
    """The verifier of a request's single-candidate steps: ``greedy`` when ``params.greedy``; else
    ``spec.verify`` when given; else :data:`SEEDED_VERIFIER` for a seeded request and
    :data:`UNSEEDED_VERIFIER` otherwise. Steps with several candidates use a ``multi`` verifier
    (:func:`multi_candidate_verifier`)."""
    if params.greedy:
        return VERIFIERS["greedy"]
    if spec.verify is not None:
        return VERIFIERS[spec.verify]
    return VERIFIERS[SEEDED_VERIFIER if params.seed is not None else UNSEEDED_VERIFIER]


def multi_candidate_verifier(single: Verifier) -> Verifier:
    """The verifier of a step that submits several candidates, for a sequence whose single-candidate
    verifier is ``single``: itself when it judges trees (``gumbel`` for seeded requests: the same text
    whatever the candidates; ``multi``); ``multi`` for the other sampled requests (``token``, ``block``);
    ``tree`` for greedy ones (the argmax walk)."""
    if single.multi:
        return single
    return VERIFIERS["multi" if single.sampling else "tree"]


__all__ = [
    "Draft", "NoiseDraws", "PositionNoise", "RandomDraws", "SEEDED_VERIFIER", "TargetRows", "UNSEEDED_VERIFIER",
    "VERIFIERS", "Verifier", "VerifyResult", "accept_probability", "block_acceptance", "block_residual",
    "multi_candidate_verifier", "next_residual", "residual_distribution", "select_verifier", "single_chain",
    "verify_block", "verify_greedy", "verify_multi", "verify_speculative", "verify_tree",
]
