"""The chat page (GET /) in a real browser: headless Chromium from Debian's packages, driven by
Selenium through Debian's /usr/bin/chromedriver (never a driver fetched online), against one real
`mpiexec -n 2 python -m pipeline serve` (shared by the tests here) of the tiny scripted model
(tests/scripted_chat_model.py), with three more scripts: a Markdown answer with a fenced code
block, an answer of hostile HTML, and an endless "tick tock" for an answer that is still streaming.

What it checks in the browser: the page loads from the package and names the served model; a
typed question streams its answer into the conversation with the server's tok/s; with thinking on
(chat_template_kwargs) the reasoning lands in its collapsible block, folded once the answer
starts, and the answer beside it; the stop button aborts an answer and the page goes on. Answers
are Markdown: a code block highlighted, with a copy button that copies the code; the model's HTML
shown as text and a javascript: link disarmed (nothing of it runs); the conversation is back
after a reload, and edit-and-resend replaces the answer; "New chat" pressed while an answer
streams keeps that partial answer in the old conversation and sends none of it with the next
question; a setting out of the API's range is refused with a sentence, and the settings are
reachable on a phone-width screen. The screenshots are saved under the tests' temporary folders
and their paths printed.

Under CI=true a missing Chromium, driver or Selenium fails the test; elsewhere it skips, saying so.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
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
    options.set_capability("goog:loggingPrefs", {"browser": "SEVERE"})  # the page's errors, for page_errors()
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    yield driver
    driver.quit()
    shutil.rmtree(tmp_path / "chromium-profile", ignore_errors=True)


# The page's own scripts: each question below makes the model answer with its script, whole strings
# as added tokens (a code block in three steps, so it streams in with its fence still open).
CODE_QUESTION, HOSTILE_QUESTION, LONG_QUESTION = "Show me some code.", "Show me some HTML.", "Count for a while."
CODE = ["Here is a function that adds two numbers:\n\n```python\n", "def add(a, b):\n    return a + b\n",
        "```\n\nCall it as `add(2, 3)`."]
HOSTILE = ('<img src=x onerror="window.pwned = 1"> <script>window.pwned = 2</script> '
           '[a link](javascript:window.pwned=3) ![a picture](x" onerror="window.pwned=4)')
TICKS = ["tick ", "tock "]  # each the other's successor: an answer that goes on to max_tokens
MARKERS = {CODE_QUESTION: "<|code|>", HOSTILE_QUESTION: "<|hostile|>", LONG_QUESTION: "<|long|>"}
GENERATION_PROMPT = "{%- if add_generation_prompt %}<|im_start|>assistant\n{% if thinking %}<think>{% endif %}{% endif %}"


def make_page_model(folder: Path) -> Path:
    """scripted_chat_model's model, whose template also ends the prompt with a marker token when the
    last question is one of MARKERS': the marker starts that question's script, the way "<think>"
    starts the thinking one (each script's tokens get axes of their own, past those already used)."""
    import tokenizers
    from safetensors.numpy import load_file, save_file

    make_scripted_chat_model(folder)
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_tokens([*MARKERS.values(), *CODE, HOSTILE, *TICKS])
    tok.save(str(folder / "tokenizer.json"))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert GENERATION_PROMPT in config["chat_template"]
    markers = "".join(f'{{% elif messages[-1].content == "{q}" %}}{m}' for q, m in MARKERS.items())
    config["chat_template"] = config["chat_template"].replace(
        GENERATION_PROMPT, GENERATION_PROMPT.replace("{% endif %}", markers + "{% endif %}", 1))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))

    scripts = [[MARKERS[CODE_QUESTION], *CODE, "<|im_end|>"], [MARKERS[HOSTILE_QUESTION], HOSTILE, "<|im_end|>"],
               [MARKERS[LONG_QUESTION], *TICKS, TICKS[0]]]
    weights = load_file(str(folder / "model.safetensors"))
    embed, head = weights["model.embed_tokens.weight"], weights["lm_head.weight"]
    assert tok.get_vocab_size() <= embed.shape[0], "the scripted model's vocabulary has no room for the new tokens"
    axis = int(np.flatnonzero(np.abs(head).sum(axis=0)).max()) + 1  # the first axis no script uses yet
    for script in scripts:
        ids = [tok.token_to_id(text) for text in script]
        for current, successor in zip(ids, ids[1:]):
            embed[current] = 0
            embed[current, axis] = 1.0
            head[successor, axis] = 10.0
            axis += 1
    assert axis <= embed.shape[1]
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from test_serve import ENV, Server
    from conftest import REPO

    browser_or_skip()  # before the model is built and the server started
    folder = make_page_model(tmp_path_factory.mktemp("chat-page") / "model")
    server = Server(2, "--model", str(folder), "--max-tokens", "64",
                    env={**os.environ, **ENV, "PYTHONPATH": str(REPO)})
    yield server
    assert server.stop() == 0, server.stderr


