"""Where an FR-Spec drafter's acceptance goes: the head (tokens outside the set) or the context (stand-ins).

``python3 docs/bench/drafters/frspec_diag.py CUT.gguf [FULL_DRAFT.gguf]``: on the drafters bench's prompts
(code-edit, mt_bench, qa, 2 each, chat, 64 tokens, greedy, k = 3, ik_llama.cpp, 2 threads), the acceptance of
the full drafter, of the full drafter with its logits masked to CUT's set (the head's part alone, full
context), and of CUT itself (head and stand-ins), with the share of prompt and output tokens outside the set.
Every run's output is checked equal to plain decoding's. Prints one line per prompt and the totals.
"""

import os
import sys

import numpy as np

from specdec.api import load_engine
from specdec.backends.vocab_map import MappedDraft, read_vocab_map
from specdec.bench.prompts import load_prompts
from specdec.engine import Engine
from specdec.params import SamplingParams, SpecConfig

DEFAULT_DRAFT = os.path.expanduser("~/.cache/specdec/qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")


class Masked(MappedDraft):
    """The full drafter, its logits ``-inf`` outside the set: FR-Spec's head with the full input embedding."""

    def __init__(self, draft, target, keep):  # no map check: the drafter's ids are the target's
        self.inner, self.target, self.vocab_map = draft, target, keep
        self.eog_ids, self.n_vocab, self.name = draft.eog_ids, draft.n_vocab, draft.name + "-masked"
        self._outside = np.ones(draft.n_vocab, bool)
        self._outside[keep] = False

    def eval(self, batch):
        out = self.inner.eval(batch)
        for x in out.values():
            x[:, self._outside] = -np.inf
        return out


def main(cut: str, draft: str = DEFAULT_DRAFT) -> None:
    keep = read_vocab_map(cut)
    inset = set(keep.tolist())
    kw = dict(n_ctx=4096, n_seq_max=1, n_threads=2, backend="ik", progress=False)
    full = load_engine(None, draft, **kw)
    engines = {"full": full, "masked": Engine(full.target, Masked(full.drafts[0], full.target, keep)),
               "cut": load_engine(None, cut, **kw)}
    greedy = SamplingParams(temperature=0.0, max_tokens=64)
    totals = {name: [0, 0] for name in engines}
    for p in load_prompts(None, 2, ("code-edit", "mt_bench", "qa")):
        ids = full.encode_prompt(p.text, chat=True)
        plain = full.generate(ids, greedy, SpecConfig(method="none")).token_ids
        line = [f"{p.category}: outside the set: prompt {np.mean([t not in inset for t in ids]):.3f}, "
                f"output {np.mean([t not in inset for t in plain]):.3f};"]
        for name, engine in engines.items():
            r = engine.generate(ids, greedy, SpecConfig(method="draft", num_speculative_tokens=3))
            assert r.token_ids == plain, name
            totals[name][0] += r.stats.accepted
            totals[name][1] += r.stats.proposed
            line.append(f"{name} {r.stats.accepted}/{r.stats.proposed}")
        print(" ".join(line))
    for name, (accepted, proposed) in totals.items():
        print(f"{name}: acceptance {accepted / proposed:.3f} ({accepted}/{proposed})")


if __name__ == "__main__":
    main(*sys.argv[1:])
