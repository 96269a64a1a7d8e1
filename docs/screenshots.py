"""Screenshots of the playground (docs/playground-light.png, docs/playground-dark.png).

    .venv/bin/python -m docs.screenshots [--model ID|PATH]

Starts specd on 127.0.0.1 (the bundled SmolLM2 unless --model), has one
short chat in headless chromium (Debian's chromium and chromium-driver), and
saves the page in light and dark mode.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from tests.support.browser import Playground, chromium_missing, set_color_scheme, start_chromium
from tests.support.server import finish_server, serve_args, start_server

DOCS = Path(__file__).resolve().parent
# Copy-heavy: the reply repeats the prompt's text, which the n-gram proposer drafts from.
PROMPT = (
    "Correct the spelling, change nothing else: Speculative decodng lets a cheap drafter propose several "
    "tokens, and the big model checks them all in one forward pass. When the drafts are rigth, one step "
    "yields many tokens."
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model to serve [default: the bundled SmolLM2]")
    args = parser.parse_args()
    if reason := chromium_missing():
        raise SystemExit(reason)
    with tempfile.TemporaryDirectory() as log_dir:
        server = start_server(serve_args(model=args.model, device="cpu"), Path(log_dir), "screenshots")
        driver = start_chromium(width=1280, height=760)
        try:
            page = Playground(driver, server.url + "/", wait_s=300)
            page.open()
            page.wait.until(lambda _: page.find("#model").get_attribute("value"))
            page.set("temperature", "0")
            page.set("max_tokens", "96")
            page.send(PROMPT)
            page.wait.until(lambda _: page.live("running") == "0")
            for scheme in ("light", "dark"):
                set_color_scheme(driver, scheme)
                path = DOCS / f"playground-{scheme}.png"
                driver.save_screenshot(str(path))
                print(f"{path.relative_to(DOCS.parent)}: {path.stat().st_size} bytes")
        finally:
            driver.quit()
            finish_server(server)


if __name__ == "__main__":
    main()