def open_page(driver, server):
    """The page loaded and connected (it named the model); a WebDriverWait of 60 s."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = WebDriverWait(driver, 60)
    driver.get(server.base + "/")
    wait.until(lambda d: d.find_element(By.ID, "model-name").text == server.name)
    return wait


def ask_and_wait(driver, wait, question: str):
    """Type a question, send it with Enter, and wait for its answer to end; the answer's element."""
    from selenium.webdriver.common.by import By

    before = len(driver.find_elements(By.CSS_SELECTOR, ".msg.assistant"))
    driver.find_element(By.ID, "prompt").send_keys(question, "\n")
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant")) > before)
    answer = driver.find_elements(By.CSS_SELECTOR, ".msg.assistant")[before]
    wait.until(lambda d: answer.get_attribute("data-finish"))
    return answer


def stored_chats(driver) -> list[dict]:
    return json.loads(driver.execute_script("return localStorage.getItem('pipeline-chats')") or "[]")


def test_chat_page_in_a_browser(server, driver, tmp_path):
    from selenium.webdriver.common.by import By

    wait = open_page(driver, server)

    def ask(question: str):
        return ask_and_wait(driver, wait, question)

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


def page_errors(driver) -> list[str]:
    """The page's own JavaScript errors and failed loads so far (the browser's favicon.ico request aside)."""
    return [e["message"] for e in driver.get_log("browser") if "favicon.ico" not in e["message"]]


