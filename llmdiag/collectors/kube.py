"""Kubernetes metadata for a backend process, with no API server access.

A node agent that asks the API server for pod metadata needs RBAC, a watch,
and a working control plane exactly when things are on fire. Everything the
labels need is already on the node, in the engine process itself:

=================  ===========================================================
``pod``            env ``POD_NAME`` (downward API), else the pod's hostname:
                   env ``HOSTNAME`` or ``<root>/etc/hostname`` (see below)
``namespace``      env ``POD_NAMESPACE`` (downward API), else the service
                   account's ``namespace`` file mounted in the container
``container``      env ``CONTAINER_NAME`` (a convention: Kubernetes has no
                   downward-API field for the container name, so it is absent
                   unless the pod spec sets it)
``node``           env ``NODE_NAME`` of the process (downward API), else the
                   agent's own node name (its own ``NODE_NAME``: every local
                   pid runs on the agent's node)
``pod_uid``        env ``POD_UID`` (downward API), else the pod cgroup
``container_id``   the container cgroup, as ``<runtime>://<64 hex>``, the form
                   of the Pod's ``status.containerStatuses[].containerID`` and
                   kube-state-metrics' ``container_id`` label
=================  ===========================================================

A label whose source is missing or unreadable is absent: never guessed. For
another user's process, ``/proc/PID/environ`` (mode 0400) needs
``CAP_DAC_READ_SEARCH`` and ``/proc/PID/root`` needs ``CAP_SYS_PTRACE``
(measured in tests/root/test_deploy_capabilities.py); without them those
labels are absent and the cgroup labels remain.

Quirks handled here (each has a fixture test):

* cgroup paths. The kubelet names pod cgroups after the QoS class and pod UID.
  With the ``cgroupfs`` driver: ``/kubepods/<qos>/pod<uid>/<container id>``
  (Guaranteed pods have no ``<qos>`` level). With the ``systemd`` driver:
  ``/kubepods.slice/kubepods-<qos>.slice/kubepods-<qos>-pod<uid>.slice/
  <runtime>-<container id>.scope``, the UID's ``-`` turned into ``_``
  because systemd reserves ``-`` as the slice separator (kubelet
  ``pkg/kubelet/cm/cgroup_manager_linux.go``, ``ToSystemd``). The runtime
  prefix is ``cri-containerd-`` (containerd), ``crio-`` (CRI-O; its
  ``crio-conmon-<id>.scope`` holds the monitor, not the container) or
  ``docker-`` (cri-dockerd). crun under CRI-O may add a ``/container``
  sub-cgroup below the scope.
* cgroup v1 lists one line per hierarchy (``12:memory:/kubepods/...``);
  cgroup v2 one line ``0::/kubepods...``; hybrid hosts both. The first line
  naming a pod wins; they agree on a Kubernetes node.
* cgroup namespaces. The agent runs in its own cgroup namespace (the default
  for containerd and CRI-O on cgroup v2), and the kernel prints other
  processes' paths relative to the reader's namespace root:
  ``0::/../../kubepods-burstable-pod<uid>.slice/cri-containerd-<id>.scope``.
  Components are matched one by one, so the ``..`` prefix does not matter.
* ``HOSTNAME`` is the pod name (truncated to 63 characters by the kubelet)
  only when the process has its own UTS namespace. A ``hostNetwork: true``
  pod shares the node's UTS namespace and its hostname is the *node's*, so
  the pod label is not taken from it when ``/proc/PID/ns/uts`` equals
  ``/proc/1/ns/uts``. A process outside any pod cgroup, without
  ``KUBERNETES_SERVICE_HOST`` in its environment, gets no hostname-based
  label at all.
* Files inside the container are read through ``/proc/PID/root``. Absolute
  symlinks in the container's tree (Debian and Ubuntu images have
  ``/var/run -> /run``) would otherwise resolve against the *agent's* root,
  so paths are resolved component by component inside the container root.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterable
from dataclasses import replace
from pathlib import PurePosixPath

from llmdiag.model import Backend

__all__ = [
    "KUBE_LABELS",
    "CgroupIdentity",
    "PodMetadataReader",
    "parse_cgroup",
    "parse_environ",
]

log = logging.getLogger(__name__)

#: Every label this module can set, in the order exporters print them.
KUBE_LABELS = ("pod", "namespace", "container", "node", "pod_uid", "container_id")

_UID = r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
# cgroupfs driver: "pod<uid>"; systemd driver: "kubepods-<qos>-pod<uid>.slice" or "kubepods-pod<uid>.slice".
_POD_COMPONENT = re.compile(rf"^(?:kubepods(?:-[a-z]+)?-)?pod(?P<uid>{_UID})(?:\.slice)?$")
# systemd driver: "<runtime>-<id>.scope"; cgroupfs driver: the bare 64-hex id.
_CONTAINER_COMPONENT = re.compile(r"^(?:(?P<prefix>cri-containerd|crio|docker)-)?(?P<id>[0-9a-f]{64})(?:\.scope)?$")
_RUNTIME_SCHEME = {"cri-containerd": "containerd", "crio": "cri-o", "docker": "docker"}
_ENVIRON_CAP = 1 << 20  # bytes; a process environment larger than this is not worth reading whole
_FILE_CAP = 4096  # a namespace or hostname file is a single short line
_SERVICEACCOUNT_NAMESPACE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"
_MAX_SYMLINKS = 40  # as the kernel's MAXSYMLINKS


class CgroupIdentity:
    """What a ``/proc/PID/cgroup`` file says about the pod and container."""

    __slots__ = ("pod_uid", "container_id", "runtime")

    def __init__(self, pod_uid: str | None = None, container_id: str | None = None, runtime: str | None = None) -> None:
        self.pod_uid = pod_uid
        self.container_id = container_id
        self.runtime = runtime

    @property
    def in_pod(self) -> bool:
        return self.pod_uid is not None

    def __repr__(self) -> str:
        return f"CgroupIdentity(pod_uid={self.pod_uid!r}, container_id={self.container_id!r}, runtime={self.runtime!r})"


def parse_cgroup(text: str) -> CgroupIdentity:
    """Pod UID and container id from the content of ``/proc/PID/cgroup`` (v1, v2 or hybrid).

    Lines are ``hierarchy-id:controllers:path``. The first line whose path
    names a pod wins. A path with a pod but no container component (the
    pause sandbox's slice, a process placed by hand) gives the UID alone.
    """
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        identity = _identity_from_path(parts[2])
        if identity.in_pod:
            return identity
    return CgroupIdentity()


def _identity_from_path(path: str) -> CgroupIdentity:
    uid = None
    container_id = runtime = None
    for component in path.split("/"):
        pod = _POD_COMPONENT.match(component)
        if pod:
            uid = pod.group("uid").replace("_", "-")
            continue
        if uid is None:
            continue
        container = _CONTAINER_COMPONENT.match(component)
        if container:
            container_id = container.group("id")
            prefix = container.group("prefix")
            # cgroupfs paths carry no runtime name: the id alone is still the container's.
            runtime = _RUNTIME_SCHEME.get(prefix) if prefix else None
    return CgroupIdentity(uid, container_id, runtime)


def parse_environ(data: bytes) -> dict[str, str]:
    """``/proc/PID/environ`` (``KEY=value`` entries separated by NUL) as a dict; bad entries are skipped."""
    env: dict[str, str] = {}
    for entry in data.split(b"\0"):
        key, sep, value = entry.partition(b"=")
        if not sep or not key:
            continue
        env[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return env


class PodMetadataReader:
    """Kubernetes labels for local processes, read from ``proc_root``.

    ``node_name`` is the agent's own node (the DaemonSet gives it as the
    ``NODE_NAME`` env var from ``spec.nodeName``); ``None`` when unknown.
    Results are cached per pid and process start time, so a pid reused by a
    new process is read again.
    """

    def __init__(self, proc_root: str = "/proc", node_name: str | None = None) -> None:
        self.proc_root = proc_root
        self.node_name = node_name or None
        self._cache: dict[tuple[int, str | None], dict[str, str]] = {}
        self._warned: set[str] = set()

    # -- public --------------------------------------------------------------

    def labels(self, pid: int) -> dict[str, str]:
        """The labels of ``KUBE_LABELS`` that can be read for ``pid`` (possibly none)."""
        key = (pid, self._start_time(pid))
        cached = self._cache.get(key)
        if cached is None:
            cached = self._read_labels(pid)
            if key[1] is not None:  # a vanished process is not cached
                self._cache[key] = cached
        return dict(cached)

    def label_backends(self, backends: Iterable[Backend]) -> list[Backend]:
        """Backends with their Kubernetes labels added; labels set in the config win."""
        out = []
        for backend in backends:
            if backend.pid is None:
                out.append(backend)
                continue
            found = self.labels(backend.pid)
            if not found:
                out.append(backend)
                continue
            merged = {**found, **backend.labels}
            out.append(replace(backend, labels=merged))
        return out

    # -- reading ---------------------------------------------------------------

    def _read_labels(self, pid: int) -> dict[str, str]:
        base = os.path.join(self.proc_root, str(pid))
        cgroup_text = self._read_text(os.path.join(base, "cgroup"), _FILE_CAP * 4)
        identity = parse_cgroup(cgroup_text) if cgroup_text is not None else CgroupIdentity()
        environ = self._read_bytes(os.path.join(base, "environ"), _ENVIRON_CAP)
        env = parse_environ(environ) if environ is not None else {}

        in_kubernetes = identity.in_pod or "KUBERNETES_SERVICE_HOST" in env or "POD_NAME" in env
        if not in_kubernetes:
            return {}

        labels: dict[str, str] = {}
        pod = env.get("POD_NAME")
        if not pod and self._own_uts_namespace(pid):
            pod = env.get("HOSTNAME") or self._read_in_root(pid, "/etc/hostname")
        if pod:
            labels["pod"] = pod
        namespace = env.get("POD_NAMESPACE") or self._read_in_root(pid, _SERVICEACCOUNT_NAMESPACE)
        if namespace:
            labels["namespace"] = namespace
        if env.get("CONTAINER_NAME"):
            labels["container"] = env["CONTAINER_NAME"]
        node = env.get("NODE_NAME") or self.node_name
        if node:
            labels["node"] = node
        pod_uid = env.get("POD_UID") or identity.pod_uid
        if pod_uid:
            labels["pod_uid"] = pod_uid
        if identity.container_id:
            labels["container_id"] = (
                f"{identity.runtime}://{identity.container_id}" if identity.runtime else identity.container_id
            )
        return {k: v.strip() for k, v in labels.items() if v.strip()}

    def _start_time(self, pid: int) -> str | None:
        """Field 22 of /proc/PID/stat (start time in clock ticks): tells a reused pid apart."""
        stat = self._read_text(os.path.join(self.proc_root, str(pid), "stat"), _FILE_CAP)
        if stat is None:
            return None
        end = stat.rfind(")")
        fields = stat[end + 2 :].split() if end >= 0 else []
        return fields[19] if len(fields) > 19 else None

    def _own_uts_namespace(self, pid: int) -> bool:
        """True when ``pid`` has a UTS namespace of its own, i.e. its hostname is the pod's.

        Unknown (unreadable links) counts as not its own: a node hostname must
        never become a pod label.
        """
        try:
            mine = os.readlink(os.path.join(self.proc_root, str(pid), "ns", "uts"))
            hosts = os.readlink(os.path.join(self.proc_root, "1", "ns", "uts"))
        except OSError:
            return False
        return mine != hosts

    def _read_in_root(self, pid: int, path: str) -> str | None:
        """A small file inside the process's root, symlinks resolved inside that root."""
        root = os.path.join(self.proc_root, str(pid), "root")
        resolved = resolve_in_root(root, path)
        if resolved is None:
            return None
        text = self._read_text(resolved, _FILE_CAP)
        if text is None:
            return None
        first = text.strip().splitlines()
        return first[0].strip() if first else None

    def _read_bytes(self, path: str, cap: int) -> bytes | None:
        try:
            with open(path, "rb") as f:
                return f.read(cap)
        except (FileNotFoundError, ProcessLookupError, NotADirectoryError):
            return None
        except OSError as exc:
            # EACCES/EPERM without CAP_SYS_PTRACE: the labels from this file are absent. Say so once.
            cause = f"{type(exc).__name__}:{exc.errno}:{os.path.basename(path)}"
            if cause not in self._warned:
                self._warned.add(cause)
                log.warning("cannot read %s (%s): Kubernetes labels from it are absent", path, exc.strerror or exc)
            return None

    def _read_text(self, path: str, cap: int) -> str | None:
        data = self._read_bytes(path, cap)
        return None if data is None else data.decode("utf-8", "replace")


