"""The chat page (GET /) in a real browser: headless Chromium from Debian's packages, driven by
Selenium through Debian's /usr/bin/chromedriver (never a driver fetched online), against a real
`mpiexec -n 2 python -m pipeline serve` of the tiny scripted model (tests/scripted_chat_model.py).

What it checks in the browser: the page loads from the package and names the served model; a
typed question streams its answer into the conversation with the server's tok/s; with thinking on
(chat_template_kwargs) the reasoning lands in its collapsible block, folded once the answer
starts, and the answer beside it; the stop button aborts an answer and the page goes on. The
screenshot is saved under the test's temporary folder and its path printed.

Under CI=true a missing Chromium, driver or Selenium fails the test; elsewhere it skips, saying so.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from scripted_chat_model import ANSWER, CALL, THOUGHT, make_scripted_chat_model

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")


def browser_or_skip():
    missing = [str(p) for p in (CHROMIUM, CHROMEDRIVER) if not p.exists()]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("the selenium package (pip install -e '.[test]')")
    if missing:
        message = f"no browser to test the chat page: {', '.join(missing)} missing (apt-get install -y chromium chromium-driver)"
        if os.environ.get("CI") == "true":
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture
def driver(tmp_path):
    browser_or_skip()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--no-first-run", "--disable-dev-shm-usage",
                 "--window-size=1200,900", f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    yield driver
    driver.quit()
    shutil.rmtree(tmp_path / "chromium-profile", ignore_errors=True)


@pytest.fixture
def server(tmp_path):
    from test_serve import ENV, Server
    from conftest import REPO

    browser_or_skip()  # before the model is built and the server started
    folder = make_scripted_chat_model(tmp_path / "model")
    server = Server(2, "--model", str(folder), "--max-tokens", "64",
                    env={**os.environ, **ENV, "PYTHONPATH": str(REPO)})
    yield server
    assert server.stop() == 0, server.stderr


def test_chat_page_in_a_browser(server, driver, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, 60)
    driver.get(server.base + "/")
    wait.until(lambda d: d.find_element(By.ID, "model-name").text == server.name)

    def ask(question: str):
        """Type a question, send it with Enter, and wait for its answer to end; the answer's element."""
        before = len(driver.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
        driver.find_element(By.ID, "prompt").send_keys(question, "\n")
        wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) > before)
        answer = driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")[before]
        wait.until(lambda d: answer.get_attribute("data-finish"))
        return answer

    # A plain answer, streamed in, with the server's speed under it
    answer = ask("What's the weather like in Paris?")
    assert answer.find_element(By.CLASS_NAME, "content").text == f"<tool_call>{CALL}</tool_call>"
    assert answer.get_attribute("data-finish") == "stop"
    stats = answer.find_element(By.CLASS_NAME, "stats").text
    assert "tok/s" in stats and "tokens" in stats, stats
    assert not answer.find_element(By.CSS_SELECTOR, "details.reasoning").is_displayed()  # no thinking, no block

    # Thinking on: the reasoning in its block, folded once the answer came
    driver.find_element(By.ID, "thinking").click()
    answer = ask("Hello!")
    details = answer.find_element(By.CSS_SELECTOR, "details.reasoning")
    assert details.is_displayed() and details.get_attribute("open") is None
    assert answer.find_element(By.CLASS_NAME, "content").text == ANSWER
    driver.execute_script("arguments[0].open = true", details)  # unfold it for the screenshot
    assert details.text.endswith(THOUGHT)

    # Stop: the answer is aborted (the click comes before any token), and the page goes on
    driver.find_element(By.ID, "prompt").send_keys("Stop this one.")
    driver.execute_script("document.getElementById('send').click(); document.getElementById('stop').click();")
    stopped = driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")[-1]
    wait.until(lambda d: stopped.get_attribute("data-finish"))
    assert stopped.get_attribute("data-finish") == "stopped"
    assert driver.find_element(By.ID, "send").is_enabled() and not driver.find_element(By.ID, "stop").is_enabled()
    answer = ask("And again?")
    assert answer.find_element(By.CLASS_NAME, "content").text == ANSWER

    screenshot = tmp_path / "chat_page.png"
    driver.execute_script("document.querySelectorAll('details.reasoning').forEach(d => d.open = true)")
    assert driver.save_screenshot(str(screenshot))
    assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and screenshot.stat().st_size > 10_000
    print(f"chat page screenshot: {screenshot}")
