"""`kvwise report`: the repository's results/ on one page, opened in a real headless Chromium (from
Debian's packages, driven by selenium): no console error, every image loaded, a screenshot taken."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from kvwise.bench.report import markdown_to_html, render_report
from kvwise.cli import main

pytestmark = pytest.mark.timeout(300)

RESULTS = Path(__file__).resolve().parents[1] / "results"


def test_markdown_tables_become_html():
    page = markdown_to_html("Intro with `code`.\n\n| a | b |\n|---|---|\n| 1 | **2** |\n\n- one\n- two\n")
    assert "<table><thead><tr><th>a</th><th>b</th></tr></thead><tbody><tr><td>1</td><td><strong>2</strong>" in page
    assert "<code>code</code>" in page and "<ul><li>one</li><li>two</li></ul>" in page


def test_errors_name_the_folder(tmp_path):
    with pytest.raises(ValueError, match="no benchmark reports"):
        render_report(tmp_path)
    assert main(["report", str(tmp_path / "missing")]) == 2


def test_the_results_page_renders_in_chromium(tmp_path):
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    browser, driver_binary = shutil.which("chromium"), shutil.which("chromedriver")
    assert browser and driver_binary, "install chromium and chromium-driver (.ci/run does)"
    page = render_report(RESULTS, tmp_path / "report.html")
    text = page.read_text()
    assert "https://" not in text.split("<body>")[0] and "<script src" not in text  # nothing fetched
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(driver_binary))
    try:
        driver.get(page.as_uri())
        images = driver.execute_script("return Array.from(document.images).map(i => i.complete && i.naturalWidth > 0)")
        assert len(images) >= 10 and all(images)
        sections = driver.execute_script("return document.querySelectorAll('section').length")
        assert sections >= 10 and driver.execute_script("return document.querySelectorAll('table').length") >= 10
        errors = [entry for entry in driver.get_log("browser") if entry["level"] == "SEVERE"]
        assert not errors, errors
        assert driver.save_screenshot(str(tmp_path / "report.png")) and (tmp_path / "report.png").stat().st_size > 0
    finally:
        driver.quit()
