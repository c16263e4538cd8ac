"""cuda_alloc.bpf.c as text (render, defines, probe names), its header compiled with gcc
against the Python histogram, and the [cuda] config section."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from llmdiag.bpf.loader import BPF_DIR, render
from llmdiag.collectors.cuda_alloc import API_NAMES, HIST_SLOTS, PROBES, program_defines, size_histogram
from llmdiag.config import Config, ConfigError
from llmdiag.config.cuda import CudaConfig
from llmdiag.model import label_key

HEADER = BPF_DIR / "cuda_alloc.h"


def test_import_does_not_need_bcc() -> None:
    code = "import sys; sys.modules['bcc'] = None\nimport llmdiag.collectors.cuda_alloc as c; print(len(c.PROBES))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert int(out.stdout) == 6


def test_render_with_config_defines() -> None:
    text = render("cuda_alloc", program_defines(CudaConfig(max_pids=7, max_live_allocations=4096)))
    assert "#define MAX_PIDS 7" in text
    assert "#define MAX_LIVE 4096" in text
    assert "#define MAX_INFLIGHT 16384" in text
    assert "begin common.h" in text and "begin cuda_alloc.h" in text
    assert '#include "cuda_alloc.h"' not in text
    assert "BPF_HASH(live_allocs, struct cuda_live_key, struct cuda_live, MAX_LIVE);" in text
    assert "BPF_ARRAY(llmdiag_errors, u64, LLMDIAG_ERR_MAX);" in text


def test_every_probe_has_its_entry_and_return_function() -> None:
    text = render("cuda_alloc")
    defined = set(re.findall(r"^int (\w+)\(struct pt_regs \*ctx\)", text, re.M))
    wanted = {f"{kind}_{suffix}" for _, suffix in PROBES for kind in ("on", "ret")}
    assert defined == wanted


def test_api_names_follow_the_enum() -> None:
    # enum cuda_api in the header names the symbol of each value in its comment.
    found = re.findall(r"CUDA_API_\w+ = (\d+),\s*/\* (\w+)\(", HEADER.read_text())
    assert [symbol for _, symbol in sorted(found, key=lambda f: int(f[0]))] == list(API_NAMES)
    assert [symbol for symbol, _ in PROBES] == list(API_NAMES)


def test_hist_slots_match_the_header() -> None:
    assert f"#define CUDA_HIST_SLOTS {HIST_SLOTS}" in HEADER.read_text()


def _python_slot(size: int) -> int:
    # Smallest i with size <= 2**i, capped: the bucket le=2**i of size_histogram().
    return min(max(size - 1, 0).bit_length(), HIST_SLOTS - 1)


SIZES = [0, 1, 2, 3, 4, 5, 255, 256, 257, 511, 512, 1000, 1024, 1025, 4096, 4097, (1 << 20) - 1, 1 << 20,
         (1 << 20) + 1, 3 << 20, (1 << 32) - 1, 1 << 32, (1 << 32) + 1, 1 << 40, (1 << 63) - 1, 1 << 63, (1 << 64) - 1]


@pytest.mark.skipif(shutil.which("gcc") is None, reason="gcc is needed to compile the header")
def test_size_slot_in_c_matches_python(tmp_path: Path) -> None:
    program = tmp_path / "slots.c"
    program.write_text(
        "#include <stdio.h>\n#include <stdlib.h>\n"
        "typedef unsigned int u32;\ntypedef unsigned long long u64;\n"
        f'#include "{HEADER}"\n'
        "int main(int argc, char **argv) {\n"
        "    for (int i = 1; i < argc; i++) printf(\"%u\\n\", size_slot(strtoull(argv[i], NULL, 10)));\n"
        "    return 0;\n}\n"
    )
    binary = tmp_path / "slots"
    subprocess.run(["gcc", "-O2", "-Wall", "-Werror", "-o", str(binary), str(program)], check=True,
                   capture_output=True, timeout=60)
    out = subprocess.run([str(binary), *map(str, SIZES)], check=True, capture_output=True, text=True).stdout
    assert [int(x) for x in out.split()] == [_python_slot(s) for s in SIZES]
    for size in SIZES[1:-3]:
        slot = _python_slot(size)
        assert size <= 1 << slot and (slot == 0 or size > 1 << (slot - 1))  # exactly the le bound


def test_size_histogram_is_cumulative_over_the_populated_range() -> None:
    slots = [0] * HIST_SLOTS
    slots[8], slots[10], slots[20] = 100, 2, 1
    hist = size_histogram(slots)
    assert hist[label_key(le=256)] == 100
    assert hist[label_key(le=512)] == 100
    assert hist[label_key(le=1024)] == 102
    assert hist[label_key(le=1 << 19)] == 102
    assert hist[label_key(le=1 << 20)] == 103
    assert hist[label_key(le="+Inf")] == 103
    assert len(hist) == 20 - 8 + 1 + 1
    assert size_histogram([0] * HIST_SLOTS) == {}


def test_cuda_config_defaults_and_toml() -> None:
    cfg = Config.from_toml('[cuda]\nrescan_seconds = 2.5\nlibrary_names = ["libcuda.so", "libnvcuda.so"]\n')
    assert cfg.cuda.rescan_seconds == 2.5
    assert cfg.cuda.library_names == ("libcuda.so", "libnvcuda.so")
    assert Config().cuda == CudaConfig()
    assert CudaConfig().include_children is True


@pytest.mark.parametrize("toml,key", [
    ("[cuda]\nrescan_seconds = 0\n", "rescan_seconds"),
    ("[cuda]\nmax_pids = 0\n", "max_pids"),
    ("[cuda]\nmax_live_allocations = 10\n", "max_live_allocations"),
    ("[cuda]\nlibrary_names = []\n", "library_names"),
    ("[cuda]\nlibrary_names = [\"/usr/lib/libcuda.so\"]\n", "library_names"),
    ("[cuda]\nrescan = 1\n", "cuda.rescan"),
])
def test_bad_cuda_config_names_the_key(toml: str, key: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(key)):
        Config.from_toml(toml)
