"""Headless Chromium (Debian's `chromium`) as the report tests' browser: no network, no downloads.

`probe(page, tmp)` loads a copy of the page with a probe script that, on load, writes onto
<body> how many images there are, how many decoded, and the visible text of the findings;
`--dump-dom` prints the result. The report itself carries no script.
"""

from __future__ import annotations

import shutil
import subprocess
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
from matplotlib.image import imread

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
MISSING = "needs headless Chromium: apt-get install -y chromium"
WINDOW = (1280, 2600)
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    f"--window-size={WINDOW[0]},{WINDOW[1]}",
)
TIMEOUT_S = 60
PROBE = """<script>
window.addEventListener('load', () => {
  const images = [...document.images];
  document.body.dataset.images = images.length;
  document.body.dataset.decoded = images.filter(i => i.complete && i.naturalWidth > 0).length;
  document.body.dataset.findings = document.getElementById('findings').innerText;
});
</script>"""


class _BodyAttrs(HTMLParser):
    """The `data-*` attributes of <body>, without the prefix."""

    def __init__(self) -> None:
        super().__init__()
        self.attrs: dict[str, str] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag == "body":
            self.attrs = {k.removeprefix("data-"): v or "" for k, v in attrs}


def run_chromium(page: Path, tmp: Path, *args: str) -> str:
    """Chromium's stdout for `page` with extra `args`; raises if it fails."""
    assert CHROMIUM is not None, MISSING
    cmd = [CHROMIUM, *FLAGS, f"--user-data-dir={tmp / 'chromium-profile'}", *args, page.as_uri()]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, check=True).stdout


def screenshot(page: Path, tmp: Path) -> Path:
    """A WINDOW-sized PNG of the top of the page."""
    shot = tmp / f"{page.stem}.png"
    run_chromium(page, tmp, f"--screenshot={shot}")
    return shot


def probe(page: Path, tmp: Path) -> dict[str, str]:
    """`images`, `decoded` and `findings` as the probe found them after loading a copy of `page`."""
    copy = tmp / f"probe-{page.name}"
    copy.write_text(page.read_text().replace("</body>", PROBE + "</body>"))
    parser = _BodyAttrs()
    parser.feed(run_chromium(copy, tmp, "--dump-dom"))
    return parser.attrs


def assert_renders(page: Path, messages: list[str], n_images: int, tmp: Path) -> None:
    """The page screenshots to a non-blank image, shows each message, and decodes each image."""
    pixels = imread(screenshot(page, tmp))  # (height, width, channels)
    assert pixels.shape[:2] == (WINDOW[1], WINDOW[0]) and np.ptp(pixels[..., :3]) > 0.5
    body = probe(page, tmp)
    assert body["images"] == str(n_images) and body["decoded"] == str(n_images)
    for message in messages:
        assert message in body["findings"]
