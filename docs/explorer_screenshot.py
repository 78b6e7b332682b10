"""docs/explorer.md's picture of the attention explorer: a page written by ``aiayn explore``, in headless Chromium.

Drives Debian's chromium through its chromedriver with selenium (the test extra's pin), as the browser
tests do: picks a sentence, an attention kind, a layer and a head, points at one row, and saves the window.

    aiayn explore --model results/demo/average/demo_base/seed1/model.pt --spm-model results/demo/bpe/spm.model \\
        --dev results/demo/data/dev.en --out /tmp/explorer.html
    .venv/bin/python docs/explorer_screenshot.py --page /tmp/explorer.html --sentence 4 --kind cross --row 3
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path


def screenshot(page: Path, out: Path, sentence: int, kind: str, layer: int, head: str, row: int,
               size: tuple[int, int]) -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.support.ui import Select

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", f"--window-size={size[0]},{size[1]}",
                     "--hide-scrollbars"):
        options.add_argument(argument)
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    try:
        driver.get(page.resolve().as_uri())
        for select, value in (("sentence", sentence), ("kind", kind), ("layer", layer), ("head", head)):
            Select(driver.find_element("id", select)).select_by_value(str(value))
        labels = driver.find_elements("css selector", ".row-label")
        if labels:
            ActionChains(driver).move_to_element(labels[min(row, len(labels) - 1)]).perform()
        driver.save_screenshot(str(out))
    finally:
        driver.quit()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page", type=Path, required=True, help="a page written by aiayn explore")
    parser.add_argument("--out", type=Path, default=Path("docs/img/attention_explorer.png"))
    parser.add_argument("--sentence", type=int, default=0, help="from 0, in the page's order")
    parser.add_argument("--kind", default="cross", choices=("encoder", "decoder_self", "cross"))
    parser.add_argument("--layer", type=int, default=0, help="from 0")
    parser.add_argument("--head", default="0", help="from 0, or all")
    parser.add_argument("--row", type=int, default=0, help="the row to point at, from 0")
    parser.add_argument("--size", type=int, nargs=2, default=(1400, 900), metavar=("WIDTH", "HEIGHT"))
    args = parser.parse_args()
    screenshot(args.page, args.out, args.sentence, args.kind, args.layer, args.head, args.row, tuple(args.size))


if __name__ == "__main__":
    main()
