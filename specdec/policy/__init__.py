"""``auto``: the policy that chooses, each step, a source of drafts and k (0: a plain step), by predicted
tokens per second.

- :mod:`~specdec.policy.pricing`: what an option is worth, eqs. (1)-(3), as pure functions of explicit inputs:
  a step's :class:`~specdec.policy.pricing.Choice`, the best k of a source, the bound that rules a step plain;
- :mod:`~specdec.policy.cost`: the cost model: what the engine measured (call costs ``S(n)``, draft costs
  ``D(k)``, pooled acceptance), learned from the step's reports and turned into pricing's inputs;
- :mod:`~specdec.policy.acceptance`: acceptance per kind of proposal (``alpha_i``, ``E(k)``, pooled and
  per request) and the calibration of chosen options;
- :mod:`~specdec.policy.timing`, :mod:`~specdec.policy.batch_cost`: how call costs are measured and fitted;
- :mod:`~specdec.policy.schedule`: when to probe an option that lost, and the log of predictions;
- :mod:`~specdec.policy.estimates`: a request's acceptance estimates per kind of proposal (slow start,
  calibration);
- :mod:`~specdec.policy.sources`: the sources a request composes (n-gram lookup, suffix decoding, each draft
  model), the base of both policies;
- :mod:`~specdec.policy.source`: the :class:`~specdec.policy.source.Source` protocol ``auto`` prices them
  through: each source looks at the context, offers its drafts (estimates, cost) and makes the chosen ones;
- :mod:`~specdec.policy.auto`: ``auto``, the choice among them by predicted rate, its probes and its bound;
- :mod:`~specdec.policy.tree`: the token tree a suffix path may grow when its branches pay;
- :mod:`~specdec.policy.hybrid`: ``hybrid``, the short rule by acceptance alone;
- :mod:`~specdec.policy.methods`: the registry of every method, proposers and policies.

The proposers it chooses among (:mod:`specdec.proposers`) know nothing of it. Each step's inputs reach a
policy as arguments (the load of the call, the draws), never through a field someone else wrote.
"""
