"""tests/sanitize.sh (the GPU tests under compute-sanitizer): its usage names its parts, an unknown
part is refused before anything runs, and every part selects tests that exist."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "sanitize.sh"


def _parts() -> list[str]:
    usage = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True)
    assert usage.returncode == 2 and "Parts" in usage.stdout
    listed = usage.stdout.split("# Parts")[1].split("# Each part")[0].split("# SANITIZE_COLLECT")[0]
    return [line.split()[1] for line in listed.splitlines()[1:] if line.strip("# ")]


def test_usage_and_unknown_parts(tmp_path: Path) -> None:
    parts = _parts()
    assert {"mgemm", "mnorm", "mops", "mshared", "race", "sync"} <= set(parts)
    text = SCRIPT.read_text()
    for part in parts:
        assert re.search(rf"^    {part}\) sanitize {part} (memcheck|racecheck|synccheck) \d+ ", text, re.M), part
    unknown = subprocess.run(["bash", str(SCRIPT), str(tmp_path), "mgemm", "nope"], capture_output=True, text=True)
    assert unknown.returncode == 2 and "unknown part: nope" in unknown.stderr
    assert not any(tmp_path.glob("*.out"))


def test_every_part_selects_existing_tests(tmp_path: Path) -> None:
    parts = _parts()
    env = dict(os.environ, SANITIZE_COLLECT="1")
    run = subprocess.run(["bash", str(SCRIPT), str(tmp_path), *parts], capture_output=True, text=True, env=env,
                         cwd=ROOT, timeout=600)
    assert run.returncode == 0, run.stderr
    lines = dict(line.split(": ", 1) for line in run.stdout.splitlines())
    assert sorted(lines) == sorted(parts)
    for part, line in lines.items():
        found = re.match(r"(\d+)(/\d+)? tests? collected", line)
        assert found and int(found.group(1)) > 0, (part, line)
        assert "error" not in line, (part, line)
