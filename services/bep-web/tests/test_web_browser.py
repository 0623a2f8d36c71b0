"""The build page in a real browser (headless Chromium driven by Selenium, installed by
``scripts/install-chromium`` when missing) against the web server and a real ingest:
the log viewer renders only the lines in view of a 20,000-line log, in a Web Worker,
with colours; the page follows the build live (new targets and tests, the log's tail,
the final status) until it ends.

The server runs in this test's event loop, so every browser call runs in a thread.
Every wait is a WebDriverWait on a condition, with a timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
from conveyor_bep.bazel import build_event_stream_pb2 as bes
from conveyor_testkit.bep import request, sample_events
from conveyor_testkit.bep_web import (  # noqa: F401  (pytest fixtures)
    WebRig,
    web_rig_fixture,
)
from conveyor_testkit.browser import browser_fixture, chromium_ready_fixture  # noqa: F401
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.support.ui import WebDriverWait

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.nats]


ROOT = Path(__file__).resolve().parents[3]
WAIT = 30.0
LINES = 20_000
T = TypeVar("T")


async def wait(driver: WebDriver, condition: Callable[[WebDriver], T], message: str) -> T:
    """``condition`` polled (in a thread, the server keeps serving) until true."""
    ignored = (StaleElementReferenceException, NoSuchElementException)
    waiter = WebDriverWait(driver, WAIT, poll_frequency=0.1, ignored_exceptions=ignored)
    return await asyncio.to_thread(waiter.until, condition, message)


def js(driver: WebDriver, script: str) -> Any:
    """Run ``script`` in the page (blocking: call through ``asyncio.to_thread``)."""
    return driver.execute_script(script)


def log_line(driver: WebDriver, number: int) -> str | None:
    """The text of log line ``number`` (1-based) as rendered, without its number; None
    when it is not in the DOM."""
    text = driver.execute_script(
        "const e = document.querySelector('.log-line[data-line=\"' + arguments[0] + '\"]');"
        "return e ? e.textContent.slice(e.firstChild.textContent.length) : null;",
        number,
    )
    return None if text is None else str(text)


def progress(text: str) -> bes.BuildEvent:
    return bes.BuildEvent(progress=bes.Progress(stderr=text))


async def test_the_build_page_renders_a_big_log_virtually_and_follows_the_build(
    web_rig: WebRig, browser: WebDriver, tmp_path: Path
) -> None:
    driver = browser
    inv = "browser-1"
    feed = web_rig.feed()
    seq = 1
    await feed.send(request(inv, seq, bazel=sample_events()[0]))
    text = "\x1b[31mred line 1\x1b[0m\n" + "".join(
        f"line {i} of the log\n" for i in range(2, LINES + 1)
    )
    for start in range(0, len(text), 200_000):  # commits under the batch size
        seq += 1
        await feed.send(request(inv, seq, bazel=progress(text[start : start + 200_000])))

    await asyncio.to_thread(driver.get, f"{web_rig.web.url}/b/{inv}")
    viewport = "#log-viewport"
    await wait(
        driver,
        lambda d: (
            d.find_element(By.CSS_SELECTOR, viewport).get_attribute("data-lines") == str(LINES)
        ),
        "the whole log indexed",
    )
    assert (
        await asyncio.to_thread(
            js, driver, "return document.querySelector('#log-viewport').dataset.worker"
        )
        == "on"
    )
    # Following: the end is in view, and only what is in view is in the DOM.
    await wait(
        driver,
        lambda d: d.find_elements(By.CSS_SELECTOR, f'.log-line[data-line="{LINES}"]'),
        "the last line in view",
    )
    rendered = await asyncio.to_thread(
        lambda: len(driver.find_elements(By.CSS_SELECTOR, ".log-line"))
    )
    assert 5 < rendered < 100, rendered
    spacer = await asyncio.to_thread(
        js, driver, "return document.querySelector('#log-spacer').offsetHeight"
    )
    assert spacer > LINES * 10  # as tall as every line

    # Scroll to the top: line 1, red; to the middle: line 10,000.
    await asyncio.to_thread(
        js,
        driver,
        "document.querySelector('#log-follow').click();"
        "document.querySelector('#log-viewport').scrollTop = 0;",
    )
    await wait(driver, lambda d: log_line(d, 1) == "red line 1", "the first line")
    red = await asyncio.to_thread(
        lambda: driver.find_element(By.CSS_SELECTOR, '.log-line[data-line="1"] span.fg1').text
    )
    assert red == "red line 1"
    await asyncio.to_thread(
        js,
        driver,
        "const v = document.querySelector('#log-viewport');"
        "const h = document.querySelector('.log-line').getBoundingClientRect().height;"
        "v.scrollTop = 9999 * h;",
    )
    await wait(driver, lambda d: log_line(d, 10000) == "line 10000 of the log", "the middle")
    rendered = await asyncio.to_thread(
        lambda: len(driver.find_elements(By.CSS_SELECTOR, ".log-line"))
    )
    assert rendered < 100

    # Live: a new target, a test result, more log, then the end.
    await wait(
        driver,
        lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-live") == "on",
        "live",
    )
    configured = bes.BuildEvent(configured=bes.TargetConfigured(target_kind="sh_test rule"))
    configured.id.target_configured.label = "//live:t"
    seq += 1
    await feed.send(request(inv, seq, bazel=configured))
    await wait(
        driver,
        lambda d: d.find_elements(By.CSS_SELECTOR, '#targets tr[data-label="//live:t"]'),
        "the new target",
    )
    result = bes.BuildEvent(test_result=bes.TestResult(status=bes.FAILED, status_details="boom"))
    result.id.test_result.label = "//live:t"
    result.id.test_result.run = result.id.test_result.shard = result.id.test_result.attempt = 1
    seq += 1
    await feed.send(request(inv, seq, bazel=result))
    await wait(
        driver,
        lambda d: (
            "boom" in d.find_element(By.CSS_SELECTOR, '#tests tr[data-label="//live:t"]').text
        ),
        "the new test result",
    )
    seq += 1
    await feed.send(request(inv, seq, bazel=progress("the tail\n")))
    await wait(
        driver,
        lambda d: (
            d.find_element(By.CSS_SELECTOR, viewport).get_attribute("data-lines") == str(LINES + 1)
        ),
        "the tail",
    )
    assert (
        await asyncio.to_thread(
            lambda: driver.find_element(By.ID, "status").get_attribute("data-status")
        )
    ) == "running"
    finished = bes.BuildEvent(
        finished=bes.BuildFinished(exit_code=bes.BuildFinished.ExitCode(name="SUCCESS", code=0))
    )
    finished.last_message = True
    await feed.send(request(inv, seq + 1, bazel=finished))
    await feed.send(request(inv, seq + 2, finished=True))
    await wait(
        driver,
        lambda d: d.find_element(By.ID, "status").get_attribute("data-status") == "success",
        "the final status",
    )
    await wait(
        driver,
        lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-live") == "ended",
        "the stream's end",
    )
    await asyncio.to_thread(
        js,
        driver,
        "const v = document.querySelector('#log-viewport'); v.scrollTop = v.scrollHeight;",
    )
    await wait(driver, lambda d: log_line(d, LINES + 1) == "the tail", "the tail in view")
    # For a look when it fails (pytest keeps tmp_path).
    await asyncio.to_thread(driver.save_screenshot, str(tmp_path / "build.png"))
