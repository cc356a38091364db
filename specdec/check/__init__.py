"""``specdec check``: test that speculative decoding reproduces the target's distribution.

:mod:`specdec.check.statistics` holds the exact cell probabilities and the chi-square test;
:mod:`specdec.check.sampler` drives the engine (the exact target rows, and samples drawn with
speculation through the speculative step).
"""

from specdec.check.sampler import (
    CheckResult, retained_prompt, run_check, sample_prefixes, target_next_dist, validate_check,
)
from specdec.check.statistics import EOG, POOLS, CellTable, Fit, exact_cells, goodness_of_fit

__all__ = ["EOG", "POOLS", "CellTable", "CheckResult", "Fit", "exact_cells", "goodness_of_fit", "retained_prompt",
           "run_check", "sample_prefixes", "target_next_dist", "validate_check"]
