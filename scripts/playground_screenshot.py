"""Screenshot of the playground while a running server decodes a prompt (for docs/playground.png).

    specdec serve --port 8000 &
    python3 scripts/playground_screenshot.py --url http://127.0.0.1:8000 --out docs/playground.png

Drives Debian's Chromium (``apt-get install -y chromium``) with Playwright (``pip install -e '.[playground]'``):
fills the form, generates with "compare" on, and saves a screenshot once both answers are done.
"""

from __future__ import annotations

import argparse

from playwright.sync_api import sync_playwright

PROMPT = """Add type hints and a docstring to this function; return the whole function.

def merge(a, b):
    out = []
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--out", default="docs/playground.png")
    ap.add_argument("--method", default="", help="empty: the server's default")
    ap.add_argument("--max-tokens", default="160")
    ap.add_argument("--chromium", default="/usr/bin/chromium")
    args = ap.parse_args()
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1360, "height": 900}, device_scale_factor=1)
        page.goto(args.url + "/")
        page.select_option("#method", args.method)
        page.fill("#max_tokens", args.max_tokens)
        page.fill("#temperature", "0")
        page.fill("#prompt", PROMPT)
        page.set_checked("#compare", True)
        page.click("#generate")
        page.wait_for_selector("#comparison:not([hidden])", timeout=600_000)
        page.mouse.move(0, 0)
        page.screenshot(path=args.out, full_page=True)
        print(page.inner_text("#comparison"))
        browser.close()


if __name__ == "__main__":
    main()
