"""A real browser for UI tests: headless Chromium (Debian's ``chromium`` and
``chromium-driver``, installed by ``scripts/install-chromium`` when missing) driven by
Selenium. Import ``chromium_ready_fixture`` and ``browser_fixture`` into a test module for
the ``chromium_ready`` and ``browser`` fixtures."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.remote.webdriver import WebDriver

ROOT = Path(__file__).resolve().parents[4]
#: How the browser runs: headless, in a container without a sandbox or a GPU.
FLAGS = (
    "--headless=new",
    "--no-sandbox",
    "--disable-dev-shm-usage",
    "--disable-gpu",
    "--window-size=1400,900",
)


@pytest.fixture(name="chromium_ready", scope="module")
def chromium_ready_fixture() -> None:
    """Chromium and chromedriver on this machine (installed when missing and root)."""
    done = subprocess.run([str(ROOT / "scripts" / "install-chromium")], check=False)
    if done.returncode != 0:
        pytest.skip("chromium/chromedriver not installed (see scripts/install-chromium)")


@pytest.fixture(name="browser")
def browser_fixture(chromium_ready: None) -> Iterator[WebDriver]:
    """A headless Chromium, quit after the test."""
    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium") or "/usr/bin/chromium"
    for flag in FLAGS:
        options.add_argument(flag)
    service = Service(executable_path=shutil.which("chromedriver") or "/usr/bin/chromedriver")
    driver = webdriver.Chrome(options=options, service=service)
    try:
        yield driver
    finally:
        driver.quit()
