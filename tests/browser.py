"""Open a page in headless Chromium (apt: chromium chromium-driver; pip: selenium) and report its images.

No skip: a missing browser is a failing test (`make setup` installs it).
"""

import shutil
from pathlib import Path

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"


def image_states(page: Path) -> list[dict]:
    """[{"src", "complete", "width", "height"}] for every <img> after the page has loaded."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.support.ui import WebDriverWait

    for path in (CHROMIUM, CHROMEDRIVER):
        assert Path(path).is_file(), f"{path} is missing: apt-get install chromium chromium-driver (make setup does)"
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
