"""Running one Ray task per case with a progress bar, handing results back in a fixed order."""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import ray
from tqdm import tqdm


def ordered_results(
    submit: Callable[[Any], ray.ObjectRef], items: Iterable[Any], total: int, desc: str
) -> Iterator[Any]:
    """Submit ``items`` as Ray tasks and yield their results in submission order, so files written from them never
    depend on scheduling. About two tasks per CPU stay in flight: every core busy, and few finished results waiting
    for a slow predecessor in memory."""
    window = max(2, 2 * int(ray.available_resources().get("CPU", 1)))
    pending: deque[ray.ObjectRef] = deque()
    items = iter(items)
    with tqdm(total=total, desc=desc, unit="case", file=sys.stderr, mininterval=1.0, smoothing=0.1) as bar:
        while True:
            while len(pending) < window and (item := next(items, None)) is not None:
                pending.append(submit(item))
            if not pending:
                return
            result = ray.get(pending.popleft())
            bar.update(1)
            yield result
