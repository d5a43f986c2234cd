"""Signals stop a sweep cleanly: its trials save their state, its MLflow server stops, ``--resume`` goes on."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any


@dataclass
class Interruption:
    """Whether a signal has stopped the sweep, and whether Tune's fit runs (Tune's own stop then saves the trials)."""

    signalled: bool = False
    tuning: bool = False


@contextmanager
def signals_stop_the_sweep() -> Iterator[Interruption]:
    """SIGINT, SIGTERM and SIGHUP stop the sweep as Ctrl-C stops Tune: the first one ends the running trials with
    their state saved (Tune's own stop, reached through its SIGUSR1 handler), a second one stops at once. Outside Tune
    (Ray or the server starting) the first one raises KeyboardInterrupt, so the server is still stopped."""
    state, previous = Interruption(), {}

    def handler(signum: int, frame: Any) -> None:
        if state.signalled or not state.tuning:
            state.signalled = True
            raise KeyboardInterrupt(f"stopped by signal {signal.Signals(signum).name}")
        state.signalled = True
        print("\nstopping the sweep: running trials save their state (a second Ctrl-C stops at once)", file=sys.stderr)
        os.kill(os.getpid(), signal.SIGUSR1)  # Tune's graceful stop, which also answers SIGINT when it owns it

    if threading.current_thread() is not threading.main_thread():  # only the main thread may handle signals
        yield state
        return
    os.environ["TUNE_DISABLE_SIGINT_HANDLER"] = "1"  # ours is the one handler: Tune's own would hide the signal from us
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        previous[signum] = signal.signal(signum, handler)
    try:
        yield state
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
