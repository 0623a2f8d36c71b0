"""The ``/ui`` dashboard in a real browser: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, installed by ``scripts/install-chromium`` when missing) driven by
Selenium, against real processes: an api with tokens, a dispatcher, maintenance, an SDK
worker and the REST process (``python -m conveyor_rest``).

Every wait is a WebDriverWait on a condition, with a timeout. The screenshots of the main
pages go to the test's tmp_path; with ``CONVEYOR_UPDATE_SCREENSHOTS=1`` they are copied to
docs/screenshots/ (which README shows).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from conveyor_broker.postgres import migrate
from conveyor_runtime.embedded_nats import EmbeddedNats, free_port
from conveyor_testkit.browser import browser_fixture, chromium_ready_fixture  # noqa: F401
from conveyor_testkit.polling import wait_until
from selenium.common.exceptions import NoSuchElementException, StaleElementReferenceException
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support import expected_conditions as ec
from selenium.webdriver.support.ui import WebDriverWait

from tests.e2e.harness import ROOT, Cluster, port_open

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.postgres, pytest.mark.nats]

ADMIN = "dash-admin-secret-0123456789"
READER = "dash-reader-secret-0123456789"
WAIT = 30.0
SCREENSHOTS = ROOT / "docs" / "screenshots"


@dataclass
class Stack:
    """The processes, the REST process's base URL and the api's address."""

    cluster: Cluster
    base: str
    target: str
    shots: Path

    def client(self, token: str = ADMIN) -> httpx.Client:
        return httpx.Client(
            base_url=self.base, headers={"authorization": f"Bearer {token}"}, timeout=30
        )


@pytest.fixture
async def stack(
    fresh_pg_dsn: str, nats_server: EmbeddedNats, tmp_path: Path
) -> AsyncIterator[Stack]:
    await migrate(fresh_pg_dsn)
    cluster = Cluster(
        dsn=fresh_pg_dsn,
        nats_url=nats_server.url,
        workdir=tmp_path,
        settings_env={
            "CONVEYOR_AUTH_TOKENS": f"ops:admin:{ADMIN},viewer:read-only:{READER}",
            "CONVEYOR_ALLOW_UNAUTHENTICATED": "false",
        },
    )
    try:
        target = await cluster.start_services()
        port = free_port()
        # The charts' sampler reads with a read-only token, every second.
        rest = cluster.spawn(
            "rest",
            ["-m", "conveyor_rest", "--target", target, "--rest-port", str(port)],
            {"CONVEYOR_TOKEN": READER, "CONVEYOR_SAMPLE_INTERVAL": "1"},
        )
        await wait_until(
            lambda: port_open(port) or not rest.alive(), within=WAIT, message="rest port"
        )
        assert rest.alive(), rest.log()
        shots = tmp_path / "screenshots"
        shots.mkdir()
        yield Stack(cluster, f"http://127.0.0.1:{port}", target, shots)
        if os.environ.get("CONVEYOR_UPDATE_SCREENSHOTS") == "1":
            SCREENSHOTS.mkdir(parents=True, exist_ok=True)
            for shot in shots.glob("*.png"):
                shutil.copy(shot, SCREENSHOTS / shot.name)
    finally:
        cluster.stop_all()
        print(cluster.logs())  # pytest shows it when the test fails


def wait(driver: WebDriver, condition: Any, timeout: float = WAIT) -> Any:
    """``condition`` polled until true; an element replaced meanwhile (a reload, the
    queues page's refresh) is looked up again."""
    ignored = (StaleElementReferenceException, NoSuchElementException)
    return WebDriverWait(driver, timeout, poll_frequency=0.1, ignored_exceptions=ignored).until(
        condition
    )


def login(driver: WebDriver, base: str, token: str) -> None:
    """Open /ui, which asks for a token, and log in with ``token``."""
    driver.get(f"{base}/ui")
    field = wait(driver, ec.visibility_of_element_located((By.ID, "token")))
    field.send_keys(token)
    driver.find_element(By.CSS_SELECTOR, "#login button").click()
    wait(driver, ec.presence_of_element_located((By.ID, "queues")))
    wait(driver, lambda d: d.find_element(By.ID, "whoami").text.startswith("role:"))


def count(driver: WebDriver, queue: str, state: str) -> str:
    cells = driver.find_elements(
        By.CSS_SELECTOR, f'tr[data-queue="{queue}"] td[data-state="{state}"]'
    )
    return cells[0].text if cells else ""


def confirm_click(driver: WebDriver, element: WebElement) -> None:
    """Click an action button and accept its confirm()."""
    element.click()
    wait(driver, ec.alert_is_present(), 10).accept()


def visible_actions(driver: WebDriver) -> list[WebElement]:
    return [b for b in driver.find_elements(By.CSS_SELECTOR, "button.act") if b.is_displayed()]


def enqueue(client: httpx.Client, queue: str, n: int, type_: str = "e2e.noop") -> list[str]:
    ids = []
    for i in range(n):
        body = {"type": type_, "queue": queue, "payload": {"n": i, "note": "<b>not bold</b>"}}
        made = client.post("/v1/tasks", json=body)
        assert made.status_code == 200, made.text
        ids.append(made.json()["task"]["id"])
    return ids


async def test_admin_sees_queues_fill_and_drain_and_acts(
    stack: Stack, browser: WebDriver, tmp_path: Path
) -> None:
    driver = browser
    login(driver, stack.base, ADMIN)
    assert driver.find_element(By.ID, "whoami").text == "role: admin"

    with stack.client() as api:
        # A queue fills (the page refreshes itself) ...
        done = enqueue(api, "ui-fill", 12)
        wait(driver, lambda d: count(d, "ui-fill", "pending") == "12")
        # ... and drains once a worker serves it.
        stack.cluster.start_worker(
            stack.target,
            queues={"ui-fill": 1},
            concurrency=4,
            record=tmp_path / "worker.record",
            env={"CONVEYOR_TOKEN": ADMIN},
        )
        wait(driver, lambda d: count(d, "ui-fill", "completed") == "12")
        assert count(driver, "ui-fill", "pending") == "0"
        # The background sampler saw them complete: the queue's throughput chart has
        # points (the page redraws it at each refresh).
        throughput = 'tr[data-queue="ui-fill"] svg.chart.throughput'
        wait(driver, lambda d: d.find_elements(By.CSS_SELECTOR, throughput))
        assert driver.find_elements(By.CSS_SELECTOR, 'tr[data-queue="ui-fill"] svg.chart.latency')

        # Tasks a paused queue holds, for the actions below.
        held = enqueue(api, "ui-hold", 4, "e2e.hold")
        driver.refresh()
        wait(driver, lambda d: count(d, "ui-hold", "pending") == "4")
        driver.save_screenshot(str(stack.shots / "queues.png"))

        # Pause a queue from its row.
        row = '#queues tr[data-queue="ui-hold"]'
        confirm_click(driver, driver.find_element(By.CSS_SELECTOR, f"{row} button.act"))
        wait(
            driver,
            lambda d: "paused" in d.find_element(By.CSS_SELECTOR, f"{row} td.paused").text,
        )
        assert api.get("/v1/queues/ui-hold/stats").json()["stats"]["paused"] is True

        # A completed task's page: its payload pretty-printed and escaped.
        driver.get(f"{stack.base}/ui/task?id={done[0]}")
        wait(driver, ec.text_to_be_present_in_element((By.ID, "task-state"), "completed"))
        payload = driver.find_element(By.CSS_SELECTOR, "#payload pre").text
        assert '"note": "<b>not bold</b>"' in payload
        assert not driver.find_elements(By.CSS_SELECTOR, "#payload b")
        driver.save_screenshot(str(stack.shots / "task.png"))

        # Cancel a pending task from its page.
        driver.get(f"{stack.base}/ui/task?id={held[0]}")
        wait(driver, ec.text_to_be_present_in_element((By.ID, "task-state"), "pending"))
        cancel = wait(
            driver,
            ec.visibility_of_element_located((By.CSS_SELECTOR, 'button[data-url$="/cancel"]')),
        )
        confirm_click(driver, cancel)
        wait(driver, ec.text_to_be_present_in_element((By.ID, "task-state"), "canceled"))
        assert api.get(f"/v1/tasks/{held[0]}").json()["task"]["state"] == "TASK_STATE_CANCELED"

        # Search a queue's pending tasks, and cancel them all in one batch.
        driver.get(f"{stack.base}/ui/tasks?queue=ui-hold&state=pending")
        wait(driver, lambda d: len(d.find_elements(By.CSS_SELECTOR, "#tasks tr[data-id]")) == 3)
        driver.save_screenshot(str(stack.shots / "tasks.png"))
        confirm_click(
            driver,
            wait(driver, ec.visibility_of_element_located((By.CSS_SELECTOR, "button.batch"))),
        )
        wait(driver, ec.text_to_be_present_in_element((By.ID, "flash"), "3 affected"))
        states = {api.get(f"/v1/tasks/{i}").json()["task"]["state"] for i in held}
        assert states == {"TASK_STATE_CANCELED"}

        # A webhook registration and its (closed) breakers.
        hook = {"url": "http://127.0.0.1:9/hook", "queues": {"ui-hooks": 1}, "concurrency": 2}
        assert api.put("/v1/webhooks/ui-hook", json=hook).status_code == 200
        driver.get(f"{stack.base}/ui/webhooks")
        wait(
            driver, ec.presence_of_element_located((By.CSS_SELECTOR, 'tr[data-webhook="ui-hook"]'))
        )
        driver.save_screenshot(str(stack.shots / "webhooks.png"))

        # The live events: a row appears for a task enqueued after the page opened.
        driver.get(f"{stack.base}/ui/events")
        wait(driver, ec.text_to_be_present_in_element((By.ID, "events-status"), "watching"))
        fresh = enqueue(api, "ui-fill", 3)
        wait(
            driver,
            lambda d: all(
                d.find_elements(By.CSS_SELECTOR, f'#events a[href$="{i}"]') for i in fresh
            ),
        )
        driver.save_screenshot(str(stack.shots / "events.png"))


async def test_read_only_token_sees_no_actions(stack: Stack, browser: WebDriver) -> None:
    driver = browser
    with stack.client() as api:
        (task_id,) = enqueue(api, "ui-ro", 1, "e2e.hold")
    login(driver, stack.base, READER)
    assert driver.find_element(By.ID, "whoami").text == "role: read-only"
    wait(driver, lambda d: count(d, "ui-ro", "pending") == "1")
    assert driver.find_elements(By.CSS_SELECTOR, '#queues tr[data-queue="ui-ro"] button.act')
    assert visible_actions(driver) == []

    driver.get(f"{stack.base}/ui/task?id={task_id}")
    wait(driver, ec.text_to_be_present_in_element((By.ID, "task-state"), "pending"))
    wait(driver, lambda d: d.find_element(By.ID, "whoami").text == "role: read-only")
    assert visible_actions(driver) == []

    # The server refuses the mutation anyway, whatever the page shows.
    status = driver.execute_async_script(
        """const done = arguments[arguments.length - 1];
        fetch(arguments[0], {method: "POST", headers: {Authorization: "Bearer " + arguments[1]}})
          .then((r) => done(r.status));""",
        f"/v1/tasks/{task_id}/cancel",
        READER,
    )
    assert status == 403
