"""The playground page in a real browser: Debian's headless chromium driven through its chromedriver.

    driver = start_chromium()
    page = Playground(driver, server.url)
    page.open_with_key(server.api_key)
    reply = page.send("go")  # waits for the reply to end (done, stopped or error)

Used by tests/server/test_playground.py and docs/screenshots.py. Nothing is
downloaded: selenium is given the driver's path, so its driver manager never runs.
"""

from __future__ import annotations

import shutil

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support import expected_conditions
from selenium.webdriver.support.ui import Select, WebDriverWait

CHROMIUM = "chromium"
CHROMEDRIVER = "chromedriver"
WAIT_S = 60


def chromium_missing() -> str | None:
    """Why the browser cannot run here, or None."""
    absent = [name for name in (CHROMIUM, CHROMEDRIVER) if shutil.which(name) is None]
    if absent:
        return f"{' and '.join(absent)} not found: install Debian's chromium and chromium-driver (.ci/run does)"
    return None


def start_chromium(width: int = 1280, height: int = 860) -> webdriver.Chrome:
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which(CHROMIUM) or CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--no-first-run",
                f"--window-size={width},{height}", "--force-device-scale-factor=1"):  # fmt: skip
        options.add_argument(arg)
    return webdriver.Chrome(options=options, service=Service(shutil.which(CHROMEDRIVER) or CHROMEDRIVER))


def set_color_scheme(driver: webdriver.Chrome, scheme: str) -> None:
    """Emulate `prefers-color-scheme: light | dark`."""
    feature = {"name": "prefers-color-scheme", "value": scheme}
    driver.execute_cdp_cmd("Emulation.setEmulatedMedia", {"features": [feature]})


class Playground:
    """The page's controls, by the ids the page gives them."""

    def __init__(self, driver: webdriver.Chrome, url: str, wait_s: float = WAIT_S):
        self.driver = driver
        self.url = url
        self.wait = WebDriverWait(driver, wait_s)

    def find(self, css: str) -> WebElement:
        return self.driver.find_element(By.CSS_SELECTOR, css)

    def open(self) -> None:
        self.driver.get(self.url)

    def open_with_key(self, api_key: str) -> None:
        """Load the page, type the key when the page asks for it, and wait for the model list."""
        self.open()
        key = self.wait.until(expected_conditions.visibility_of_element_located((By.ID, "key")))
        key.send_keys(api_key, Keys.TAB)  # `change` fires on leaving the field
        self.wait.until(lambda _: self.find("#model").get_attribute("value"))

    def set(self, field: str, value: str) -> None:
        """Type `value` into a text or number field (replacing what is there), or pick it in a select."""
        element = self.find("#" + field)
        if element.tag_name == "select":
            Select(element).select_by_value(value)
        else:
            element.send_keys(Keys.CONTROL, "a")
            element.send_keys(Keys.DELETE)
            element.send_keys(value)

    def replies(self) -> list[WebElement]:
        return self.driver.find_elements(By.CSS_SELECTOR, "#log .assistant")

    def start(self, prompt: str) -> WebElement:
        """Type `prompt`, press Enter; the new reply's element."""
        before = len(self.replies())
        self.find("#prompt").send_keys(prompt, Keys.ENTER)
        self.wait.until(lambda _: len(self.replies()) > before)
        return self.replies()[-1]

    def finish(self, reply: WebElement) -> WebElement:
        self.wait.until(lambda _: reply.get_attribute("data-state"))
        return reply

    def send(self, prompt: str) -> WebElement:
        return self.finish(self.start(prompt))

    @staticmethod
    def stat(reply: WebElement, name: str) -> str:
        return reply.find_element(By.CSS_SELECTOR, f'[data-stat="{name}"]').text

    @staticmethod
    def text(reply: WebElement) -> str:
        """The reply's text exactly as the page holds it (`.text` would trim and fold whitespace)."""
        return reply.find_element(By.CSS_SELECTOR, ".text").get_attribute("textContent") or ""

    def live(self, name: str) -> str:
        """A figure of the live strip (`proposer`, `k`, `running`, ...)."""
        return self.find("#s-" + name).text
