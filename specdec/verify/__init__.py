"""Verifiers: one file each, one registry, one signature.

:data:`VERIFIERS` maps a name to a :class:`~specdec.verify.base.Verifier` whose ``fn(candidates, rows,
rng)`` judges a step's candidates against the target's rows. ``greedy`` (temperature 0), ``token``
(speculative sampling, Leviathan et al. 2023) and ``block`` (Sun et al. 2024) judge one chain; ``tree``
judges several point-mass candidates. :func:`select_verifier` is the one place that decides which a
sequence uses. Verifiers know token ids and arrays, never proposers or models.
"""

from __future__ import annotations

from specdec.params import SamplingParams, SpecConfig
from specdec.verify.base import Draft, TargetRows, Verifier, VerifyResult, single_chain
from specdec.verify.block import block_acceptance, block_residual, verify_block
from specdec.verify.greedy import greedy, verify_greedy
from specdec.verify.token import accept_probability, residual_distribution, verify_speculative
from specdec.verify.tree import verify_tree

VERIFIERS: dict[str, Verifier] = {
    "greedy": Verifier("greedy", greedy, sampling=False),
    "token": Verifier("token", single_chain(verify_speculative), sampling=True),
    "block": Verifier("block", single_chain(verify_block), sampling=True),
    "tree": Verifier("tree", verify_tree, sampling=False, multi=True),
}
"""Verifiers by name; the ``sampling`` ones are the choices of ``SpecConfig.verify``."""


def select_verifier(params: SamplingParams, spec: SpecConfig) -> Verifier:
    """The verifier of a request's single-candidate steps: ``greedy`` when ``params.greedy``, else
    ``spec.verify``. Steps with several candidates use ``tree``."""
    return VERIFIERS["greedy" if params.greedy else spec.verify]


def multi_candidate_verifier() -> Verifier:
    """The verifier of steps that submit several candidates."""
    return VERIFIERS["tree"]


__all__ = [
    "Draft", "TargetRows", "VERIFIERS", "Verifier", "VerifyResult", "accept_probability", "block_acceptance",
    "block_residual", "multi_candidate_verifier", "residual_distribution", "select_verifier", "single_chain",
    "verify_block", "verify_greedy", "verify_speculative", "verify_tree",
]
