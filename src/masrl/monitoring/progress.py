"""Progress of a long stage (SFT, RL steps, an evaluation): a rich bar with ETA on a terminal, else lines."""
from __future__ import annotations

import time


class Progress:
    """A rich progress bar with ETA when interactive; otherwise a line every 5% of the total (at most one a second).

    The ETA is linear in the items done since this bar started (a resumed run's earlier steps do not count),
    unless ``expected_s`` is given: then it is what is left of that duration (an evaluation's episodes finish
    together in its workflow's last round, so a linear ETA would say "almost done" long before it is; the
    team runner passes the duration of the previous evaluation of the same benchmark, and none the first time).
    """

    def __init__(self, enabled: bool, label: str, total: int, completed: int = 0, *,
                 expected_s: float | None = None):
        self.enabled, self.label, self.total, self.done = enabled, label, total, completed
        self.completed_before, self.expected_s = completed, expected_s
        self.linear = not label.startswith("eval")
        self.start = time.perf_counter()
        self._printed = -float("inf")
        self._bar = None
        if enabled:
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            console = Console(stderr=True)
            if console.is_terminal:
                self._bar = Progress(TextColumn(f"[bold]{label}"), BarColumn(), MofNCompleteColumn(),
                                     TimeRemainingColumn(), TextColumn("{task.description}"), console=console)
                self._task = self._bar.add_task("", total=total, completed=completed)
                self._bar.start()

    def advance(self, text: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, advance=1, description=text)
            return
        every = max(1, self.total // 20)
        now = time.perf_counter()
        # episodes of an evaluation finish in bursts (one per workflow round): at most one line a second
        if (self.done % every == 0 and now - self._printed >= 1.0) or self.done == self.total:
            self._printed = now
            eta = self.eta(now)
            when = f"eta {eta:5.0f}s" if eta is not None else f"{now - self.start:5.0f}s"
            print(f"[{self.label} {self.done}/{self.total} {when}] {text}", flush=True)

    def set_total(self, total: int) -> None:
        """A new expected total (work whose end is estimated as it goes)."""
        self.total = total
        if self._bar is not None:
            self._bar.update(self._task, total=total)

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def eta(self, now: float) -> float | None:
        """Seconds left (None when there is nothing to base it on)."""
        elapsed = now - self.start
        if self.done >= self.total:
            return 0.0
        if self.expected_s is not None:
            return max(self.expected_s - elapsed, 0.0)
        since = self.done - self.completed_before
        if not self.linear or since <= 0:
            return None
        return elapsed / since * (self.total - self.done)

    def note(self, text: str) -> None:
        """Show that work goes on between advances (at most one line every 10 s when not a terminal)."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(self._task, description=text)
            return
        now = time.perf_counter()
        if now - self._printed >= 10.0:
            self._printed = now
            print(f"[{self.label} {self.done}/{self.total} {now - self.start:5.0f}s] {text}", flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
