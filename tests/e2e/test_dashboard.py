"""The live dashboard in a real headless Chromium against a real server: one bar
per request, a retracted request drawn as retracted, the cached share of a
prompt drawn beside its row, the API key asked once."""

from __future__ import annotations

import concurrent.futures
import os
import shutil
import time

import pytest
import requests

from tests.e2e.server_process import ServerProcess

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
KEY = "dashboard-test-key"
# where the screenshot goes (bench/results/dashboard.png is one, kept by hand); by default the test's tmp folder,
# so that a test run leaves the checkout as it was
SCREENSHOT_ENV = "DASHBOARD_SCREENSHOT"

try:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
except ImportError:  # pragma: no cover
    webdriver = None

pytestmark = pytest.mark.skipif(
    webdriver is None or not CHROMIUM or not CHROMEDRIVER,
    reason="needs Debian's chromium and chromium-driver and the selenium package "
           "(scripts/install.sh installs them)")


def chromium():
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--window-size=1200,900",
                 "--disable-dev-shm-usage"):
        opts.add_argument(flag)
    return webdriver.Chrome(service=Service(CHROMEDRIVER), options=opts)


def test_dashboard_draws_one_bar_per_request_and_the_retracted_one_as_retracted(tmp_path):
    # a pool of 90 tokens and a low conservativeness: three ~19 + 24 token
    # requests are admitted at once and then overflow it, so one is retracted
    # (a slot per token: the scenario and the cached count are token-exact)
    srv = ServerProcess("--max-running-requests", "8", "--max-total-tokens", "90", "--page-size", "1",
                        "--schedule-conservativeness", "0.3", "--api-key", KEY)
    headers = {"Authorization": f"Bearer {KEY}"}
    try:
        def ask(i):
            body = {"text": f"<|im_start|>user\nList {20 + i} animals, one per line.<|im_end|>\n"
                            "<|im_start|>assistant\n",
                    "sampling_params": {"max_new_tokens": 24, "temperature": 0}}
            return requests.post(srv.url + "/generate", json=body, headers=headers,
                                 timeout=300).json()

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            outs = list(pool.map(ask, range(4)))
        retracted = {o["meta_info"]["id"] for o in outs if o["meta_info"]["num_retractions"]}
        assert retracted, "the scenario must retract a request"
        # then one prompt twice, alone: the second takes it from the prefix cache
        # (a prompt of the four above may have been evicted from the 90-slot pool)
        ask(9)
        again = ask(9)["meta_info"]
        assert again["cached_tokens"] == again["prompt_tokens"] - 1
        assert requests.get(srv.url + "/timeline", timeout=10).status_code == 401

        driver = chromium()
        try:
            driver.get(srv.url + "/dashboard")
            # the page asks for the key once and keeps it in its session
            WebDriverWait(driver, 20).until(lambda d: _alert(d))
            alert = driver.switch_to.alert
            alert.send_keys(KEY)
            alert.accept()
            gantt = driver.find_element(By.ID, "gantt")
            WebDriverWait(driver, 30).until(lambda d: gantt.get_attribute("data-bars") == "6")
            cached = gantt.get_attribute("data-cached").split(",")
            # the repeated prompt's row shows its cached share
            assert f"{again['id']}:{again['cached_tokens']}/{again['prompt_tokens']}" in cached, cached
            drawn_retracted = set(filter(None, gantt.get_attribute("data-retracted").split(",")))
            assert {r[:8] for r in drawn_retracted} >= {r[:8] for r in retracted}
            assert drawn_retracted == retracted
            time.sleep(1.5)  # a few more polls: no second prompt for the key
            assert not _alert(driver)
            # smooth with 500 requests on screen: one full redraw well under a frame budget
            draw_ms = driver.execute_script("""
                const t = lastNow;
                for (let i = 0; i < 500; i++) {
                  const rid = 'synthetic' + i, a = t - 60 + i * 0.1;
                  apply({type: 'req', rid, event: 'arrived', t: a});
                  apply({type: 'req', rid, event: 'admitted', t: a + 1});
                  apply({type: 'req', rid, event: 'first_token', t: a + 1.5});
                  if (i % 7 == 0) apply({type: 'req', rid, event: 'retracted', t: a + 3});
                  if (i % 3 == 0) apply({type: 'req', rid, event: 'finished', t: a + 9});
                  apply({type: 'step', kind: 'decode', batch_size: 64, tokens: 64,
                         kv_usage: 0.5, step_time: 0.3, t: a + 1.6});
                }
                const t0 = performance.now();
                for (let k = 0; k < 5; k++) { dirty = true; const [a, b] = timeRange(); drawGantt(a, b); }
                return (performance.now() - t0) / 5;""")
            assert int(gantt.get_attribute("data-bars")) >= 500
            assert draw_ms < 50, f"a redraw of 500 rows took {draw_ms:.1f} ms"
            # speculative decoding's verify steps: their accepted drafts get a panel of their own
            driver.execute_script("""
                for (let i = 0; i < 40; i++)
                  apply({type: 'step', kind: 'verify', batch_size: 4, tokens: 20, accepted: i % 5,
                         kv_usage: 0.5, step_time: 0.05, t: lastNow - 20 + i * 0.1});
                dirty = true;""")
            accepted = driver.find_element(By.ID, "accepted")
            WebDriverWait(driver, 10).until(lambda d: accepted.get_attribute("data-steps") == "40")
            assert accepted.get_attribute("data-accepted") == str(8 * (0 + 1 + 2 + 3 + 4))
            assert driver.save_screenshot(os.environ.get(SCREENSHOT_ENV) or str(tmp_path / "dashboard.png"))
        finally:
            driver.quit()
    finally:
        srv.kill()


def _alert(driver) -> bool:
    try:
        driver.switch_to.alert
        return True
    except Exception:
        return False
