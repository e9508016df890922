"""Takes docs/images/live-view*.png: a notebook training on 8 simulated cores, opened in
JupyterLab in headless Chromium, photographed while the launch runs and after it ends.

Needs, besides tpunb's environment: jupyterlab and playwright in any Python, Chromium,
and a kernel named "tpunb" for tpunb's environment:
    python -m ipykernel install --prefix PREFIX --name tpunb   (in tpunb's environment)
    JUPYTER_PATH=PREFIX/share/jupyter python docs/images/screenshot_live_view.py NOTEBOOK
"""

import pathlib
import subprocess
import sys
import time

from playwright.sync_api import sync_playwright

HERE = pathlib.Path(__file__).resolve().parent
TOKEN = "live-view"


def main(notebook):
    notebook = pathlib.Path(notebook).resolve()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "jupyterlab",
            "--no-browser",
            "--port=8893",
            "--allow-root",
            f"--IdentityProvider.token={TOKEN}",
            f"--ServerApp.root_dir={notebook.parent}",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        time.sleep(15)
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(
                executable_path="/usr/bin/chromium", args=["--no-sandbox"]
            )
            page = browser.new_page(viewport={"width": 1100, "height": 1500})
            page.goto(f"http://127.0.0.1:8893/lab/tree/{notebook.name}?token={TOKEN}")
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=60_000)
            time.sleep(8)  # the kernel starts
            page.click("text=Run", timeout=10_000)
            page.click("text=Run All Cells", timeout=10_000)
            news = page.get_by_role("button", name="No", exact=True)
            if news.count():  # JupyterLab asks whether to fetch its news
                news.first.click()
            # A live frame: an image in the last cell's widgets while the launch runs.
            page.wait_for_function(
                "[...document.querySelectorAll('.jp-Cell:last-child .widget-image')]"
                ".some(img => img.naturalWidth > 0)",
                timeout=180_000,
            )
            time.sleep(8)
            last = page.locator(".jp-Cell").last
            last.evaluate("cell => cell.scrollIntoView({block: 'start'})")
            page.screenshot(path=str(HERE / "live-view.png"))
            page.wait_for_selector("text=done:", timeout=600_000)
            time.sleep(2)
            last.evaluate("cell => cell.scrollIntoView({block: 'start'})")
            page.screenshot(path=str(HERE / "live-view-done.png"))
            browser.close()
    finally:
        server.terminate()
        server.wait(30)


if __name__ == "__main__":
    main(sys.argv[1])
