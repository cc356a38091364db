"""Adaptive thread counts (issue 40): the tuner keeps the fast count on an idle machine, drops to fewer threads
when other load makes the calls of the full count slow, comes back when the load leaves, and never changes a
call's logits (the GGUF libraries give each output element to one thread)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from conftest import tiny_backend

from specdec.backends.threads import FEWER_PERIOD, FIRST_PERIOD, LAST_PERIOD, TRIAL_CALLS, ThreadTuner

QUIET = {2: 0.077, 1: 0.145}
"""Seconds of a plain call by thread count on an idle 2-core machine (the default target, measured: 13.0 and
6.9 tok/s)."""
BUSY = {2: 0.400, 1: 0.141}
"""The same with another process spinning on one core (measured: 2.5 and 7.1 tok/s): the 2-thread barrier
waits on a descheduled thread."""


def simulate(tuner: ThreadTuner, costs: dict[int, float], calls: int, rng: random.Random, sizes=(1,)) -> list[int]:
    """Run ``calls`` calls with jittered costs (+-10%); the thread count of each call."""
    used = []
    for i in range(calls):
        n = sizes[i % len(sizes)]
        t = tuner.threads
        used.append(t)
        tuner.observe(n, costs[t] * n ** 0.5 * rng.uniform(0.9, 1.1))
    return used


def test_an_idle_machine_keeps_the_full_count_and_pays_little_for_looking():
    tuner, rng = ThreadTuner(2, others=lambda: None), random.Random(0)
    used = simulate(tuner, QUIET, 5000, rng, sizes=(1, 2, 5))
    assert tuner.threads == 2
    late = used[1000:]
    assert late.count(1) / len(late) < 0.01  # trials cut short at their first slower call
    seconds = sum(QUIET[t] for t in used)
    assert seconds / (5000 * QUIET[2]) < 1.02


def test_other_load_moves_to_fewer_threads_and_back():
    tuner, rng = ThreadTuner(2, others=lambda: None), random.Random(1)
    simulate(tuner, QUIET, 600, rng)
    assert tuner.threads == 2
    busy = simulate(tuner, BUSY, 2000, rng)
    first = busy.index(1)
    assert first <= 3 and all(t == 1 for t in busy[first + TRIAL_CALLS + 4: first + FIRST_PERIOD])
    speed = len(busy) / sum(BUSY[t] for t in busy)
    assert speed >= 0.5 / QUIET[2]  # at least half the idle machine's speed (2 threads: 0.18x)
    assert len(busy) / sum(BUSY[2] for _ in busy) < 0.2 / QUIET[2]
    quiet = simulate(tuner, QUIET, 1000, rng)
    back = quiet.index(2)
    assert back <= FEWER_PERIOD + 1 and quiet[-100:].count(2) >= 98


def test_large_calls_are_not_timed_and_one_core_has_nothing_to_choose():
    tuner = ThreadTuner(2)
    for _ in range(3 * LAST_PERIOD):
        assert tuner.observe(512, 5.0) is None
    assert tuner.threads == 2
    one = ThreadTuner(1)
    assert all(one.observe(1, 0.1) is None for _ in range(1000)) and one.threads == 1
    with pytest.raises(ValueError):
        ThreadTuner(0)


def test_counts_tried_are_halves():
    assert ThreadTuner(8).counts == [8, 4, 2, 1]


@pytest.mark.parametrize("backend", ["llama.cpp", "ik_llama.cpp"])
def test_changing_threads_never_changes_logits(tiny_target_path, backend):
    """The same calls with the thread count changed between them give bitwise the same logits."""
    rows = []
    for switch in (False, True):
        with tiny_backend(tiny_target_path, backend, n_threads=2, n_seq_max=1, n_ctx=256) as b:
            s = b.new_sequence()
            out = [b.eval({s: (list(range(40, 120)), 2)})[s]]
            for i, t in enumerate(range(130, 200, 3)):
                if switch:
                    b._lib_set_threads(1 + i % 2)
                out.append(b.eval({s: ([t, t + 1], 2)})[s])
            rows.append(np.concatenate(out))
    assert np.array_equal(rows[0], rows[1])


def test_explicit_threads_are_fixed(tiny_target_path):
    with tiny_backend(tiny_target_path, "llama.cpp", n_threads=2, n_seq_max=1) as b:
        assert b._tuner is None and b.threads_now == 2
    with tiny_backend(tiny_target_path, "llama.cpp", n_threads=2, n_seq_max=1, adaptive_threads=True) as b:
        assert b._tuner is not None and b.threads_now == 2


def test_other_processes_cpu_use_brings_the_full_count_back_at_once():
    """When other processes stop using cores (/proc/stat), more threads are tried at the next call, not a
    period later; when they start, fewer."""
    load = {"others": 0.0}
    tuner, rng = ThreadTuner(2, others=lambda: load["others"]), random.Random(2)
    simulate(tuner, QUIET, 100, rng)
    load["others"] = 1.0
    busy = simulate(tuner, BUSY, 300, rng)
    assert busy.index(1) <= 1 and busy[-50:].count(1) >= 49
    load["others"] = 0.0
    quiet = simulate(tuner, QUIET, 100, rng)
    assert quiet.index(2) <= 1 and quiet[-50:].count(2) >= 49


def test_other_load_reads_a_spinning_process():
    import subprocess
    import sys
    import time

    from specdec.backends.threads import OtherLoad

    probe = OtherLoad()
    if probe() is None and probe._last is None:
        pytest.skip("no /proc/stat here")
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        probe = OtherLoad()
        time.sleep(1.2)
        assert probe() >= 0.5
    finally:
        spin.kill()
        spin.wait()
