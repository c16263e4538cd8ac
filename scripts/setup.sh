#!/usr/bin/env bash
# Set up everything llmdiag needs on a Debian 12 / Ubuntu machine, idempotently.
#
#   scripts/setup.sh          # what `make demo` and `make test` run first
#
# 1. apt packages that are missing (bcc, bpftool, kernel headers, haproxy, prometheus, ...)
# 2. kernel headers for bcc: the running kernel's package, else the distribution's
#    generic headers linked at /lib/modules/$(uname -r)/{build,source} (SPEC section 2)
# 3. tracefs mounted at /sys/kernel/tracing (bcc reads tracepoint formats there)
# 4. a venv from /usr/bin/python3 with --system-site-packages (bcc is a distro module)
#    and `pip install -e .[dev]`, redone only when pyproject.toml changed.
# A second run with nothing to do takes a couple of seconds. Every change it makes is printed.
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=${LLMDIAG_VENV:-.venv}
say() { printf '[setup] %s\n' "$*"; }

is_root() { [ "$(id -u)" = 0 ]; }

# --- 1. apt packages ---------------------------------------------------------
APT_PACKAGES=(
    python3 python3-venv python3-pip python3-dev      # the venv is made from the distro Python (bcc lives there)
    python3-bpfcc bpfcc-tools                          # bcc: the BPF compiler and its Python module
    bpftool                                            # bpf_stats (run_cnt/run_time_ns) for the overhead benchmarks
    iproute2                                           # ss, for cross-checking the TCP collectors
    gcc make                                           # stand-in libcuda for the uprobe tests
    haproxy prometheus                                 # real gateway and scraper in the integration tests
)

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$pkg")
    fi
done

apt_updated=0
apt_install() {
    if ! is_root; then
        say "not root: cannot install $*; run 'sudo make ...' or install them by hand"
        return 1
    fi
    if [ "$apt_updated" = 0 ]; then
        say "apt-get update"
        apt-get update -qq
        apt_updated=1
    fi
    say "apt-get install $*"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

if [ "${#missing[@]}" -gt 0 ]; then
    # Ubuntu ships bpftool inside linux-tools; install what exists by name and say what did not.
    installable=()
    for pkg in "${missing[@]}"; do
        if [ "$apt_updated" = 0 ] && is_root; then apt-get update -qq; apt_updated=1; fi
        if apt-cache show "$pkg" >/dev/null 2>&1; then
            installable+=("$pkg")
        else
            say "package $pkg is not in this distribution's archive; skipped (doctor reports what is missing)"
        fi
    done
    [ "${#installable[@]}" -gt 0 ] && apt_install "${installable[@]}"
fi

# --- 2. kernel headers for bcc -------------------------------------------------
KREL=$(uname -r)
MODDIR=/lib/modules/$KREL
if [ ! -e "$MODDIR/build/include" ] && [ ! -e /sys/kernel/kheaders.tar.xz ]; then
    if is_root && { [ "$apt_updated" = 1 ] || { apt-get update -qq && apt_updated=1; }; } \
        && apt-cache show "linux-headers-$KREL" >/dev/null 2>&1; then
        apt_install "linux-headers-$KREL"
    elif is_root; then
        # A custom kernel (like a Firecracker guest) has no headers package: use the
        # distribution's generic headers. Tracepoint-only programs compile and run this way;
        # kernel structs read through them may have the wrong layout (SPEC section 2).
        arch=$(dpkg --print-architecture)
        if ! dpkg-query -W -f='${Status}' "linux-headers-$arch" 2>/dev/null | grep -q "install ok installed"; then
            apt_install "linux-headers-$arch"
        fi
        hdr=$(ls -d /usr/src/linux-headers-*-"$arch" 2>/dev/null | sort -V | tail -n 1)
        common=${hdr%-"$arch"}-common
        if [ -z "$hdr" ] || [ ! -d "$common" ]; then
            say "no generic kernel headers found under /usr/src; BPF collectors will be unavailable"
        else
            mkdir -p "$MODDIR"
            ln -sfn "$hdr" "$MODDIR/build"
            ln -sfn "$common" "$MODDIR/source"
            say "kernel $KREL has no headers package: linked $MODDIR/build -> $hdr and $MODDIR/source -> $common (fallback headers)"
        fi
    else
        say "no kernel headers at $MODDIR/build and not root to install them; BPF collectors will be unavailable"
    fi
fi

# --- 3. tracefs ------------------------------------------------------------------
if is_root && [ -d /sys/kernel/tracing ] && [ ! -e /sys/kernel/tracing/events ]; then
    mount -t tracefs tracefs /sys/kernel/tracing && say "mounted tracefs at /sys/kernel/tracing"
fi
if is_root && [ -d /sys/kernel/debug ] && [ ! -e /sys/kernel/debug/tracing ]; then
    # Older bcc versions look for tracepoint formats under debugfs.
    mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null && say "mounted debugfs at /sys/kernel/debug" || true
fi

# --- 4. the venv -----------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV from /usr/bin/python3 with --system-site-packages (bcc comes from python3-bpfcc)"
    /usr/bin/python3 -m venv --system-site-packages "$VENV"
fi
stamp="$VENV/.llmdiag-installed"
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    say "pip install -e .[dev] into $VENV"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[dev]"
    echo "$want" >"$stamp"
fi
say "ready: $VENV/bin/llmdiag"
