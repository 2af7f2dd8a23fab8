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

    def __init__(self, total: int, enabled: bool, desc: str = "attention flow") -> None:
        self.total, self.done, self.enabled, self.desc = total, 0, enabled, desc
        self._bar = None
        self._last = 0.0
        self._start = time.perf_counter()
        if not enabled:
            return
        try:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="flow", file=sys.stderr)
            self._kind = "tqdm"
        except ImportError:
            try:
                from rich.progress import Progress

                self._bar = Progress(transient=False)
                self._bar.start()
                self._task = self._bar.add_task(desc, total=total)
                self._kind = "rich"
            except ImportError:
                self._kind = "plain"

    def __call__(self, k: int) -> None:
        if not self.enabled:
            return
        self.done += k
        if self._kind == "tqdm":
            self._bar.update(k)
        elif self._kind == "rich":
            self._bar.update(self._task, advance=k)
        else:
            now = time.perf_counter()
            if now - self._last > 0.2 or self.done >= self.total:
                self._last = now
                width = 30
                filled = int(width * self.done / max(self.total, 1))
                sys.stderr.write(
                    f"\r{self.desc} [{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} "
                    f"max flows, {now - self._start:.1f}s"
                )
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
