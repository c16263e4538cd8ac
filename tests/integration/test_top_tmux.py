"""``llmdiag top --replay FILE`` in a real terminal (tmux), driven with keys the way a person does.

At 120x40 and at 80x24: the fleet view must show the sick backend, a score
column and its diagnosis; Enter opens the worst backend with its diagnosis;
``h`` shows TIME_WAIT per destination; ``q`` quits and the terminal is freed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from tui_support import BACKENDS, write_fleet_recording  # noqa: E402

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path) -> Path:
    path = tmp_path / "fleet.toml"
    path.write_text("".join(f'[[backends]]\nname = "{name}"\nurl = "http://127.0.0.1:{8000 + i}"\n\n'
                            for i, name in enumerate(BACKENDS)))
    return path


class Tmux:
    def __init__(self, width: int, height: int, command: str) -> None:
        assert shutil.which("tmux"), "tmux is missing (scripts/setup.sh installs it)"
        self.name = f"llmdiag-top-{uuid.uuid4().hex[:8]}"
        subprocess.run(["tmux", "new-session", "-d", "-s", self.name, "-x", str(width), "-y", str(height), command],
                       check=True)

    def capture(self) -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", self.name], capture_output=True, text=True).stdout

    def keys(self, *keys: str) -> None:
        subprocess.run(["tmux", "send-keys", "-t", self.name, *keys], check=True)

    def alive(self) -> bool:
        return subprocess.run(["tmux", "has-session", "-t", self.name], capture_output=True).returncode == 0

    def wait_for(self, check: Callable[[str], bool], timeout: float = 60.0) -> str:
        deadline = time.monotonic() + timeout
        screen = ""
        while time.monotonic() < deadline:
            screen = self.capture()
            if check(screen):
                return screen
            time.sleep(0.3)
        raise AssertionError(f"screen never matched:\n{screen}")

    def kill(self) -> None:
        subprocess.run(["tmux", "kill-session", "-t", self.name], capture_output=True)


@pytest.mark.parametrize("size", [(120, 40), (80, 24)])
def test_top_replay_in_a_terminal(tmp_path: Path, size: tuple[int, int]) -> None:
    recording = write_fleet_recording(tmp_path / "fleet.jsonl")
    command = (f"cd {REPO} && PYTHONPATH={REPO} {sys.executable} -m llmdiag.cli --config {_config(tmp_path)} "
               f"top --replay {recording} --speed 64")
    tmux = Tmux(*size, command)
    try:
        tmux.wait_for(lambda s: "end of data" in s or "tick 66" in s)
        time.sleep(5)  # let the diagnosis pop-ups expire: they sit over the right half of the table
        fleet = tmux.capture()
        lines = fleet.splitlines()
        header = next(line for line in lines if "backend" in line and "state" in line)
        assert "score" in header and "diagnosis" in header, fleet
        rows = {line.split()[0]: line for line in lines if line.strip().startswith("vllm-")}
        assert set(rows) == set(BACKENDS), fleet
        assert "degraded" in rows["vllm-2"] and "client_timeout_storm" in rows["vllm-2"], fleet
        assert "kv_cache_saturation" in rows["vllm-1"], fleet
        assert "healthy" in rows["vllm-0"] and "!" not in rows["vllm-0"], fleet
        # Worst first: the top row is the sickest backend; Enter opens it.
        first = next(line for line in lines if line.strip().startswith("vllm-")).split()[0]
        assert first == "vllm-2", fleet
        tmux.keys("Enter")
        backend = tmux.wait_for(lambda s: "balancer:" in s)
        assert "vllm-2" in backend and "DEGRADED" in backend and "client_timeout_storm" in backend, backend
        tmux.keys("Escape")  # alone: ESC followed at once by h would read as Alt+h
        tmux.wait_for(lambda s: "balancer:" not in s and "sort score" in s)
        tmux.keys("h")
        host = tmux.wait_for(lambda s: "TIME_WAIT per destination" in s or "pressure stall" in s)
        assert "pressure stall" in host, host
        if size[1] >= 40:
            assert "127.0.0.1:8003" in host and "20000" in host, host
        tmux.keys("q")
        deadline = time.monotonic() + 15
        while tmux.alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not tmux.alive(), "llmdiag top did not quit on q"
    finally:
        tmux.kill()
