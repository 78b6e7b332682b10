"""The README's MLflow picture: the demo's runs compared by parallel coordinates (BLEU against a Table 3 knob).

Made in headless Chromium from the demo's store, by the clicks the README describes. Needs what the
pinned environment does not have: Chromium (`apt-get install chromium`) and `pip install playwright`
(in a scratch venv); it drives the system Chromium, so playwright downloads no browser.

    .venv/bin/mlflow ui --backend-store-uri sqlite:///results/mlflow.db --port 5055 &
    /tmp/pwvenv/bin/python docs/mlflow_screenshot.py --url http://127.0.0.1:5055 --experiment demo
"""

from __future__ import annotations

import argparse
import json
import urllib.parse
import urllib.request


def run_ids(url: str, experiment: str) -> tuple[str, list[str]]:
    """The experiment's id and its finished runs' ids, through MLflow's REST API."""
    with urllib.request.urlopen(f"{url}/api/2.0/mlflow/experiments/get-by-name?experiment_name={experiment}") as reply:
        experiment_id = json.load(reply)["experiment"]["experiment_id"]
    request = urllib.request.Request(f"{url}/api/2.0/mlflow/runs/search", method="POST",
                                     data=json.dumps({"experiment_ids": [experiment_id], "max_results": 50,
                                                      "filter": "attributes.status = 'FINISHED'"}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as reply:
        return experiment_id, [run["info"]["run_id"] for run in json.load(reply).get("runs", [])]


def main(argv=None) -> int:
    from playwright.sync_api import sync_playwright

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:5055", help="a running `mlflow ui`")
    parser.add_argument("--experiment", default="demo")
    parser.add_argument("--params", nargs="+", default=["preset.positional", "preset.n_heads"])
    parser.add_argument("--metric", default="dev_bleu_tok")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--output", default="docs/img/mlflow_compare.png")
    args = parser.parse_args(argv)
    experiment_id, ids = run_ids(args.url, args.experiment)
    quote = lambda value: urllib.parse.quote(json.dumps(value, separators=(",", ":")))  # noqa: E731
    page_url = f"{args.url}/#/compare-runs?runs={quote(ids)}&experiments={quote([experiment_id])}"
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1500, "height": 760})
        page.goto(page_url)
        page.wait_for_selector("text=Parallel Coordinates Plot", timeout=60000)
        page.wait_for_timeout(3000)
        for close in page.locator("button[aria-label='Close']").all():  # the assistant's side panel
            close.click(timeout=1000)
        page.get_by_role("button", name="Clear All").click()
        for index, names in enumerate((args.params, [args.metric])):  # the Parameters box, then Metrics
            box = page.locator("input[role=combobox]").nth(index)
            for name in names:
                box.click()
                box.fill(name)
                page.wait_for_timeout(400)
                page.keyboard.press("Enter")
            page.keyboard.press("Escape")
        page.wait_for_timeout(2000)
        page.screenshot(path=args.output)
        browser.close()
    print(f"{args.output}: {len(ids)} runs of experiment {args.experiment}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
