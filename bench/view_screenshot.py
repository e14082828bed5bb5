"""The README's screenshot of ``rbpipe view``: a short run, the live page in headless Chromium, one group open.

    python bench/view_screenshot.py                      # a new 30-step run, then docs/view.png
    python bench/view_screenshot.py --run-dir runs/demo  # an existing run or store

Needs Debian's chromium and chromium-driver (``.ci/run`` installs them) and Selenium (the test extra). The PNG is
quantised to a small palette so that it stays small in the repository.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "rbpipe.cli"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", type=Path, help="an existing run directory or store (default: a new short run)")
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "view.png")
    ap.add_argument("--steps", type=int, default=30)
    args = ap.parse_args()
    from PIL import Image
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    with tempfile.TemporaryDirectory(prefix="rbpipe-shot-") as tmp:
        run, cwd = args.run_dir, None
        if run is None:  # in a scratch folder, so that the page names the store as a user's would: runs/demo/store
            run, cwd = Path("runs/demo"), tmp
            subprocess.run(CLI + ["run", "--run-dir", str(run), "--steps", str(args.steps), "--no-progress"],
                           check=True, stdout=subprocess.DEVNULL, cwd=cwd)
        proc = subprocess.Popen(CLI + ["view", str(run), "--port", "0"], stdout=subprocess.PIPE, text=True, cwd=cwd)
        try:
            url = re.search(r"at (http://\S+/)", proc.stdout.readline()).group(1)  # type: ignore[union-attr]
            opts = Options()
            opts.binary_location = "/usr/bin/chromium"
            for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,900",
                      f"--user-data-dir={tmp}/profile", "--hide-scrollbars"):
                opts.add_argument(a)
            driver = webdriver.Chrome(service=Service(executable_path="/usr/bin/chromedriver"), options=opts)
            try:
                driver.get(url)
                wait = WebDriverWait(driver, 120)
                wait.until(lambda d: d.execute_script("return document.body.dataset.ready === '1'"))
                rows = driver.find_elements(By.CSS_SELECTOR, "#groups tbody tr")
                rows[min(2, len(rows) - 1)].click()
                wait.until(lambda d: d.find_elements(By.CSS_SELECTOR, "#members tbody tr"))
                shot = Path(tmp) / "shot.png"
                driver.save_screenshot(str(shot))
            finally:
                driver.quit()
        finally:
            proc.terminate()
            proc.wait(timeout=60)
        img = Image.open(shot).convert("RGB").quantize(colors=64, method=Image.Quantize.MEDIANCUT)
        img.save(args.out, optimize=True)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} KB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
