"""Open a page in headless Chromium (apt: chromium chromium-driver; pip: selenium) and report its images.

Where selenium or the browser is missing (`make setup` installs both), the test that asked is skipped, saying so.
"""

import shutil
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


def image_states(page: Path) -> list[dict]:
    """[{"src", "complete", "width", "height"}] for every <img> after the page has loaded."""
    pytest.importorskip("selenium", reason="selenium (the 'test' extra) is not installed: the page cannot be opened")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    for path in (CHROMIUM, CHROMEDRIVER):
        if not Path(path).is_file():
            pytest.skip(f"{path} is missing (apt-get install chromium chromium-driver; make setup does): the page cannot be opened")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(argument)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        driver.get(Path(page).resolve().as_uri())
        WebDriverWait(driver, 30).until(lambda d: d.execute_script(
            "return document.readyState === 'complete' && Array.from(document.images).every(i => i.complete)"))
        return driver.execute_script(
            "return Array.from(document.images).map(i => ({src: i.src.slice(0, 40), complete: i.complete, "
            "width: i.naturalWidth, height: i.naturalHeight}))")
    finally:
        driver.quit()
