"""The playground page in headless chromium against a live specd (the cycle model, behind a key).

The cycle model's reply is known exactly, and with speculation on the n-gram
proposer copies it from its own earlier cycles, so accepted drafts are certain.
"""

from __future__ import annotations

import os
import time

import httpx
import pytest
from selenium.webdriver.common.keys import Keys

from tests.support.browser import Playground, chromium_missing, start_chromium
from tests.support.server import API_KEY, finish_server, serve_args, start_server

MISSING = chromium_missing()
# CI installs the browser (.ci/run) and sets this, so there a missing browser fails instead of skipping.
REQUIRED = os.environ.get("REQUIRE_BROWSER_TESTS") == "1"
if MISSING and REQUIRED:
    raise RuntimeError(f"REQUIRE_BROWSER_TESTS=1 but {MISSING}")
pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")

TOKENS_PER_CYCLE = 14  # CYCLE_TEXT after "\n": whole cycles end on whole characters


@pytest.fixture(scope="module")
def server(cycle_model_dir, tmp_path_factory):
    args = serve_args(model=cycle_model_dir, dtype="float32", device="cpu", served_model_name="cycle", max_num_seqs=2)
    server = start_server(args, tmp_path_factory.mktemp("logs"), "playground", api_key=API_KEY)
    yield server
    finish_server(server)


@pytest.fixture(scope="module")
def driver():
    driver = start_chromium()
    yield driver
    driver.quit()


@pytest.fixture
def page(driver, server) -> Playground:
    return Playground(driver, server.url + "/")


def server_error(server, headers: dict[str, str], **fields) -> str:
    """The message the API gives for this chat request."""
    body = {"model": "cycle", "messages": [{"role": "user", "content": "hi"}], "stream": True, **fields}
    response = httpx.post(server.base_url + "/chat/completions", json=body, headers=headers)
    assert response.status_code in (400, 401), response.text
    return response.json()["error"]["message"]


def test_replies_stream_with_their_accepted_drafts_and_none_with_speculation_off(page, cycle_text):
    page.open_with_key(API_KEY)
    page.wait.until(lambda _: page.live("proposer") == "ngram" and page.live("k") == "10")
    num_tokens = 4 * TOKENS_PER_CYCLE
    page.set("temperature", "0")
    page.set("max_tokens", str(num_tokens))
    page.set("speculation", "on")
    composer = page.find("#composer").rect

    reply = page.send("go")
    assert reply.get_attribute("data-state") == "done"
    assert page.text(reply) == cycle_text.expected_chat(num_tokens)
    assert page.stat(reply, "tokens") == str(num_tokens) and page.stat(reply, "end") == "length"
    assert int(page.stat(reply, "accepted")) > 0 and page.stat(reply, "rate").endswith("%")
    assert float(page.stat(reply, "per-step")) > 1
    speculative, plain = [int(part.split()[0]) for part in page.stat(reply, "steps").split("·")]
    assert speculative > 0 and speculative + plain < num_tokens
    assert page.stat(reply, "ttft").endswith(" s") and float(page.stat(reply, "tps")) > 0
    assert len(reply.find_elements("css selector", ".text .d")) >= 2  # several chunks, shaded as they came
    assert page.find("#composer").rect == composer  # streaming did not move the controls

    page.set("speculation", "off")
    reply = page.send("again")
    assert page.text(reply) == cycle_text.expected_chat(num_tokens)
    assert page.stat(reply, "accepted") == "0" and page.stat(reply, "rate") == "–"
    assert page.stat(reply, "steps") == f"0 spec · {num_tokens} plain"
    assert reply.find_elements("css selector", ".text .d") == []


@pytest.mark.parametrize("how", ["button", "escape"])
def test_stop_ends_a_long_reply_and_the_server_lets_it_go(page, server, how):
    page.open_with_key(API_KEY)
    page.set("speculation", "off")
    page.set("max_tokens", "")  # the rest of the context: hundreds of plain steps
    reply = page.start("go")
    page.wait.until(lambda _: len(page.text(reply)) >= 8)
    if how == "button":
        page.find("#stop").click()
    else:
        page.find("#prompt").send_keys(Keys.ESCAPE)
    page.finish(reply)
    assert reply.get_attribute("data-state") == "stopped" and page.stat(reply, "end") == "stopped"
    assert 0 < int(page.stat(reply, "tokens")) < 400
    assert page.find("#send").is_enabled() and not page.find("#stop").is_enabled()
    deadline = time.monotonic() + 30
    while httpx.get(server.base_url + "/speculation", headers=server.headers).json()["requests_running"]:
        assert time.monotonic() < deadline, "the stopped request still runs on the server"
        time.sleep(0.1)
    page.wait.until(lambda _: page.live("running") == "0")


def test_api_errors_are_shown_in_the_chat(page, server):
    page.open()  # no key yet: the page asks for one
    page.wait.until(lambda _: page.find("#key").is_displayed())
    reply = page.send("hi")
    assert reply.get_attribute("data-state") == "error" and "error" in reply.get_attribute("class")
    assert page.text(reply) == server_error(server, {})  # 401: missing key

    page.find("#key").send_keys(API_KEY, "\t")
    page.wait.until(lambda _: page.find("#model").get_attribute("value") == "cycle")
    page.set("temperature", "5")
    assert page.find("#prompt").get_attribute("value") == "hi"  # kept for another try
    reply = page.send("")
    assert page.text(reply) == server_error(server, server.headers, temperature=5)
    assert reply.get_attribute("role") == "alert"

    page.find("#clear").click()
    assert page.replies() == [] and page.find("#log").text == ""
