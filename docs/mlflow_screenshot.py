"""docs/mlflow.md's MLflow pictures, made in headless Chromium from the demo's store.

Two pages: ``--page runs``, the experiment's runs table in its saved view (``aiayn.tracking``'s
"BLEU and Table 3 knobs": the Source column with the commit, dev/test BLEU, dev perplexity and the
presets' knobs), opened by its address; and ``--page compare``, the
runs compared by parallel coordinates (BLEU against a Table 3 knob), by the clicks docs/mlflow.md describes.
Needs what the pinned environment does not have: Chromium (`apt-get install chromium`) and
`pip install playwright` (in a scratch venv); it drives the system Chromium, so playwright downloads no
browser.

    .venv/bin/mlflow ui --backend-store-uri sqlite:///results/mlflow.db --port 5055 &
    /tmp/pwvenv/bin/python docs/mlflow_screenshot.py --url http://127.0.0.1:5055 --experiment demo --page runs
    /tmp/pwvenv/bin/python docs/mlflow_screenshot.py --url http://127.0.0.1:5055 --experiment demo --page compare
"""

from __future__ import annotations

import argparse
import json
import urllib.parse
import urllib.request

RUNS_VIEW_ID = "aiayn-bleu"  # aiayn.tracking.RUNS_VIEW_ID (this script runs where aiayn is not installed)
DEFAULT_OUTPUT = {"runs": "docs/img/mlflow_runs.png", "compare": "docs/img/mlflow_compare.png"}
WINDOW = {"runs": (2500, 490), "compare": (1500, 760)}  # pixels: the runs view's sixteen columns side by side


def experiment_of(url: str, name: str) -> dict:
    """The experiment as MLflow's REST API gives it (id, tags)."""
    with urllib.request.urlopen(f"{url}/api/2.0/mlflow/experiments/get-by-name?experiment_name={name}") as reply:
        return json.load(reply)["experiment"]


def run_ids(url: str, experiment: str) -> tuple[str, list[str]]:
    """The experiment's id and its finished runs' ids, through MLflow's REST API."""
    experiment_id = experiment_of(url, experiment)["experiment_id"]
    request = urllib.request.Request(f"{url}/api/2.0/mlflow/runs/search", method="POST",
                                     data=json.dumps({"experiment_ids": [experiment_id], "max_results": 50,
                                                      "filter": "attributes.status = 'FINISHED'"}).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request) as reply:
        return experiment_id, [run["info"]["run_id"] for run in json.load(reply).get("runs", [])]


def close_side_panels(page) -> None:
    for close in page.locator("button[aria-label='Close']").all():  # the assistant's side panel
        close.click(timeout=1000)


def runs_table(page, url: str, experiment_id: str) -> None:
    """The runs table in the saved view, opened by its address (the Views menu gives the same table, but
    leaves the sidebar's GenAI | Model training switch on GenAI)."""
    query = f"workflowType=machine_learning&viewStateShareKey={RUNS_VIEW_ID}"
    page.goto(f"{url}/#/experiments/{experiment_id}/runs?{query}")
    page.wait_for_selector("text=dev_bleu_tok", timeout=60000)
    page.wait_for_timeout(3000)
    close_side_panels(page)
    page.wait_for_timeout(1000)


def compare_runs(page, url: str, experiment_id: str, ids: list[str], params: list[str], metric: str) -> None:
    """Parallel coordinates of the given knobs against a metric, by the clicks docs/mlflow.md describes."""
    quote = lambda value: urllib.parse.quote(json.dumps(value, separators=(",", ":")))  # noqa: E731
    page.goto(f"{url}/#/compare-runs?runs={quote(ids)}&experiments={quote([experiment_id])}")
    page.wait_for_selector("text=Parallel Coordinates Plot", timeout=60000)
    page.wait_for_timeout(3000)
    close_side_panels(page)
    page.get_by_role("button", name="Clear All").click()
    for index, names in enumerate((params, [metric])):  # the Parameters box, then Metrics
        box = page.locator("input[role=combobox]").nth(index)
        for name in names:
            box.click()
            box.fill(name)
            page.wait_for_timeout(400)
            page.keyboard.press("Enter")
        page.keyboard.press("Escape")
    page.wait_for_timeout(2000)


def main(argv=None) -> int:
    from playwright.sync_api import sync_playwright

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:5055", help="a running `mlflow ui`")
    parser.add_argument("--experiment", default="demo")
    parser.add_argument("--page", choices=sorted(DEFAULT_OUTPUT), default="compare")
    parser.add_argument("--params", nargs="+", default=["preset.positional", "preset.n_heads"], help="--page compare")
    parser.add_argument("--metric", default="dev_bleu_tok", help="--page compare")
    parser.add_argument("--chromium", default="/usr/bin/chromium")
    parser.add_argument("--width", type=int, help=f"the browser window's width in pixels (default: {WINDOW})")
    parser.add_argument("--output", help=f"default: {DEFAULT_OUTPUT}")
    args = parser.parse_args(argv)
    output = args.output or DEFAULT_OUTPUT[args.page]
    experiment_id, ids = run_ids(args.url, args.experiment)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=args.chromium, args=["--no-sandbox"])
        width, height = WINDOW[args.page]
        page = browser.new_page(viewport={"width": args.width or width, "height": height})
        if args.page == "runs":
            runs_table(page, args.url, experiment_id)
        else:
            compare_runs(page, args.url, experiment_id, ids, args.params, args.metric)
        page.screenshot(path=output)
        browser.close()
    print(f"{output}: {len(ids)} finished runs of experiment {args.experiment}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
