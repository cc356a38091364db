"""Bounded load test on loopback: 32 concurrent clients (streaming and not, greedy and seeded sampling),
a quarter of them hanging up mid-stream, for ``SPECDEC_LOAD_SECONDS`` seconds (default 20; the long run
by hand: ``SPECDEC_LOAD_SECONDS=120 python -m pytest -s tests/test_server_load.py``).

Passes when there are zero server errors, every completed response is whole (its text equals the one the
engine produces alone for the same request, it ends with a finish reason and ``[DONE]``, usage matches),
nothing is left running or reserved afterwards, and the resident memory grows by less than 64 MB between
the end of the first third of the run and the end.
"""

import asyncio
import json
import os
import random
import time

import httpx
import pytest
from server_helpers import LONG, PROMPTS, LiveServer, tiny_engine, wait_until

from specdec.params import SamplingParams, SpecConfig

CLIENTS = 32
SECONDS = float(os.environ.get("SPECDEC_LOAD_SECONDS", "20"))
HANG_UP = 0.25  # fraction of streaming clients that disconnect mid-stream
METHODS = ["draft", "ngram", "none"]
CASES = [(p, n, t, seed) for p in [*PROMPTS, LONG] for n, t, seed in ((16, 0.0, None), (48, 0.0, None), (24, 0.8, 3))]


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@pytest.fixture(scope="module")
def engine(tiny_target_path, tiny_draft_path):
    return tiny_engine(tiny_target_path, tiny_draft_path)


async def one_request(http, url, case, expected, rng, tally):
    prompt, max_tokens, temperature, seed = case
    stream = rng.random() < 0.75
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "seed": seed,
            "stream": stream, "stream_options": {"include_usage": True} if stream else None,
            "speculative": {"method": (method := rng.choice(METHODS))}}
    # greedy output is the same for every method; seeded sampling consumes the RNG per method
    ref_text, ref_tokens, ref_finish = expected[case, method if temperature else "none"]
    if not stream:
        r = await http.post(f"{url}/completions", json=body)
        tally["status"][r.status_code] = tally["status"].get(r.status_code, 0) + 1
        if r.status_code == 200:
            choice = r.json()["choices"][0]
            assert (choice["text"], choice["finish_reason"]) == (ref_text, ref_finish), case
            assert r.json()["usage"]["completion_tokens"] == ref_tokens
            tally["complete"] += 1
        return
    hang_up_after = rng.randint(1, 4) if rng.random() < HANG_UP else None
    async with http.stream("POST", f"{url}/completions", json=body) as r:
        tally["status"][r.status_code] = tally["status"].get(r.status_code, 0) + 1
        if r.status_code != 200:
            return
        events = []
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if hang_up_after is not None and len(events) >= hang_up_after:
                    tally["hung_up"] += 1
                    return  # leaving the block closes the connection mid-stream
    assert events[-1] == "[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert "error" not in chunks[-1], chunks[-1]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
    assert (text, finish) == (ref_text, ref_finish), case
    assert chunks[-1]["usage"]["completion_tokens"] == ref_tokens
    tally["complete"] += 1
    tally["tokens"] += ref_tokens


async def client_loop(i, url, expected, deadline, tally):
    rng = random.Random(i)
    async with httpx.AsyncClient(timeout=120) as http:
        while time.monotonic() < deadline:
            await one_request(http, url, rng.choice(CASES), expected, rng, tally)


def test_load_with_disconnects(engine):
    expected = {}
    for case in CASES:
        prompt, max_tokens, temperature, seed = case
        ids = engine.target.tokenize(prompt, special=True)
        for method in METHODS if temperature else ["none"]:
            res = engine.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed),
                                  SpecConfig(method=method))
            expected[case, method] = (res.text, len(res.token_ids), res.finish_reason)
    tally = {"status": {}, "complete": 0, "hung_up": 0, "tokens": 0}
    with LiveServer(engine, max_running=8, max_waiting=64) as srv:

        async def main():
            start = time.monotonic()
            loops = [asyncio.create_task(client_loop(i, srv.url, expected, start + SECONDS, tally))
                     for i in range(CLIENTS)]
            await asyncio.sleep(SECONDS / 3)
            rss_early = rss_mb()
            await asyncio.gather(*loops)
            return rss_early, time.monotonic() - start

        rss_early, elapsed = asyncio.run(main())
        wait_until(lambda: srv.metric("specdec_num_requests_running") == 0
                   and srv.metric("specdec_num_requests_waiting") == 0, what="the server to go idle")
        rss_end = rss_mb()
        errors = srv.metric("specdec_requests_total", finish_reason="error")
        cancelled = srv.metric("specdec_requests_total", finish_reason="cancelled")
    print(f"\nload: {CLIENTS} clients, {elapsed:.0f} s: {tally['complete']} complete, {tally['hung_up']} hung up "
          f"({cancelled:.0f} cancelled in the server), statuses {tally['status']}, "
          f"{tally['tokens'] / elapsed:.0f} streamed tokens/s, RSS {rss_early:.0f} -> {rss_end:.0f} MB")
    assert set(tally["status"]) == {200}, tally["status"]
    assert errors == 0
    assert tally["complete"] >= CLIENTS and tally["hung_up"] >= 1
    assert not engine.target.busy_sequences and not engine.draft.busy_sequences
    assert rss_end - rss_early < 64, f"memory grew from {rss_early:.0f} to {rss_end:.0f} MB"
