"""A network namespace of a test's own, whose one interface is loopback, for tests that start Ray nodes, MLflow or
moto: inside it they are 127.0.0.1 and nothing outside reaches them.

In the host's namespace Ray 2.60 cannot be kept to loopback: a node given ``--node-ip-address 127.0.0.1`` is put on
the host's network address instead (``resolve_ip_for_localhost``, ray-project/ray#26293), and its GCS and raylets
listen on every interface. In a namespace with no route out, Ray finds no address but loopback. Ray then falls back
to resolving the hostname (a container's resolves to its network address), so the namespace's hostname is
``localhost``: a UTS namespace of its own comes with the network one.

Namespaces belong to a thread: the thread that enters one, and every process and thread it starts afterwards, are
inside; the process's other threads (a Ray session's own) stay where they were."""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

CLONE_NEWNET, CLONE_NEWUTS = 0x40000000, 0x04000000
SIOCGIFFLAGS, SIOCSIFFLAGS, SIOCSIFADDR, IFF_UP = 0x8913, 0x8914, 0x8916, 0x1
HOSTNAME = b"localhost"
_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)} (network namespaces need root or CAP_SYS_ADMIN)")


def enter_loopback_namespace(*addresses: str) -> None:
    """Move this thread into new network and UTS namespaces: loopback up, with 127.0.0.0/8 and ``addresses`` (more
    IPv4 addresses of the one interface, for a node that is to look like another machine's), hostname localhost."""
    _check(_libc.unshare(CLONE_NEWNET | CLONE_NEWUTS), "unshare")
    _check(_libc.sethostname(HOSTNAME, len(HOSTNAME)), "sethostname")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        flags = struct.unpack("16sh14x", fcntl.ioctl(s, SIOCGIFFLAGS, struct.pack("16sh14x", b"lo", 0)))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sh14x", b"lo", flags | IFF_UP))
        for i, address in enumerate(addresses):  # an alias lo:N, as `ip addr add ADDRESS dev lo` makes
            request = struct.pack("16sH2x4s8x", f"lo:{i}".encode(), socket.AF_INET, socket.inet_aton(address))
            fcntl.ioctl(s, SIOCSIFADDR, request)


@contextmanager
def loopback_namespace(*addresses: str) -> Iterator[None]:
    """This thread in a namespace of :func:`enter_loopback_namespace` for the block, then back in its own; the test
    is skipped where namespaces cannot be made."""
    saved = {flag: os.open(f"/proc/thread-self/ns/{kind}", os.O_RDONLY) for flag, kind in
             ((CLONE_NEWNET, "net"), (CLONE_NEWUTS, "uts"))}  # fmt: skip
    try:
        try:
            enter_loopback_namespace(*addresses)
        except OSError as error:
            pytest.skip(str(error))
        yield
    finally:
        for flag, fd in saved.items():
            _check(_libc.setns(fd, flag), "setns")
            os.close(fd)
