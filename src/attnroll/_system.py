"""What the pure maths of ``core/`` must not do itself: talk to the terminal and ask the machine how much
memory is free. :func:`attention_flow` is the public ``attnroll.attention_flow``: the pure
:func:`attnroll.core.flow.attention_flow` with a progress bar on request and the machine's available memory
for its memory check."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from .core.flow import attention_flow as _pure_attention_flow

__all__ = ["ProgressBar", "available_memory", "attention_flow"]


class ProgressBar:
    """A progress bar on stderr: tqdm or rich when installed, else a plain line rewritten in place.
    ``bar(k)`` advances it by k of ``total``; ``close()`` ends it. Disabled, it does nothing."""

    def __init__(self, total: float, enabled: bool, desc: str = "attention flow", unit: str = "max flows") -> None:
        self.total, self.done, self.enabled, self.desc, self.unit = total, 0, enabled, desc, unit
        self._bar = None
        self._last = 0.0
        self._start = time.perf_counter()
        if not enabled:
            return
        try:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit=unit, file=sys.stderr)
            self._kind = "tqdm"
        except ImportError:
            try:
                from rich.console import Console
                from rich.progress import Progress

                self._bar = Progress(transient=False, console=Console(stderr=True))
                self._bar.start()
                self._task = self._bar.add_task(desc, total=total)
                self._kind = "rich"
            except ImportError:
                self._kind = "plain"

    def __call__(self, k: float) -> None:
        if not self.enabled:
            return
        self.done += k
        if self._kind == "tqdm":
            self._bar.update(k)
        elif self._kind == "rich":
            self._bar.update(self._task, advance=k)
        else:
            self._plain()

    def describe(self, desc: str) -> None:
        """Change the text in front of the bar (what is being done now)."""
        self.desc = desc
        if not self.enabled:
            return
        if self._kind == "tqdm":
            self._bar.set_description(desc)
        elif self._kind == "rich":
            self._bar.update(self._task, description=desc)
        else:
            self._plain(force=True)

    def _plain(self, force: bool = False) -> None:
        """The bar as one line rewritten in place: done/total, elapsed and (once started) the time left."""
        now = time.perf_counter()
        if not (force or now - self._last > 0.2 or self.done >= self.total):
            return
        self._last = now
        width, spent = 30, now - self._start
        filled = int(width * min(self.done / max(self.total, 1), 1.0))
        left = f", ~{spent * (self.total - self.done) / self.done:.0f}s left" if 0 < self.done < self.total else ""
        done = f"{self.done:g}" if isinstance(self.done, int) else f"{self.done:.1f}"
        sys.stderr.write(f"\r{self.desc} [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total:g} "
                         f"{self.unit}, {spent:.1f}s{left}")
        sys.stderr.flush()

    def close(self) -> None:
        if not self.enabled:
            return
        if self._kind == "tqdm":
            self._bar.close()
        elif self._kind == "rich":
            self._bar.stop()
        else:
            sys.stderr.write("\n")
            sys.stderr.flush()


def available_memory() -> int | None:
    """Bytes of memory available now (Linux /proc/meminfo, else sysconf), or None if unknown."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def attention_flow(attentions: Any, *, progress: bool = False, **options: Any) -> Any:
    """Attention flow, exactly :func:`attnroll.core.flow.attention_flow` (every option, shapes and
    errors there), plus ``progress``: True prints a progress bar on stderr (tqdm or rich if installed, else
    plain text). Refuses, with a MemoryError giving the estimate, a graph that would not fit in the memory
    available now."""
    from . import _checks

    progress = _checks.check_bool("progress", progress)
    bar: list[ProgressBar] = []

    def tick(k: int, total: int) -> None:
        if not bar:
            bar.append(ProgressBar(total, True))
        bar[0](k)

    try:
        return _pure_attention_flow(attentions, progress=tick if progress else None,
                                    available_memory=available_memory(), **options)
    finally:
        if bar:
            bar[0].close()
