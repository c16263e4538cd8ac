"""Shared test set-up: the ``root``/``gpu`` tiers and paths to the shared data.

Tiers (STYLE.md): unmarked tests are unit tests (no root, no hardware);
``root`` tests need root and a kernel that can load BPF (or netlink, or real
servers); ``gpu`` tests need an NVIDIA GPU. A ``root`` test that cannot run is
skipped, except with ``LLMDIAG_REQUIRE_BPF=1`` (set by ``.ci/run``), where it
fails: CI must never go green by skipping the kernel tests.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

# A rule reading history it does not declare fails the test that reaches the read (the agent
# itself logs it and starts recording it: llmdiag.analyzers.context.STRICT_HISTORY). Set before
# any llmdiag module is imported, and inherited by the commands the tests start.
os.environ["LLMDIAG_STRICT_HISTORY"] = "1"

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("LLMDIAG_SHARED_DIR", REPO.parent / "shared"))


@functools.cache
def root_unavailable_reason() -> str | None:
    """Why ``root`` tests cannot run here, or ``None`` when they can."""
    forced = os.environ.get("LLMDIAG_FORCE_ROOT_UNAVAILABLE")
    if forced:  # lets the suite test its own tiering as on a machine without BPF
        return forced
    if os.geteuid() != 0:
        return "not running as root"
    from llmdiag.bpf import features

    if not features.bcc_available():
        return features.bcc_available().detail
    headers = features.kernel_headers()
    if not headers:
        return f"no kernel headers: {headers.detail}"
    root, what = features.ensure_tracefs()
    if root is None:
        return what
    syscall = features.bpf_syscall_available()
    if not syscall:
        return syscall.detail
    return None


@functools.cache
def gpu_unavailable_reason() -> str | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except Exception as exc:  # noqa: BLE001
        return f"no usable NVML: {exc}"
    return None if count else "NVML sees no GPU"


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("root"):
        reason = root_unavailable_reason()
        if reason is not None:
            if os.environ.get("LLMDIAG_REQUIRE_BPF") == "1":
                pytest.fail(f"LLMDIAG_REQUIRE_BPF=1 but this root test cannot run: {reason}", pytrace=False)
            pytest.skip(f"root test: {reason}")
    if item.get_closest_marker("gpu"):
        reason = gpu_unavailable_reason()
        if reason is not None:
            pytest.skip(f"gpu test: {reason}")


@pytest.fixture(scope="session")
def shared_dir() -> Path:
    """``../shared`` beside the checkout (fixtures, data, traces)."""
    if not SHARED.is_dir():
        pytest.fail(f"shared data directory {SHARED} is missing (set LLMDIAG_SHARED_DIR)")
    return SHARED


@pytest.fixture(scope="session")
def repo_dir() -> Path:
    return REPO
