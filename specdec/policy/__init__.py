"""``auto``: the policy that chooses, each step, a source of drafts and k (0: a plain step), by predicted
tokens per second.

- :mod:`~specdec.policy.cost`: the cost model (eq. (3)): measured call costs ``S(n)``, draft costs ``D(k)``,
  pooled acceptance per kind of proposal, calibration, and the best k of an option;
- :mod:`~specdec.policy.timing`, :mod:`~specdec.policy.batch_cost`: how call costs are measured and fitted;
- :mod:`~specdec.policy.schedule`: when to probe an option that lost, and the log of predictions;
- :mod:`~specdec.policy.auto`: the choice among the sources a request has (n-gram lookup, suffix decoding,
  each draft model), its probes and its bound;
- :mod:`~specdec.policy.tree`: the token tree a suffix path may grow when its branches pay.

The proposers it chooses among (:mod:`specdec.proposers`) know nothing of it; ``hybrid``, the
acceptance-only rule, lives with them (:mod:`specdec.proposers.hybrid`), and so does the proposer that
composes the sources for both.
"""
