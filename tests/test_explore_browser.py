"""The attention explorer's page in a real browser: headless Chromium (Debian's chromium and chromium-driver)
driven by selenium. Switching layer and head draws the model's weights, pointing at a token outlines its row,
and the page makes no network request.

Outside CI these tests skip where the browser is missing; in CI (AIAYN_CI=1, set by .ci/run, which installs
it) they fail instead.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from test_appendix_figures import processor, tiny_model, vocabulary  # noqa: F401 (fixtures)
from test_explore import SENTENCES, page_weights, settings

from aiayn.explore import KINDS, explorer_data, render_page

CHROMIUM = ("chromium", "chromium-browser", "google-chrome")
CHROMEDRIVER = "chromedriver"


def browser_paths() -> tuple[str | None, str | None]:
    browser = next((path for path in map(shutil.which, CHROMIUM) if path), None)
    return browser, shutil.which(CHROMEDRIVER)


@pytest.fixture(scope="module")
def browser():
    browser_path, driver_path = browser_paths()
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        browser_path = None
    if browser_path is None or driver_path is None:
        missing = "selenium, chromium and chromium-driver (apt-get install chromium chromium-driver)"
        if os.environ.get("AIAYN_CI"):
            pytest.fail(f"CI must run the browser tests: install {missing}")
        pytest.skip(f"no headless browser here: needs {missing}")
    options = webdriver.ChromeOptions()
    options.binary_location = browser_path
    for argument in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1000"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"performance": "ALL"})  # every network event, to check there are none
    driver = webdriver.Chrome(options=options, service=Service(driver_path))
    try:
        yield driver
    finally:
        driver.quit()


@pytest.fixture(scope="module")
def page(tmp_path_factory, processor):  # noqa: F811 (the fixture imported above)
    model = tiny_model(vocab_size=80).eval()
    data = explorer_data(model, processor, SENTENCES, settings())
    path = tmp_path_factory.mktemp("explorer") / "page.html"
    path.write_text(render_page(data), encoding="utf-8")
    return path, data, model.config


@pytest.fixture
def loaded(browser, page):
    path, data, config = page
    browser.get_log("performance")  # empty the log: each test sees its own page load only
    browser.get(path.as_uri())
    return browser, data, config


def choose(driver, select_id: str, value) -> None:
    from selenium.webdriver.support.ui import Select

    Select(driver.find_element("id", select_id)).select_by_value(str(value))


def drawn(driver) -> list[dict]:
    return driver.execute_script("return window.explorer.drawn;")


def test_switching_layer_and_head_draws_the_models_weights_for_every_module(loaded):
    driver, data, config = loaded
    for number, sentence in enumerate(data["sentences"]):
        choose(driver, "sentence", number)
        for kind in KINDS:
            choose(driver, "kind", kind)
            expected = page_weights(sentence, kind)
            previous = None
            for layer in range(config.n_layers):
                choose(driver, "layer", layer)
                for head in range(config.n_heads):
                    choose(driver, "head", head)
                    [shown] = drawn(driver)
                    assert (shown["sentence"], shown["kind"], shown["layer"], shown["head"]) == (number, kind, layer, head)
                    weights = torch.tensor(shown["rows"], dtype=torch.float64)
                    assert torch.allclose(weights, expected[layer, head].double(), atol=1e-6, rtol=0), (kind, layer, head)
                    assert previous is None or not torch.equal(weights, previous)  # the drawing changed
                    previous = weights
            choose(driver, "head", "all")
            panels = drawn(driver)
            assert [panel["head"] for panel in panels] == list(range(config.n_heads))
            for panel in panels:
                assert torch.allclose(torch.tensor(panel["rows"], dtype=torch.float64),
                                      expected[config.n_layers - 1, panel["head"]].double(), atol=1e-6, rtol=0)
            assert len(driver.find_elements("css selector", "#panels canvas")) == config.n_heads
            choose(driver, "head", 0)


def test_pointing_at_a_token_outlines_its_row(loaded):
    from selenium.webdriver.common.action_chains import ActionChains

    driver, data, _ = loaded
    choose(driver, "kind", "cross")
    labels = driver.find_elements("css selector", ".row-label")
    assert len(labels) == len(data["sentences"][0]["target_out_pieces"])
    ActionChains(driver).move_to_element(labels[1]).perform()
    assert driver.execute_script("return window.explorer.state.row;") == 1
    marked = [label.get_attribute("data-index") for label in driver.find_elements("css selector", ".row-label.highlighted")]
    assert marked == ["1"]
    bars = driver.find_elements("css selector", "#readout .bar-row")
    assert len(bars) == len(data["sentences"][0]["source_pieces"])  # the row's weights, one per source piece

    # pointing at a cell of the heatmap outlines that cell's row, here row 0
    canvas = driver.find_element("css selector", ".heatmap-canvas")
    cell = canvas.size["width"] / len(data["sentences"][0]["source_pieces"])
    ActionChains(driver).move_to_element_with_offset(canvas, -canvas.size["width"] / 2 + cell / 2,
                                                     -canvas.size["height"] / 2 + cell / 2).perform()
    assert driver.execute_script("return window.explorer.state.row;") == 0
    assert [label.get_attribute("data-index")
            for label in driver.find_elements("css selector", ".row-label.highlighted")] == ["0"]

    # a piece of the translation, above the heatmap, marks the same row
    ActionChains(driver).move_to_element(driver.find_elements("css selector", "#target-pieces .piece")[2]).perform()
    assert driver.execute_script("return window.explorer.state.row;") == 2


def test_the_page_makes_no_network_request(loaded):
    import json

    driver, _, _ = loaded
    choose(driver, "head", "all")  # draw something more
    page_url = driver.current_url
    requests = [json.loads(entry["message"])["message"] for entry in driver.get_log("performance")]
    fetched = [message["params"]["request"]["url"] for message in requests
               if message["method"] == "Network.requestWillBeSent"]
    assert fetched == [page_url]  # the page itself, nothing else
    assert driver.execute_script("return performance.getEntriesByType('resource').length;") == 0
    assert driver.get_log("browser") == []  # no error, no refused request
