"""BucketExplorer latency: from a new bucket cap to the new *measured* timeline on screen.

Target: under 2 s on 2 CPU cores for the default model (tiny-gpt, 2 ranks, 1 warm-up + 1 traced
step per re-measure).

Two measurements, each a median over many slider moves (alternating between two neighbouring
stops, 1 MiB and 0.5 MiB, so every move changes the bucket count):

- **kernel**: in this process, set the slider's value as the front end does and time until the
  widget has re-measured on the warm ranks and replaced its figure (``widget.latency_s``). The
  default model and gpt-7m are interleaved move by move.
- **browser** (``--browser``): JupyterLab in Debian's Chromium, the widget in a notebook; press
  the arrow key on the slider's handle and time until the timeline's SVG shows the new bucket
  count. This is what a learner waits for: the kernel's work, the comm messages and plotly
  drawing the new figure.

    flock /tmp/dplab-cpu.lock .venv/bin/python benchmarks/bucket_explorer.py --moves 20 --browser
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _stats import machine

import dplab
from dplab.widgets.bucket_explorer import BucketExplorer

STOPS = (1.0, 0.5)  # neighbouring slider stops: 4 and 7 buckets for tiny-gpt


def summary(values: list[float]) -> str:
    values = sorted(values)
    p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
    return (
        f"median {statistics.median(values):.2f} s, p90 {p90:.2f} s, "
        f"min {values[0]:.2f} s, max {values[-1]:.2f} s (n={len(values)})"
    )


def kernel_side(moves: int) -> dict[str, list[float]]:
    """Slider moves on widgets sharing one warm 2-rank cluster, models interleaved."""
    out: dict[str, list[float]] = {"tiny-gpt": [], "gpt-7m": []}
    with dplab.Cluster(2) as cluster:
        widgets = {m: BucketExplorer(cluster, model=m, bucket_cap_mb=STOPS[0]) for m in out}
        for i in range(moves):
            for model, widget in widgets.items():
                widget.cap_slider.value = STOPS[(i + 1) % 2]
                assert widget.message == "", widget.message
                out[model].append(widget.latency_s)
        for widget in widgets.values():
            widget.close()
    return out


NOTEBOOK = {
    "cells": [
        {
            "cell_type": "code",
            "execution_count": None,
            "metadata": {},
            "outputs": [],
            "source": "from dplab.widgets.bucket_explorer import BucketExplorer\n"
            f"BucketExplorer(bucket_cap_mb={STOPS[0]})",
        }
    ],
    "metadata": {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}
    },
    "nbformat": 4,
    "nbformat_minor": 5,
}

COUNT_IN_SVG = """([el, want]) => [...el.querySelectorAll('svg text')]
                       .some(t => t.textContent.includes(want))"""


def browser_side(moves: int) -> list[float]:
    """Arrow-key presses on the widget's slider in JupyterLab; time to the redrawn timeline."""
    from tests.browser.lab import LabServer, Lesson, chromium

    times = []
    with tempfile.TemporaryDirectory() as tmp, LabServer(Path(tmp), notebooks=[]) as server:
        (server.root / "bench.ipynb").write_text(json.dumps(NOTEBOOK))
        with chromium() as browser:
            lesson = Lesson.open(browser, server, "bench.ipynb")
            lesson.run_all()
            page = lesson.page
            explorer = page.locator(".dplab-bucket-explorer").first
            count = explorer.locator(".dplab-bucket-count")
            handle = explorer.locator(".dplab-bucket-cap .noUi-handle")
            timeline = explorer.locator(".dplab-timeline")
            page.wait_for_function(
                "el => /\\d+ buckets?/.test(el.textContent)", arg=count.element_handle()
            )
            for i in range(moves):
                before = count.text_content()
                handle.focus()
                key = "ArrowLeft" if i % 2 == 0 else "ArrowRight"  # 1 → 0.5 → 1 MiB ...
                t0 = time.monotonic()
                page.keyboard.press(key)
                page.wait_for_function(
                    "([el, old]) => el.textContent !== old && /\\d+ buckets?/.test(el.textContent)",
                    arg=[count.element_handle(), before],
                    timeout=120_000,
                )
                n = int((count.text_content() or "").split(" bucket")[0].split()[-1])
                page.wait_for_function(
                    COUNT_IN_SVG,
                    arg=[timeline.element_handle(), f"{n} buckets,"],
                    timeout=120_000,
                )
                times.append(time.monotonic() - t0)
            lesson.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--moves", type=int, default=20, help="slider moves per measurement")
    parser.add_argument("--browser", action="store_true", help="also time it in Chromium")
    args = parser.parse_args()
    load_before = os.getloadavg()
    kernel = kernel_side(args.moves)
    browser = browser_side(args.moves) if args.browser else []
    print(f"machine: {machine()}")
    print(
        f"load average before {[round(x, 2) for x in load_before]}, "
        f"after {[round(x, 2) for x in os.getloadavg()]}"
    )
    for model, values in kernel.items():
        print(f"kernel, {model}: {summary(values)}")
    if browser:
        print(f"browser (key press → new timeline drawn), tiny-gpt: {summary(browser)}")


if __name__ == "__main__":
    main()