def resolve_in_root(root: str, path: str) -> str | None:
    """``path`` as seen by a process whose root directory is ``root``, or ``None`` if it does not resolve.

    Walks ``path`` one component at a time under ``root`` (for example
    ``/proc/PID/root``), following symlinks itself: an absolute link target
    restarts from ``root``, and ``..`` never climbs above it, as inside a
    chroot. Gives up after 40 links (the kernel's ``MAXSYMLINKS``).
    """
    pending = list(PurePosixPath(path).parts[1:]) if path.startswith("/") else list(PurePosixPath(path).parts)
    pending.reverse()
    current: list[str] = []
    hops = 0
    while pending:
        part = pending.pop()
        if part in ("", "."):
            continue
        if part == "..":
            if current:
                current.pop()
            continue
        candidate = os.path.join(root, *current, part)
        try:
            target = os.readlink(candidate)
        except OSError:
            # Not a link (EINVAL) or missing: keep walking; a missing path fails at open().
            current.append(part)
            continue
        hops += 1
        if hops > _MAX_SYMLINKS:
            return None
        link_parts = list(PurePosixPath(target).parts)
        if target.startswith("/"):
            current = []
            link_parts = link_parts[1:]
        pending.extend(reversed(link_parts))
    return os.path.join(root, *current)
