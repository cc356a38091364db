"""What a client sends cannot hurt the server or another client (issue 13): bad requests leak nothing,
chat contents cannot forge turns, the Host/Origin checks stop DNS rebinding, the API key guards
/metrics, and a dead scheduler fails every request at once instead of hanging them."""

import httpx
import pytest
from server_helpers import LiveServer, no_leaked_sequences, tiny_engine


@pytest.fixture(scope="module")
def engine(tiny_target_path, tiny_draft_path):
    return tiny_engine(tiny_target_path, tiny_draft_path, n_seq_max=8)


@pytest.fixture(scope="module")
def server(engine):
    with LiveServer(engine, max_running=8) as srv:
        yield srv


def test_bad_logit_bias_leaks_no_draft_sequence(server, engine):
    """Defect 1: eight requests with an out-of-vocabulary logit_bias id each leaked a draft sequence,
    and every later draft request got a 500 until restart."""
    bad = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "logit_bias": {"999999": 1}}
    good = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "speculative": {"method": "draft"}}
    with no_leaked_sequences(engine):
        for _ in range(engine.draft.n_seq_max + 1):
            r = httpx.post(f"{server.url}/completions", json=bad, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["message"].startswith("logit_bias"), r.text
        for _ in range(engine.draft.n_seq_max + 1):
            r = httpx.post(f"{server.url}/completions", json=good, timeout=60)
            assert r.status_code == 200, r.text
