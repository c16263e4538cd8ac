"""deploy/Dockerfile installs only through scripts/setup.sh (the path `make demo`/`make test` use).

There is no Docker daemon in CI, so the image is not built here; what is checked is that no RUN
step has an install path of its own, that everything the set-up needs is copied in first, and that
the set-up's image and headers modes exist and behave (tests/root/test_deploy_headers.py runs the
headers mode for real in a private mount namespace).
"""

from __future__ import annotations

import fnmatch
import os
import re
import shlex
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "Dockerfile"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    assert not pending, "a continued instruction never ends"
    return out


def test_parser_sees_continuations():
    parsed = instructions("FROM x\n# c\nRUN a \\\n  # inner comment\n  && b\nENV A=1\n")
    assert parsed == [("FROM", "x"), ("RUN", "a  && b"), ("ENV", "A=1")]


def test_base_image_is_debian_bookworm():
    steps = instructions(DOCKERFILE.read_text())
    assert steps[0][0] == "FROM" and re.fullmatch(r"debian:bookworm(-slim)?", steps[0][1])


def test_every_run_goes_through_setup_sh_and_nothing_installs_on_its_own():
    steps = instructions(DOCKERFILE.read_text())
    runs = [args for word, args in steps if word == "RUN"]
    assert runs, "the image installs nothing?"
    for args in runs:
        commands = [c.strip() for c in re.split(r"&&|;|\|\|", args)]
        assert any(re.search(r"(^|\s)scripts/setup\.sh(\s|$)", c) for c in commands), args
        assert "LLMDIAG_SETUP_MODE=image" in args
        for command in commands:
            words = shlex.split(command)
            tools = [w for w in words if not re.fullmatch(r"[A-Z_]+=.*", w)]
            assert not tools or tools[0] not in {"apt-get", "apt", "pip", "pip3", "python3", "curl", "wget", "dpkg"}, (
                f"second install path in the Dockerfile: {command!r}"
            )


def test_setup_inputs_are_copied_before_the_run_and_not_ignored():
    steps = instructions(DOCKERFILE.read_text())
    first_run = next(i for i, (word, _) in enumerate(steps) if word == "RUN")
    copied = []
    for word, args in steps[:first_run]:
        if word == "COPY":
            *sources, _dest = args.split()
            copied.extend(sources)
    for needed in ("pyproject.toml", "README.md", "LICENSE", "scripts/setup.sh", "llmdiag", "deploy/entrypoint.sh"):
        assert needed in copied, needed
        assert (REPO / needed).exists(), needed
    # Dockerfile.dockerignore: "*" then "!path" re-includes; every copied path must be re-included.
    patterns = [p.strip() for p in (REPO / "deploy" / "Dockerfile.dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]

    def included(path: str) -> bool:
        keep = True
        for pattern in patterns:
            negate = pattern.startswith("!")
            pat = pattern[1:] if negate else pattern
            if fnmatch.fnmatch(path, pat) or fnmatch.fnmatch(path, pat.rstrip("/*")):
                keep = negate
        return keep

    for needed in ("pyproject.toml", "README.md", "LICENSE", "scripts/setup.sh", "llmdiag/agent/__init__.py",
                   "deploy/entrypoint.sh"):
        assert included(needed), needed
    assert not included("tests/conftest.py") and not included(".venv/bin/python")


def test_entrypoint_runs_setup_in_headers_mode_then_llmdiag():
    steps = dict(instructions(DOCKERFILE.read_text()))
    assert steps["ENTRYPOINT"] == '["/opt/llmdiag/src/deploy/entrypoint.sh"]'
    entry = (REPO / "deploy" / "entrypoint.sh").read_text()
    assert "LLMDIAG_SETUP_MODE=headers /opt/llmdiag/src/scripts/setup.sh" in entry
    assert 'exec /opt/llmdiag/venv/bin/llmdiag "$@"' in entry
    assert os.access(REPO / "deploy" / "entrypoint.sh", os.X_OK)
    envs = " ".join(args for word, args in instructions(DOCKERFILE.read_text()) if word == "ENV")
    assert "LLMDIAG_VENV=/opt/llmdiag/venv" in envs and "PATH=/opt/llmdiag/venv/bin:$PATH" in envs


def test_setup_rejects_an_unknown_mode_with_ex_usage():
    proc = subprocess.run(["bash", str(REPO / "scripts" / "setup.sh")], env={**os.environ, "LLMDIAG_SETUP_MODE": "nope"},
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 64
    assert "unknown LLMDIAG_SETUP_MODE=nope" in proc.stdout
