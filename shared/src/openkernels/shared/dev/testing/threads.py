"""Run one function in several threads at once (concurrency tests)."""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["run_in_threads"]


def run_in_threads(fn: Callable[[], None], threads: int, timeout: float = 60.0) -> list[BaseException]:
    """Start `threads` threads that each wait for all the others, then call fn(); return
    what they raised (an empty list when none did)."""
    start = threading.Barrier(threads, timeout=timeout)
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            start.wait()
            fn()
        except BaseException as error:
            errors.append(error)
            start.abort()

    pool = [threading.Thread(target=worker) for _ in range(threads)]
    for thread in pool:
        thread.start()
    for thread in pool:
        thread.join()
    return errors
