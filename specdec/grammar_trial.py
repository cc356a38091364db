"""``python -m specdec.grammar_trial FD STACK_BYTES``: a grammar trial process
(:class:`specdec.grammar_compile.TrialWorkers` starts it; :func:`specdec.grammar.serve_trials` is what it does)."""

import os
import sys

from specdec.grammar import serve_trials

if __name__ == "__main__":
    serve_trials(int(sys.argv[1]), int(sys.argv[2]))
    os._exit(0)  # llguidance's threads need no orderly shutdown
