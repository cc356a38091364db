"""Every method by name: the proposers (:mod:`specdec.proposers`, each registered by its own module) and the
policies that compose them, registered here: ``hybrid`` (:mod:`specdec.policy.hybrid`) and ``auto``
(:mod:`specdec.policy.auto`). Read the registry, :data:`PROPOSERS`, from here: the one in
:mod:`specdec.proposers.base` holds the policies only once this module has run."""

from specdec.policy.auto import auto_factory
from specdec.policy.hybrid import hybrid_factory
from specdec.proposers import PROPOSERS, register

register("hybrid", default_k=8, uses_draft=True)(hybrid_factory)
register("auto", default_k=16, uses_draft=True)(auto_factory)

__all__ = ["PROPOSERS"]
