"""The playground page in a real headless Chromium (Debian's ``chromium`` package driven by Playwright; no
browser download) against a server on the tiny models: type a prompt, watch tokens stream in with their
provenance marks and the live figures, press Stop (the server must cancel the request), compare with
plain decoding.

Needs ``apt-get install -y chromium`` and ``pip install playwright`` (the ``[playground]`` extra);
skipped with the reason otherwise, or failed when ``SPECDEC_REQUIRE_BROWSER`` is set (CI sets it).
``SPECDEC_CHROMIUM`` names another Chromium binary.
"""

import os
import shutil
import time

import pytest
from server_helpers import LONG, LiveServer, no_leaked_sequences, tiny_engine, wait_until

pytestmark = pytest.mark.browser

CHROMIUM = os.environ.get("SPECDEC_CHROMIUM") or shutil.which("chromium") or "/usr/bin/chromium"


def _missing() -> str | None:
    """Why the test cannot run here, or None."""
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        return "playwright is not installed: pip install -e '.[playground]'"
    if not os.path.exists(CHROMIUM):
        return f"no Chromium at {CHROMIUM}: apt-get install -y chromium (or set SPECDEC_CHROMIUM)"
    return None


if _missing() is not None:
    if os.environ.get("SPECDEC_REQUIRE_BROWSER"):
        pytest.fail(f"SPECDEC_REQUIRE_BROWSER is set but {_missing()}", pytrace=False)
    pytest.skip(_missing(), allow_module_level=True)
from playwright import sync_api  # noqa: E402


@pytest.fixture(scope="module")
def server(tiny_target_path):
    # draft = target, greedy: every draft is accepted, so accepted and bonus marks surely appear; each
    # target call takes 20 ms longer, so that a 400-token request is still running when Stop is pressed
    engine = tiny_engine(tiny_target_path, tiny_target_path)
    real_eval = engine.target.eval

    def slow_eval(batch):
        time.sleep(0.02)
        return real_eval(batch)

    engine.target.eval = slow_eval
    with LiveServer(engine, max_running=2) as srv:
        yield srv


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        # --no-sandbox: Chromium's sandbox refuses to run as root (CI runs as root)
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    # (Chromium also logs each 4xx response as a console error: the error test's is expected)
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" and "status of 4" not in m.text else None)
    page.goto(server.root + "/")
    yield page
    page.close()
    assert not errors, f"the page logged errors: {errors}"


def fill(page, prompt, method="draft", k="4", max_tokens="400", compare=False):
    page.select_option("#mode", "completion")
    page.select_option("#method", method)
    page.fill("#k", k)
    page.fill("#temperature", "0")
    page.fill("#max_tokens", max_tokens)
    page.fill("#prompt", prompt)
    page.set_checked("#compare", compare)


def test_stream_marks_and_stop(page, server):
    assert page.inner_text("#model") == "tiny"  # from /v1/models
    before = server.metric("specdec_requests_total", finish_reason="cancelled")
    with no_leaked_sequences(server.engine):
        fill(page, LONG)
        page.click("#generate")
        page.wait_for_selector('#run-spec .text .tok[data-source="bonus"]', timeout=30_000)
        wait_js(page, "document.querySelectorAll('#run-spec .text .tok').length >= 12")
        assert page.get_attribute("#run-spec", "data-state") == "running"
        assert page.is_enabled("#stop") and not page.is_enabled("#generate")
        # one span per token that wrote characters (the tiny model writes random bytes: a token may only
        # begin a character); every step but the prompt's is accepted drafts and a bonus
        marks = page.eval_on_selector_all("#run-spec .text .tok", "els => els.map(e => [e.dataset.source, +e.dataset.step])")
        assert marks[0] == ["plain", 0] and {s for s, _ in marks[1:]} == {"accepted", "bonus"}
        assert [st for _, st in marks] == sorted(st for _, st in marks)
        title = page.get_attribute('#run-spec .text .tok[data-source="accepted"]', "title")
        assert "accepted draft token" in title and "step 1" in title
        assert page.inner_text("#run-spec .rate") == "100.0%"  # self-speculation accepts everything
        assert float(page.inner_text("#run-spec .mal")) > 2
        wait_js(page, "document.querySelector('#run-spec .tps').textContent !== '–'")
        assert chart_ink(page, "#run-spec .chart") > 0

        page.click("#stop")
        page.wait_for_selector('#run-spec[data-state="stopped"]', timeout=10_000)
        assert page.is_enabled("#generate") and not page.is_enabled("#stop")
        wait_until(lambda: server.metric("specdec_requests_total", finish_reason="cancelled") == before + 1,
                   what="the server to cancel the stopped request")
        shown = len(page.inner_text("#run-spec .text"))
        time.sleep(0.3)
        assert len(page.inner_text("#run-spec .text")) == shown, "text kept arriving after Stop"


def test_compare_with_plain_decoding(page):
    fill(page, LONG, max_tokens="30", compare=True)
    page.click("#generate")
    page.wait_for_selector("#comparison:not([hidden])", timeout=60_000)
    line = page.inner_text("#comparison")
    assert "speculative" in line and "plain" in line and "tok/s" in line
    assert "the texts are the same" in line  # greedy: same tokens (exact numerics on the tiny models)
    assert page.get_attribute("#run-plain", "data-state") == "done"
    plain = page.eval_on_selector_all("#run-plain .text .tok", "els => els.map(e => e.dataset.source)")
    assert plain and set(plain) == {"plain"}
    assert page.inner_text("#run-plain .rate") == "–"  # nothing proposed
    assert page.inner_text("#run-spec .text") == page.inner_text("#run-plain .text")


def test_server_error_is_shown(page):
    fill(page, "hello", method="draft", k="4", max_tokens="100000")
    page.click("#generate")
    page.wait_for_selector("#error:not([hidden])", timeout=30_000)
    assert "max_tokens" in page.inner_text("#error")
    assert page.get_attribute("#run-spec", "data-state") == "error"


def wait_js(page, expression: str, timeout: float = 30.0) -> None:
    """Poll a JavaScript expression from here until true (the page's Content-Security-Policy forbids the
    in-page evaluation that Playwright's ``wait_for_function`` uses)."""
    wait_until(lambda: page.evaluate(expression), timeout, expression)


def chart_ink(page, selector: str) -> int:
    """Painted pixels of a canvas (alpha > 0)."""
    return page.eval_on_selector(selector, """c => {
        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
        let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i] > 0) n++; return n; }""")
