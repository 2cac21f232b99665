"""The service's page in a real headless browser (issue 34): Debian's chromium driven by selenium through Debian's
chromium-driver (nothing downloaded). A user's 1920x1080 JPEG is uploaded and the plan is drawn over it; a model
of three cameras gets one named upload per camera, in its order."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from fastddrive.core.sample import split_cameras
from fastddrive.data.highway import episode_samples
from fastddrive.engine.model_files import model_path
from fastddrive.planner import load
from fastddrive.serve.app import create_app
from model_fixtures import synthetic_sample
from serve_fakes import running

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
CAMERAS = ["FRONT_LEFT", "FRONT", "FRONT_RIGHT"]
pytestmark = pytest.mark.skipif(
    not (CHROMIUM.is_file() and CHROMEDRIVER.is_file()),
    reason="Debian's chromium and chromium-driver are not installed (.ci/run installs them)",
)


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(str(CHROMEDRIVER)), options=options)
    yield driver
    driver.quit()


def _jpeg(frame: np.ndarray, path: Path, width: int = 1920, height: int = 1080) -> Path:
    Image.fromarray(frame).resize((width, height)).save(path, format="JPEG", quality=92)
    return path


def _plan_on_the_page(driver, base: str, files: list[Path], history: np.ndarray) -> dict:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(base + "/")
    wait = WebDriverWait(driver, 300)  # a bound on a hang only: the wait ends as soon as the answer is shown
    wait.until(lambda d: len(d.find_elements(By.CSS_SELECTOR, "input[name=frame]")) == len(files))
    for field, file in zip(driver.find_elements(By.CSS_SELECTOR, "input[name=frame]"), files, strict=True):
        field.send_keys(str(file))
    driver.execute_script("document.getElementById('history').value = arguments[0];", json.dumps(history.tolist()))
    driver.find_element(By.CSS_SELECTOR, "button[type=submit]").click()
    wait.until(
        lambda d: (
            "forwards" in d.find_element(By.ID, "status").text or "refused" in d.find_element(By.ID, "status").text
        )
    )
    return json.loads(driver.find_element(By.ID, "answer").text)


def _canvas_pixel(driver, u: float, v: float) -> list[int]:
    return driver.execute_script(
        "const c = document.getElementById('view').getContext('2d');"
        "return Array.from(c.getImageData(arguments[0], arguments[1], 1, 1).data);",
        round(u),
        round(v),
    )


def test_a_1920x1080_jpeg_uploaded_in_the_browser_gets_its_plan_drawn_over_it(browser, embedded, tmp_path):
    # A scene of the kind the embedded model was trained on, upscaled: on a frame of noise it may answer with a
    # value the schema refuses, and then there is no plan to draw.
    scene = episode_samples("highway", 90_000, max_duration_s=9)[0]
    frame = _jpeg(scene.image, tmp_path / "front.jpg")
    with running(create_app(lambda: embedded, "ss", max_queue=2, timeout_s=300)) as base:
        answer = _plan_on_the_page(browser, base, [frame], scene.history)
    assert answer["image_sizes_px"] and answer["response"] is not None, answer
    width, height = browser.execute_script("const c = document.getElementById('view'); return [c.width, c.height];")
    assert (width, height) == (1920, 1080)  # the user's frame, at its own size, under the plan
    shown = 0
    for x, y in answer["response"]["trajectory"]:  # the page's top view: ego at (0.3 w, 0.5 h), 5.5 px/m, +y up
        u, v = 0.3 * width + 5.5 * x, 0.5 * height - 5.5 * y
        if 2 <= u < width - 2 and 2 <= v < height - 2:
            assert _canvas_pixel(browser, u, v) == [255, 0, 0, 255], (x, y)  # a red waypoint marker
            shown += 1
    assert shown >= 3


@pytest.fixture(scope="module")
def three_cameras(tmp_path_factory):
    """The embedded model's folder declaring three separate cameras (the release's)."""
    folder = tmp_path_factory.mktemp("three-cameras") / "model"
    shutil.copytree(model_path("default"), folder)
    info = json.loads((folder / "fastddrive.json").read_text())
    (folder / "fastddrive.json").write_text(json.dumps(info | {"cameras": CAMERAS}))
    return load(folder)


def test_a_model_of_three_cameras_gets_one_named_upload_per_camera(browser, three_cameras, tmp_path):
    from selenium.webdriver.common.by import By

    sample = synthetic_sample(0)
    parts = split_cameras(sample.image, 3)
    files = [_jpeg(part, tmp_path / f"{name}.jpg") for part, name in zip(parts, CAMERAS, strict=True)]
    with running(create_app(lambda: three_cameras, "ss", max_queue=2, timeout_s=300)) as base:
        answer = _plan_on_the_page(browser, base, files, sample.history)
        named = [e.get_attribute("data-camera") for e in browser.find_elements(By.CSS_SELECTOR, "input[name=frame]")]
    assert named == CAMERAS
    assert answer["image_sizes_px"] == [[196, 112]] * 3, answer  # three images, each resized by the folder
