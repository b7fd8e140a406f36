"""The background loop: one thread that steps an engine's batch whenever a request is queued, until stopped.

It knows the engine only through what it is given: the engine's lock, whether work is queued, one step
(which ends the requests an error concerns), and what to do when the loop ends.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class BackgroundLoop:
    def __init__(
        self,
        lock: threading.RLock,
        has_work: Callable[[], bool],
        step: Callable[[], None],
        on_exit: Callable[[], None],
    ):
        self.has_work, self.step, self.on_exit = has_work, step, on_exit
        self.work = threading.Condition(lock)
        self.running = False
        self._stopping = False
        self._thread: threading.Thread | None = None

    def notify(self) -> None:
        """A request was queued (call under the lock)."""
        self.work.notify_all()

    def start(self) -> None:
        with self.work:
            if self._thread is None:
                self.running, self._stopping = True, False
                self._thread = threading.Thread(target=self.run, name="astrai-engine", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        """Stop after the current step; returns once the thread has ended."""
        with self.work:
            thread, self._stopping = self._thread, True
            self.work.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def run(self) -> None:
        """Step while work is queued, wait while none is, return on `stop()`."""
        with self.work:
            self.running = True
        try:
            while True:
                with self.work:
                    while not self._stopping and not self.has_work():
                        self.work.wait()
                    if self._stopping:
                        return
                    self.step()
                time.sleep(0)  # let threads waiting for the lock (submit, abort) take it between steps
        finally:
            with self.work:
                self.running, self._stopping, self._thread = False, False, None
                self.on_exit()
