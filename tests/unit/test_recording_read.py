"""Reading recordings: cut-off tails are replayed up to the cut, broken and empty files are clear errors."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

from llmdiag.cli.main import main
from llmdiag.model import Snapshot, SnapshotError, read_snapshots, write_snapshots


def _snaps(n: int) -> list[Snapshot]:
    return [Snapshot(ts=1733140000.0 + i, hostname="gpu-node-7") for i in range(n)]


def _read(path: Path) -> tuple[list[Snapshot], list[str]]:
    warnings: list[str] = []
    return list(read_snapshots(path, on_cut_tail=warnings.append)), warnings


def test_a_cut_off_last_line_replays_the_complete_snapshots_and_warns(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    write_snapshots(path, _snaps(4))
    path.write_bytes(path.read_bytes()[:-25])  # the recorder died mid-line (kill -9, full disk)
    snaps, warnings = _read(path)
    assert [s.ts for s in snaps] == [1733140000.0, 1733140001.0, 1733140002.0]
    assert len(warnings) == 1 and "line 4 is cut off" in warnings[0] and "3 complete snapshot(s)" in warnings[0]


def test_a_gzip_stream_cut_short_replays_what_came_before(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl.gz"
    # Incompressible hostnames make a long stream, so the cut lands late in it.
    snaps = [Snapshot(ts=1.0 + i, hostname=f"h{i}-" + bytes(range(256)).hex()[i:i + 400]) for i in range(50)]
    write_snapshots(path, snaps)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) * 3 // 4])
    back, warnings = _read(path)
    assert 10 < len(back) < 50
    assert [s.to_json() for s in back] == [s.to_json() for s in snaps[: len(back)]]
    assert len(warnings) == 1 and "the stream ends early" in warnings[0]


def test_a_complete_last_line_without_newline_is_kept_silently(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    path.write_text("\n".join(s.dumps() for s in _snaps(2)))
    assert _read(path) == (_snaps(2), [])


def test_appended_gzip_members_are_all_read(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl.gz"
    write_snapshots(path, _snaps(2))
    write_snapshots(path, _snaps(3)[2:], append=True)  # a second gzip member
    assert _read(path) == (_snaps(3), [])


@pytest.mark.parametrize(("content", "message"), [
    (b"", "no snapshots in"),
    (b"\n  \n", "no snapshots in"),
    (b'{"schema": "llmdiag.snap', "no snapshots in .*line 1 is cut off"),
])
def test_a_recording_without_snapshots_is_an_error(tmp_path: Path, content: bytes, message: str) -> None:
    path = tmp_path / "rec.jsonl"
    path.write_bytes(content)
    with pytest.raises(SnapshotError, match=message):
        list(read_snapshots(path))


def test_corrupt_or_foreign_gzip_is_a_snapshot_error(tmp_path: Path) -> None:
    good = gzip.compress(b"".join(s.dumps().encode() + b"\n" for s in _snaps(3)))
    corrupt = tmp_path / "corrupt.jsonl.gz"
    corrupt.write_bytes(good[:20] + bytes(b ^ 0xFF for b in good[20:60]) + good[60:])
    with pytest.raises(SnapshotError, match=r"corrupt.jsonl.gz: broken gzip file \(corrupt data"):
        list(read_snapshots(corrupt))
    foreign = tmp_path / "plain.jsonl.gz"
    foreign.write_bytes(b"".join(s.dumps().encode() + b"\n" for s in _snaps(1)))
    with pytest.raises(SnapshotError, match="broken gzip file"):
        list(read_snapshots(foreign))


def test_a_bad_line_in_the_middle_is_still_an_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    path.write_text(_snaps(1)[0].dumps() + "\n{oops\n" + _snaps(1)[0].dumps() + "\n")
    with pytest.raises(SnapshotError, match=r"rec.jsonl:2"):
        list(read_snapshots(path))


def test_diagnose_replay_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.jsonl.gz"
    write_snapshots(empty, [])
    assert main(["diagnose", "--replay", str(empty), "--json"]) == 3  # was 0: "healthy" from no data
    err = capsys.readouterr().err
    assert f"no snapshots in {empty}" in err and "Traceback" not in err
    corrupt = tmp_path / "corrupt.jsonl.gz"
    corrupt.write_bytes(b"\x1f\x8b\x08\x00" + b"\x00" * 6 + b"\xff" * 40)
    assert main(["diagnose", "--replay", str(corrupt), "--json"]) == 3
    assert "broken gzip file" in capsys.readouterr().err


def test_diagnose_replays_a_cut_recording_with_a_warning(tmp_path: Path) -> None:
    path = tmp_path / "rec.jsonl"
    write_snapshots(path, _snaps(3))
    path.write_bytes(path.read_bytes()[:-10])
    proc = subprocess.run([sys.executable, "-m", "llmdiag.cli", "diagnose", "--replay", str(path), "--json"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "line 3 is cut off" in proc.stderr and "Traceback" not in proc.stderr
    assert json.loads(proc.stdout)["diagnoses"] == []


def test_exit_code_3_is_documented() -> None:
    proc = subprocess.run([sys.executable, "-m", "llmdiag.cli", "diagnose", "--help"],
                          capture_output=True, text=True, timeout=60)
    assert "3 the recording cannot be read" in " ".join(proc.stdout.split())
