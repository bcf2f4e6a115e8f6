"""The weight load's progress for whoever watches a starting server: a bar on a terminal, lines in a journal.

    progress = LoadProgress("tandem serve")
    engine = Engine.start(model_dir, ..., on_load_progress=progress)
    progress.close()

Engine.start calls it with the bytes the ranks have loaded and their total (summed over the ranks).
On a terminal (stderr a TTY) that drives one tqdm bar; elsewhere (systemd's journal, a pipe) it
prints a line at each tenth of the load and at its end, with the rate so far:

    tandem serve: loading weights 30% (16.1 of 53.8 GiB, 2.4 GiB/s)

Loads under MIN_BYTES show nothing. `snapshot()` gives the latest numbers to /health while the model
loads.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import TextIO


MIN_BYTES = 256 * 2**20        # smaller loads (the demo model, test checkpoints) show nothing


class LoadProgress:
    def __init__(self, prog: str, stream: TextIO | None = None, bar: bool | None = None,
                 min_bytes: int = MIN_BYTES):
        self.prog, self.min_bytes = prog, min_bytes
        self.stream = stream if stream is not None else sys.stderr
        if bar is None:
            isatty = getattr(self.stream, "isatty", None)
            bar = bool(isatty and isatty())
        self._tqdm = None
        if bar:
            try:
                import tqdm
                self._tqdm = tqdm.tqdm
            except ImportError:
                pass
        self._bar = None
        self._lock = threading.Lock()
        self._t0: float | None = None
        self._tenth = -1
        self.done = self.total = 0
        self.closed = False

    def __call__(self, done: int, total: int) -> None:
        with self._lock:
            if self.closed:
                return
            if self._t0 is None:
                self._t0 = time.monotonic()
            self.done, self.total = int(done), max(int(total), int(done))
            if self.total < self.min_bytes:
                return
            if self._tqdm is not None:
                if self._bar is None:
                    self._bar = self._tqdm(total=self.total, unit="B", unit_scale=True, unit_divisor=1024,
                                           desc=f"{self.prog}: loading weights", file=self.stream, leave=True)
                if self._bar.total != self.total:
                    self._bar.total = self.total
                self._bar.update(self.done - self._bar.n)
                if self.done >= self.total:
                    self._close_bar()
                    self.closed = True
                return
            tenth = 10 * self.done // self.total if self.total else 0
            if tenth > self._tenth:
                self._tenth = tenth
                self.stream.write(f"{self.prog}: {self.line()}\n")
                self.stream.flush()

    def line(self) -> str:
        """"loading weights 30% (16.1 of 53.8 GiB, 2.4 GiB/s)" for the latest numbers."""
        dt = time.monotonic() - self._t0 if self._t0 is not None else 0.0
        rate = f", {self.done / 2**30 / dt:.1f} GiB/s" if dt > 0.05 else ""
        pct = 100 * self.done // self.total if self.total else 0
        return f"loading weights {pct}% ({self.done / 2**30:.1f} of {self.total / 2**30:.1f} GiB{rate})"

    def snapshot(self) -> dict | None:
        """{"done_bytes", "total_bytes"} once a rank has reported, else None."""
        with self._lock:
            if not self.total:
                return None
            return {"done_bytes": self.done, "total_bytes": self.total}

    def close(self) -> None:
        """End the display (the bar stays on screen where the load got to)."""
        with self._lock:
            self.closed = True
            self._close_bar()

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
