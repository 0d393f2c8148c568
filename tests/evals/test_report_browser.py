"""The HTML report in a real browser: headless Chromium renders the report of a real `m3-agent eval run`.

The run is real (the stand-in over HTTP, the Docker sandbox, grading); its tasks are built-in ones renamed
with ids in SWE-bench's shapes, one longer than a label may be. Chromium lays the page out; a script in a
copy of the page measures every plot label, and the test reads the measurements back from `--dump-dom`.
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from PIL import Image, ImageStat

from m3_agent.evals.tasks import builtin_standin_script, builtin_task
from m3_agent.standin.server import StandinServer

WINDOW = (1280, 1600)
# No network here: without these, Chromium keeps trying to reach its update and sync services.
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars"]
COLOURS = {"resolved": (0x2E, 0x7D, 0x32), "unresolved": (0xF9, 0xA8, 0x25)}
WRONG_CHUNKS = {  # an edit that does not fix the bug: one unresolved instance, drawn in its own colour
    "match": "chunked() silently drops the last items",
    "turns": [
        {"tool_calls": [{"name": "file_edit", "arguments": {
            "path": "chunks.py", "old_str": '"""Split sequences into chunks."""', "new_str": '"""Chunks."""'}}]},
        {"content": "Done.", "tool_calls": [{"name": "submit", "arguments": {}}]},
    ],
}
# Runs in the page after layout; writes what the browser measured into the DOM for --dump-dom.
MEASURE = """<script>
const bars = svg => svg.querySelector("rect").getBoundingClientRect().left;
const labels = [...document.querySelectorAll("svg text.label")].map(t => {
  const svg = t.ownerSVGElement.getBoundingClientRect(), box = t.getBoundingClientRect();
  return {shown: [...t.childNodes].filter(n => n.nodeType === Node.TEXT_NODE).map(n => n.data).join(""),
          title: t.querySelector("title") ? t.querySelector("title").textContent : null,
          left: box.left - svg.left, right: box.right, bar_left: bars(t.ownerSVGElement),
          width: box.width, height: box.height};
});
const cells = [...document.querySelectorAll("h2 + table td:first-child")].map(
  td => ({text: td.textContent, overflows: td.scrollWidth > td.clientWidth}));
const out = document.createElement("pre");
out.id = "measured";
out.textContent = JSON.stringify({labels, cells});
document.body.appendChild(out);
</script>"""


@pytest.fixture(scope="module")
def chromium() -> str:
    """Debian's Chromium (`bash run.sh setup` installs it): fail under CI=true, skip elsewhere when missing."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path:
        return path
    why = "chromium is not installed (bash run.sh setup installs it)"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{why}; CI=true: the report's browser test must run")
    pytest.skip(why)


def _ids(name: str, commit: str) -> str:
    """Ids in SWE-bench's shapes: repo__name-commit, and SWE-bench Pro's long instance_... form."""
    return f"instance_m3-agent__{name}-{commit}" if name == "lru" else f"m3-agent-builtin-suite__{name}-{commit[:7]}"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, sandbox_image) -> Path:
    """The output folder of a real `m3-agent eval run`: two instances resolved, one not."""
    root = tmp_path_factory.mktemp("browser-report")
    names = ["roman", "lru", "chunks"]
    rows = []
    for n in names:
        task = builtin_task(n)
        rows.append(task.model_copy(update={"instance_id": _ids(n, task.base_commit)}).model_dump(mode="json"))
    (root / "tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    script = builtin_standin_script(["roman", "lru"])
    script["conversations"].append(WRONG_CHUNKS)
    with StandinServer(script) as srv:
        r = subprocess.run([sys.executable, "-m", "m3_agent.cli", "eval", "run", "--tasks", str(root / "tasks.jsonl"),
                            "--base-url", srv.base_url, "--workers", "2", "--output", str(root / "run"), "-q"],
                           capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0, r.stderr
    return root / "run"


def _chromium(binary: str, *args: str) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        return subprocess.run([binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", *args],
                              capture_output=True, text=True, timeout=120)


def _instance_ids(run: Path) -> list[str]:
    return [json.loads(line)["instance_id"] for line in (run / "results.jsonl").read_text().splitlines()]


def _shows(label: dict, instance_id: str) -> bool:
    """The label is the whole id, or its head and tail around an ellipsis with the whole id as title."""
    if label["shown"] == instance_id:
        return True
    head, _, tail = label["shown"].partition("\u2026")
    return (label["title"] == instance_id and bool(tail) and len(head) >= 16
            and instance_id.startswith(head) and instance_id.endswith(tail))


@pytest.mark.docker
def test_chromium_lays_out_every_label_whole(run_dir, chromium, tmp_path):
    page = tmp_path / "measured.html"
    page.write_text((run_dir / "report.html").read_text().replace("</body>", MEASURE + "</body>"))
    r = _chromium(chromium, f"--window-size={WINDOW[0]},{WINDOW[1]}", "--dump-dom", page.as_uri())
    found = re.search(r'<pre id="measured">(.*?)</pre>', r.stdout, re.S)
    assert found, f"chromium printed no measurements: {r.stderr[-2000:]}"
    measured = json.loads(html.unescape(found.group(1)))
    ids = _instance_ids(run_dir)
    assert len(ids) == 3 and any(len(i) > 60 for i in ids)
    labels = measured["labels"]
    assert len(labels) == 3 * len(ids)  # one per instance in each of the three plots
    for label in labels:
        assert label["width"] > 0 and label["height"] > 0, label
        assert label["left"] >= 0, f"label cut on the left: {label}"
        assert label["right"] <= label["bar_left"], f"label runs into its bar: {label}"
    for i in ids:
        assert sum(_shows(label, i) for label in labels) == 3, (i, labels)
    assert sorted(c["text"] for c in measured["cells"]) == sorted(ids)
    assert not any(c["overflows"] for c in measured["cells"]), measured["cells"]


@pytest.mark.docker
def test_chromium_screenshot_shows_the_report(run_dir, chromium, tmp_path):
    shot = tmp_path / "report.png"
    r = _chromium(chromium, f"--window-size={WINDOW[0]},{WINDOW[1]}", f"--screenshot={shot}",
                  (run_dir / "report.html").as_uri())
    assert shot.is_file(), f"no screenshot: {r.stderr[-2000:]}"
    with Image.open(shot) as img:
        assert img.format == "PNG" and img.size == WINDOW
        rgb = img.convert("RGB")
    assert max(ImageStat.Stat(rgb).stddev) > 20, "the screenshot is (nearly) blank"
    counts = {colour: 0 for colour in COLOURS.values()}
    for n, colour in rgb.getcolors(maxcolors=WINDOW[0] * WINDOW[1]):
        if colour in counts:
            counts[colour] += n
    # Bars are 16 px high: each outcome's bars cover thousands of pixels in its colour.
    assert all(n > 2000 for n in counts.values()), counts
