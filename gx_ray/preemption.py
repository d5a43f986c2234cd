"""Spot preemption: a node told to go (SIGTERM) drains, its trials checkpoint at their next optimiser step and go on
from there on another node.

Two halves, joined by Ray's own drain state (the GCS's, which the autoscaler and ``ray drain-node`` set):

- **the node's watcher** (``python -m gx_ray.preemption ray start --block ...``) runs the node; on SIGTERM it drains
  it with reason *preemption* and a deadline (``--grace``): Ray places no new work there and the raylet exits once
  its last task ends; the watcher waits for that or the deadline, then stops the node. Where KubeRay starts the
  node, ``python -m gx_ray.preemption --here`` (the pods' ``preStop`` hook) drains the host's node the same way.
- **the trial** (:class:`DrainWatch`, polled by the loop between optimiser steps) sees its node draining, reports a
  checkpoint of where it is within the epoch and raises :class:`NodePreempted`; Tune restarts it (not one of its
  ``max_failures``) from that checkpoint on another node, and the loop skips the batches already trained on.

The bound: a trial stops within one poll (:data:`POLL_S`) plus the optimiser step under way plus the checkpoint's
write, and loses no optimiser step (the steps of the interrupted epoch are in the checkpoint).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import ray
from ray.exceptions import RayActorError

from gx_ray.compat import drain_node, draining_nodes

POLL_S = 1.0
"""How often a trial asks the GCS whether its node is draining (one small request)."""
DEFAULT_GRACE_S = 90
"""How long a node told to go keeps running for its trials: spot notices give 30 s (GCP) to 2 minutes (AWS)."""


class NodePreempted(RayActorError):
    """The trial's node is draining for preemption: it has checkpointed, and Tune goes on from there elsewhere.

    A ``RayActorError`` marked preempted, as Ray marks an actor lost with a preempted node: Tune counts such an error
    against no trial's ``max_failures`` (``RAY_TRAIN_COUNT_PREEMPTION_AS_FAILURE``)."""

    def __init__(self, message: str = "the trial's node is draining for preemption"):
        super().__init__(None, message, False, True)

    def __reduce__(self):  # raised in the trial's process, read in the driver's
        return (NodePreempted, (self.error_msg,))


class DrainWatch:
    """Whether this process's Ray node is draining, polled by a daemon thread every :data:`POLL_S` seconds."""

    def __init__(self, interval_s: float = POLL_S):
        self.node_id = ray.get_runtime_context().get_node_id()
        self.interval_s = interval_s
        self.deadline_ms: int | None = None
        self._draining, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._poll, name="gx-drain-watch", daemon=True)

    def start(self) -> DrainWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    def _poll(self) -> None:
        while not self._stop.wait(self.interval_s):
            with contextlib.suppress(Exception):  # a GCS hiccup: asked again at the next poll
                drained = draining_nodes()  # Ray's own drain state
                if self.node_id in drained:
                    self.deadline_ms = drained[self.node_id] or None
                    self._draining.set()
                    return


def _raylets(processes: list[psutil.Process]) -> list[tuple[str, str, psutil.Process]]:
    """The node id and GCS address of each raylet among ``processes``, read from its command line (several nodes of
    one host are told apart by it)."""
    found = []
    for process in processes:
        with contextlib.suppress(psutil.Error):
            if process.name() == "raylet":
                flags = dict(a[2:].split("=", 1) for a in process.cmdline() if a.startswith("--") and "=" in a)
                if "node_id" in flags and "gcs-address" in flags:
                    found.append((flags["node_id"], flags["gcs-address"], process))
    return found


def _node_id(command: subprocess.Popen) -> tuple[str, str] | None:
    """The node id and GCS address of the node ``command`` (``ray start --block``) started; None until it is up."""
    with contextlib.suppress(psutil.Error):
        for node_id, gcs, _ in _raylets(psutil.Process(command.pid).children(recursive=True)):
            return node_id, gcs
    return None


def drain_here(grace_s: float) -> int:
    """Drain the one Ray node of this host (a Kubernetes pod's ``preStop``) and wait, at most ``grace_s``, for its
    raylet to exit: it does once its trials have checkpointed and left."""
    raylets = _raylets(list(psutil.process_iter()))
    if len(raylets) != 1:
        print(f"gx-ray watcher: {len(raylets)} Ray nodes on this host, not one: nothing drained", file=sys.stderr)
        return 1
    node_id, gcs, raylet = raylets[0]
    if not drain(node_id, gcs, grace_s, "the node is being preempted"):
        return 1
    with contextlib.suppress(psutil.TimeoutExpired):
        raylet.wait(timeout=grace_s)
    return 0


def drain(node_id: str, gcs_address: str, grace_s: float, message: str) -> bool:
    """Drain the node for preemption with a deadline ``grace_s`` from now (what ``ray drain-node`` does)."""
    accepted, rejected = drain_node(node_id, gcs_address, int((time.time() + grace_s) * 1000), message)
    if not accepted:
        print(f"gx-ray watcher: the drain of node {node_id} was refused: {rejected}", file=sys.stderr, flush=True)
    return accepted


def watch(command: list[str], grace_s: float) -> int:
    """Run ``command`` (the node); on SIGTERM drain it, wait for it to end (at most ``grace_s``), then stop it."""
    told = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: told.set())
    signal.signal(signal.SIGINT, lambda *_: told.set())
    node = subprocess.Popen(command, start_new_session=True)  # a signal to the watcher's group is the watcher's
    while node.poll() is None and not told.wait(0.5):
        pass
    if node.poll() is not None:
        return node.returncode
    started = time.monotonic()
    ids = _node_id(node)
    if ids and drain(*ids, grace_s, "SIGTERM: the instance is being preempted"):
        print(f"gx-ray watcher: node {ids[0]} draining; its trials checkpoint and move", file=sys.stderr, flush=True)
        while node.poll() is None and time.monotonic() - started < grace_s:  # the raylet exits once idle
            time.sleep(0.5)
    if node.poll() is None:
        node.terminate()  # `ray start --block` stops the node's processes on SIGTERM
        try:
            node.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.pid, signal.SIGKILL)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Run a Ray worker node (ray start --block ...); on SIGTERM drain it for preemption, so that its "
        "trials checkpoint and move, then stop it.",
        usage="python -m gx_ray.preemption [--grace S] ray start --block --address=HEAD:6379 ...\n"
        "       python -m gx_ray.preemption --here [--grace S]",
    )
    parser.add_argument("--grace", type=float, default=DEFAULT_GRACE_S, help="seconds the node may keep running")
    parser.add_argument(
        "--here", action="store_true", help="drain the Ray node running on this host now and wait (a preStop hook)"
    )
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the node's command: ray start --block ...")
    args = parser.parse_args(argv)
    if args.here:
        return drain_here(args.grace)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command or "--block" not in args.command:
        parser.error("give the node's command, with --block (the watcher runs the node): ray start --block ...")
    return watch(args.command, args.grace)


if __name__ == "__main__":
    sys.exit(main())
