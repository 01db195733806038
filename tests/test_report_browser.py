"""A headless browser (Debian's chromium) opens the default run's index.html and its screenshot shows the
plots: many coloured pixels where the same page without its PNGs beside it shows next to none."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Optional

import pytest

from report_helpers import png_stats

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
WINDOW = (1200, 1600)
NO_BROWSER = "no chromium on PATH (apt-get install chromium; .ci/run does so as root when apt-get is there)"


def find_browser() -> Optional[str]:
    return next((path for name in BROWSERS if (path := shutil.which(name))), None)


# skipif, not a skip in the test: the default run (a Ray run) is not started for a test that would skip
pytestmark = [pytest.mark.slow, pytest.mark.skipif(find_browser() is None, reason=NO_BROWSER)]


def screenshot(browser: str, page: Path, out: Path, profile: Path) -> dict[str, int | float]:
    """``page`` rendered by headless ``browser`` at ``WINDOW`` into ``out``; the screenshot's pixel stats."""
    command = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--no-first-run",
               "--hide-scrollbars", f"--user-data-dir={profile}", f"--window-size={WINDOW[0]},{WINDOW[1]}",
               f"--screenshot={out}", page.resolve().as_uri()]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and out.is_file(), (proc.returncode, proc.stderr[-2000:])
    return png_stats(out)


def assert_page_shows_plots(run_dir: Path, work: Path) -> None:
    """Screenshot the run's index.html and the same page copied alone (its images then missing); the plots
    are what colours the first."""
    browser = find_browser()
    assert browser is not None, NO_BROWSER
    bare = work / "bare"
    bare.mkdir()
    shutil.copy(run_dir / "index.html", bare / "index.html")
    shown = screenshot(browser, run_dir / "index.html", work / "page.png", work / "profile")
    blank = screenshot(browser, bare / "index.html", work / "bare.png", work / "profile")
    assert (shown["width"], shown["height"]) == WINDOW, shown
    assert shown["colourful"] > 3000, shown  # the lines and markers of the first plots
    assert shown["colourful"] > 10 * (blank["colourful"] + 100), (shown, blank)
    assert shown["colours"] > 2 * blank["colours"], (shown, blank)


def test_a_browser_shows_the_runs_plots(default_run: Path, tmp_path: Path) -> None:
    assert_page_shows_plots(default_run, tmp_path)