def test_markdown_answers_and_conversations_kept(server, driver, tmp_path):
    from selenium.webdriver.common.by import By

    wait = open_page(driver, server)
    answer = ask_and_wait(driver, wait, CODE_QUESTION)
    assert answer.get_attribute("data-finish") == "stop"

    def check_rendered(answer):
        """The answer as Markdown: its paragraph, its highlighted code block with a copy button, inline code."""
        content = answer.find_element(By.CLASS_NAME, "content")
        assert content.find_element(By.TAG_NAME, "p").text == "Here is a function that adds two numbers:"
        code = content.find_element(By.CSS_SELECTOR, ".code-block pre > code.hljs.language-python")
        assert code.get_attribute("textContent") == CODE[1].rstrip("\n")
        assert {e.get_attribute("class") for e in code.find_elements(By.CSS_SELECTOR, "span")} >= {"hljs-keyword"}
        assert content.find_element(By.CSS_SELECTOR, ".code-bar").text.startswith("python")
        assert content.find_element(By.CSS_SELECTOR, "p > code").text == "add(2, 3)"
        return content.find_element(By.CSS_SELECTOR, ".code-block button.copy-code")

    copy = check_rendered(answer)
    # The copy button copies the code alone (the clipboard is the page's; the test reads what it was given)
    driver.execute_script("window.copied = []; navigator.clipboard.writeText = async (t) => { window.copied.push(t); };")
    copy.click()
    wait.until(lambda d: d.execute_script("return window.copied.length"))
    assert driver.execute_script("return window.copied") == [CODE[1].rstrip("\n")]
    assert copy.text == "Copied"
    answer.find_element(By.CSS_SELECTOR, ".actions button.copy").click()  # the whole answer: its Markdown
    wait.until(lambda d: d.execute_script("return window.copied.length") == 2)
    assert driver.execute_script("return window.copied[1]") == "".join(CODE)

    screenshot = tmp_path / "chat_page_markdown.png"
    assert driver.save_screenshot(str(screenshot))
    print(f"chat page screenshot (Markdown): {screenshot}")

    # After a reload: the conversation is back, rendered again, and listed
    driver.refresh()  # returns once the page loaded: it draws the stored conversation as it loads
    assert [m.text for m in driver.find_elements(By.CSS_SELECTOR, ".msg.user .content")] == [CODE_QUESTION]
    check_rendered(driver.find_element(By.CSS_SELECTOR, ".msg.assistant"))
    assert [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#chat-list .open-chat")] == [CODE_QUESTION]

    # Edit and resend: the question changed, its old answer replaced by the new question's
    driver.find_element(By.CSS_SELECTOR, ".msg.user button.edit").click()
    box = driver.find_element(By.CSS_SELECTOR, ".msg.user textarea.edit-box")
    box.clear()
    box.send_keys(HOSTILE_QUESTION)
    driver.find_element(By.CSS_SELECTOR, ".msg.user button.send-edit").click()
    wait.until(lambda d: d.find_element(By.CSS_SELECTOR, ".msg.assistant").get_attribute("data-finish"))
    (chat,) = stored_chats(driver)
    assert [(m["role"], m["content"]) for m in chat["messages"]] == [("user", HOSTILE_QUESTION), ("assistant", HOSTILE)]
    assert page_errors(driver) == []


def test_the_model_html_is_shown_not_run(server, driver):
    from selenium.webdriver.common.by import By

    wait = open_page(driver, server)
    content = ask_and_wait(driver, wait, HOSTILE_QUESTION).find_element(By.CLASS_NAME, "content")
    assert content.text.startswith('<img src=x onerror="window.pwned = 1"> <script>window.pwned = 2</script>')
    assert content.find_elements(By.CSS_SELECTOR, "img, script, [onerror]") == []
    link = content.find_element(By.TAG_NAME, "a")  # the Markdown link stays, without its javascript: target
    assert link.text == "a link" and link.get_attribute("href") is None
    assert driver.execute_script("return window.pwned") is None
    assert page_errors(driver) == []


def test_new_chat_while_an_answer_streams_starts_clean(server, driver):
    from selenium.webdriver.common.by import By

    wait = open_page(driver, server)
    driver.find_element(By.ID, "max-tokens").send_keys("400")  # the endless answer runs ~2 s: time to interrupt it
    driver.execute_script("""window.sent = []; const fetch = window.fetch;
        window.fetch = (url, options) => { if (url.endsWith('/chat/completions')) window.sent.push(JSON.parse(options.body));
                                           return fetch(url, options); };""")
    driver.find_element(By.ID, "prompt").send_keys(LONG_QUESTION, "\n")
    # "New chat" the moment the answer shows its first words (in the page: no round trip of the test's between)
    driver.execute_async_script("""const done = arguments[0];
        const poll = () => { const a = document.querySelector('.msg.assistant .content');
                             if (a && a.textContent) { document.getElementById('clear').click(); done(); }
                             else setTimeout(poll, 5); };
        poll();""")
    assert driver.find_elements(By.CSS_SELECTOR, ".msg") == []
    answer = ask_and_wait(driver, wait, CODE_QUESTION)
    assert answer.find_elements(By.CSS_SELECTOR, "pre > code.hljs")

    first, second = driver.execute_script("return window.sent")
    assert first["messages"] == [{"role": "user", "content": LONG_QUESTION}] and first["max_tokens"] == 400
    assert second["messages"] == [{"role": "user", "content": CODE_QUESTION}]
    new, old = stored_chats(driver)
    assert [m["content"] for m in new["messages"]] == [CODE_QUESTION, "".join(CODE)]
    question, partial = old["messages"]  # the interrupted answer stays where it was asked, as far as it got
    assert question["content"] == LONG_QUESTION and partial["finish"] == "stopped"
    assert partial["content"].startswith("tick ") and len(partial["content"]) < 400 * len("tick ")
    assert [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#chat-list .open-chat")] == [CODE_QUESTION,
                                                                                                 LONG_QUESTION]
    driver.find_elements(By.CSS_SELECTOR, "#chat-list .open-chat")[1].click()  # and it is there to go back to
    assert [m.text for m in driver.find_elements(By.CSS_SELECTOR, ".msg .content")] == [LONG_QUESTION, partial["content"].strip()]
    assert page_errors(driver) == []


def test_settings_checked_and_reachable_on_a_phone(server, driver):
    from selenium.webdriver.common.by import By

    driver.set_window_size(390, 844)
    wait = open_page(driver, server)
    top_p = driver.find_element(By.ID, "top-p")
    assert not top_p.is_displayed()  # the settings are a drawer here
    driver.find_element(By.ID, "toggle-settings").click()
    assert top_p.is_displayed()
    top_p.clear()
    top_p.send_keys("1.5")
    driver.find_element(By.CSS_SELECTOR, "#settings .close-panel").click()
    assert not top_p.is_displayed()
    driver.find_element(By.ID, "prompt").send_keys("Hello?", "\n")
    notice = driver.find_element(By.ID, "notice")  # shown at the key press
    assert notice.text == "Check the settings: Top p must be more than 0 and at most 1; it is 1.5."
    assert top_p.is_displayed() and top_p.get_attribute("aria-invalid") == "true"  # the drawer opened on it
    assert driver.find_elements(By.CSS_SELECTOR, ".msg") == []  # nothing was sent
    assert driver.find_element(By.ID, "prompt").get_attribute("value") == "Hello?"  # nor the question lost
    top_p.clear()
    top_p.send_keys("0.9")
    driver.find_element(By.ID, "toggle-settings").click()
    answer = ask_and_wait(driver, wait, "")  # the question still typed, sent with Enter
    assert answer.get_attribute("data-finish") == "stop" and not driver.find_element(By.ID, "notice").is_displayed()
    assert page_errors(driver) == []


def test_server_gone_and_back(server, driver):
    """A request the server refuses (400) says why in words. The server's URLs blocked (Chromium fails the page's requests as it does for a stopped server; no
    "offline" event, unlike its offline emulation): the question's answer says so in words and the dot
    turns red; unblocked, the dot turns green by itself (polling) and Regenerate answers the question."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    wait = open_page(driver, server)
    dot = driver.find_element(By.ID, "connection")
    assert dot.get_attribute("data-state") == "online" and dot.text == "connected"
    # A 400 first: the server's own message, in a sentence
    driver.execute_script("document.getElementById('prompt').value = 'word '.repeat(2000)")
    answer = ask_and_wait(driver, wait, "")
    error = answer.find_element(By.CLASS_NAME, "error-text").text
    assert error.startswith("The server could not take this request: ") and "context" in error, error
    driver.find_element(By.ID, "clear").click()
    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd("Network.setBlockedURLs", {"urls": ["*/health", "*/v1/*"]})
    answer = ask_and_wait(driver, wait, CODE_QUESTION)
    assert answer.get_attribute("data-finish") == "error" and "error" in answer.get_attribute("class")
    assert answer.find_element(By.CLASS_NAME, "error-text").text.startswith("The server can't be reached")
    wait.until(lambda d: dot.get_attribute("data-state") == "offline")
    assert dot.text == "server unreachable"

    driver.execute_cdp_cmd("Network.setBlockedURLs", {"urls": []})
    WebDriverWait(driver, 10).until(lambda d: dot.get_attribute("data-state") == "online")  # polled every 2 s
    assert driver.find_element(By.ID, "notice").text == "The server is back."
    answer.find_element(By.CSS_SELECTOR, "button.regenerate").click()
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg.assistant .content pre")) == 1)
    answer = driver.find_element(By.CSS_SELECTOR, ".msg.assistant")
    wait.until(lambda d: answer.get_attribute("data-finish") == "stop")
    chat, refused = stored_chats(driver)
    assert [m["role"] for m in chat["messages"]] == ["user", "assistant"] and not chat["messages"][1]["error"]
    assert refused["messages"][1]["finish"] == "error"
    assert [e for e in page_errors(driver) if "ERR_BLOCKED_BY_CLIENT" not in e and "status of 400" not in e] == []


def test_scrolling_yields_to_the_reader(server, driver):
    """While an answer streams: the view follows it at the bottom, stays where the reader scrolled up
    to (a "Latest" button shown), and follows again once they are back at the bottom."""
    from selenium.webdriver.common.by import By

    open_page(driver, server)
    driver.find_element(By.ID, "max-tokens").send_keys("1000")  # the server clips it at the context's end
    driver.set_window_size(390, 520)  # a phone's width, a short screen: the endless answer soon overflows it
    driver.find_element(By.ID, "prompt").send_keys(LONG_QUESTION, "\n")
    seen = driver.execute_async_script("""const done = arguments[0], box = document.getElementById('conversation');
        const sleep = (ms) => new Promise((wake) => setTimeout(wake, ms));
        const gap = () => box.scrollHeight - box.scrollTop - box.clientHeight;
        const answer = () => document.querySelector('.msg.assistant');
        const length = () => answer().querySelector('.content').textContent.length;
        (async () => {
            while (!answer() || box.scrollHeight < box.clientHeight + 40) await sleep(5);
            const following = gap();
            box.scrollTop = 0;  // the reader scrolls up
            await sleep(200);
            const before = length();
            await sleep(200);
            const reading = {top: box.scrollTop, grew: length() > before,
                             button: !document.getElementById('to-bottom').hidden};
            box.scrollTop = box.scrollHeight;  // and back down
            await sleep(100);
            const resumed = length();
            await sleep(200);
            done({following, reading, back: {gap: gap(), grew: length() > resumed, finish: answer().dataset.finish}});
        })();""")
    assert seen["following"] < 12, seen
    assert seen["reading"] == {"top": 0, "grew": True, "button": True}, seen
    assert seen["back"]["grew"] and seen["back"]["gap"] < 12, seen  # the answer went on, and the view with it


def test_vendored_files_served_and_nothing_else(server):
    """GET /static/NAME: the vendored scripts and style with their types, cacheable; not the folder's
    README or licenses, nor a path out of it."""
    import http.client

    def get(path: str):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
        conn.request("GET", path)
        response = conn.getresponse()
        body = response.read()
        conn.close()
        return response.status, response.getheader("content-type"), response.getheader("cache-control"), body

    vendor = Path(__file__).resolve().parent.parent / "pipeline" / "serve" / "static" / "vendor"
    for name, kind in [("marked.umd.js", "text/javascript"), ("purify.min.js", "text/javascript"),
                       ("highlight.min.js", "text/javascript"), ("highlight-github.min.css", "text/css")]:
        status, content_type, cache, body = get("/static/" + name)
        assert (status, content_type.split(";")[0], cache) == (200, kind, "public, max-age=86400"), name
        assert body == (vendor / name).read_bytes()
    for path in ["/static/README.md", "/static/marked.LICENSE", "/static/chat.html", "/static/..%2Fapp.py",
                 "/static/../app.py", "/static/nothing.js"]:
        assert get(path)[0] == 404, path


def test_two_tabs_keep_both_their_chats(server, driver):
    """Two tabs of the page write one list in localStorage: a chat started in each is kept (and listed in
    both). Deleting one takes two clicks."""
    from selenium.webdriver.common.by import By

    wait = open_page(driver, server)
    first = driver.current_window_handle
    driver.switch_to.new_window("tab")
    open_page(driver, server)
    ask_and_wait(driver, wait, CODE_QUESTION)
    driver.switch_to.window(first)  # this tab loaded its list before the other tab's chat existed
    assert [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#chat-list .open-chat")] == [CODE_QUESTION]
    ask_and_wait(driver, wait, HOSTILE_QUESTION)
    assert [c["title"] for c in stored_chats(driver)] == [HOSTILE_QUESTION, CODE_QUESTION]
    assert [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#chat-list .open-chat")] == [HOSTILE_QUESTION,
                                                                                                 CODE_QUESTION]
    delete = driver.find_elements(By.CSS_SELECTOR, "#chat-list .delete-chat")[1]
    delete.click()
    assert delete.text == "Delete?" and len(stored_chats(driver)) == 2  # a second click deletes
    delete.click()
    assert [c["title"] for c in stored_chats(driver)] == [HOSTILE_QUESTION]
    assert [e.text for e in driver.find_elements(By.CSS_SELECTOR, "#chat-list .open-chat")] == [HOSTILE_QUESTION]


def test_without_its_libraries_the_page_still_works(server, driver):
    """/static/ unreachable (its URLs blocked): the page says so and shows answers as plain text."""
    from selenium.webdriver.common.by import By

    driver.execute_cdp_cmd("Network.enable", {})
    driver.execute_cdp_cmd("Network.setBlockedURLs", {"urls": ["*/static/*"]})
    wait = open_page(driver, server)
    assert driver.find_element(By.ID, "notice").text.startswith("The page's Markdown libraries did not load")
    content = ask_and_wait(driver, wait, CODE_QUESTION).find_element(By.CLASS_NAME, "content")
    assert content.text == "".join(CODE).strip() and content.find_elements(By.CSS_SELECTOR, "*") == []
