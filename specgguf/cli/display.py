"""Live generation statistics on stderr, and the one-line summary.

stdout carries the generated text only; this module writes to stderr through an explicit
``Console(stderr=True)``. The live panel (Rich ``Live``, ``redirect_stdout=False`` so it never
captures the text) is shown only when stderr is a terminal that stdout does not share: when
both are the same terminal, redrawing a panel would tear the streamed text, so only the
summary line is printed at the end. ``NO_COLOR`` is honoured by Rich.
"""

from __future__ import annotations

import collections
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from specgguf.speculative.loop import Generation, GenerationResult, GenerationStats


def _same_terminal(a: IO[Any], b: IO[Any]) -> bool:
    try:
        sa, sb = os.fstat(a.fileno()), os.fstat(b.fileno())
    except (OSError, ValueError, AttributeError):
        return False
    return (sa.st_dev, sa.st_ino, sa.st_rdev) == (sb.st_dev, sb.st_ino, sb.st_rdev)


def live_allowed(stdout: IO[Any] | None = None, stderr: IO[Any] | None = None) -> bool:
    """True when a live panel on stderr will not collide with text on stdout."""
    stdout = stdout or sys.stdout
    stderr = stderr or sys.stderr
    return stderr.isatty() and not (stdout.isatty() and _same_terminal(stdout, stderr))


#: A forced configuration slower than this share of the target alone's rate is reported,
#: once it has generated at least ``LOSS_MIN_TOKENS`` (shorter runs are too noisy to tell).
LOSS_MARGIN = 0.8
LOSS_MIN_TOKENS = 16


def speculation_lost(stats: GenerationStats, target_alone: float | None) -> bool:
    """Whether a run was clearly slower (``LOSS_MARGIN``) than the target alone would be
    (``target_alone``: tokens/s, see :meth:`specgguf.engine.Engine.target_alone_rate`)."""
    if not target_alone or stats.generated < LOSS_MIN_TOKENS:
        return False
    return stats.tokens_per_s < LOSS_MARGIN * target_alone


def loss_line(stats: GenerationStats, target_alone: float) -> str:
    """What to tell a user whose forced configuration lost to the target alone."""
    return (
        f"specgguf: speculation made this run slower: {stats.tokens_per_s:.1f} tokens/s "
        f"against about {target_alone:.1f} tokens/s for the target alone here "
        f"(acceptance {stats.acceptance_rate:.0%}); --drafter auto speculates only where it pays"
    )


def gain_line(stats: GenerationStats, target_alone: float) -> str:
    """The run's rate against the target alone's here (``target_alone`` tokens/s: the pair's
    calibration, see :meth:`specgguf.engine.Engine.target_alone_rate`), e.g.
    ``specgguf: 1.21x the target alone here (about 11.9 tokens/s, from the pair's
    calibration)``."""
    return (
        f"specgguf: {stats.tokens_per_s / target_alone:.2f}x the target alone here "
        f"(about {target_alone:.1f} tokens/s, from the pair's calibration)"
    )


def summary_line(stats: GenerationStats, finish_reason: str | None = None) -> str:
    """One line with everything that matters, e.g. ``128 tokens in 10.3 s, 12.4 tokens/s;
    acceptance 78% (90/115), 3.27 per step, K=4; target 5.7 s, draft 4.8 s, other 0.1 s``."""
    s = stats
    parts = [
        f"{s.generated} tokens in {s.seconds:.2f} s, {s.tokens_per_s:.2f} tokens/s",
        (
            f"acceptance {s.acceptance_rate:.0%} ({s.accepted}/{s.drafted}), "
            f"{s.mean_accepted:.2f} accepted per step over {s.steps} steps"
            if s.drafted
            else f"no drafts ({s.steps} steps)"
        ),
        f"target {s.target_seconds:.2f} s, draft {s.draft_seconds:.2f} s, "
        f"other {s.python_seconds:.2f} s",
        f"prompt {s.prompt_tokens} tokens in {s.prompt_seconds:.2f} s"
        + (f" ({s.prompt_cached} reused from the cache)" if s.prompt_cached else ""),
    ]
    if s.constrained:
        forced = s.by_drafter.get("grammar")
        n = forced.drafted if forced else 0
        parts.insert(2, f"grammar: {n} token{'s' if n != 1 else ''} forced, "
                        f"{s.grammar_cut} draft token{'s' if s.grammar_cut != 1 else ''} "
                        "cut")  # fmt: skip
    if finish_reason:
        parts.append(f"finish: {finish_reason}")
    return "; ".join(parts)


class LiveStats:
    """The live panel: tokens/s (rolling over the last ``window`` seconds, and overall),
    acceptance rate, mean accepted per step, current draft length, elapsed time, and the
    target/draft/other time split. A no-op when ``enabled`` is False."""

    def __init__(
        self,
        stats: GenerationStats,
        *,
        enabled: bool,
        window: float = 3.0,
        target_alone: float | None = None,
    ) -> None:
        self.stats = stats
        self.enabled = enabled
        self.target_alone = target_alone
        self.window = window
        self._samples: collections.deque[tuple[float, int]] = collections.deque()
        self._t0 = time.perf_counter()
        self._live: Any = None

    def __enter__(self) -> LiveStats:
        if self.enabled:
            from rich.console import Console
            from rich.live import Live

            console = Console(stderr=True)
            self._live = Live(
                self._render(),
                console=console,
                refresh_per_second=4,
                transient=True,
                redirect_stdout=False,
                redirect_stderr=False,
                get_renderable=self._render,
            )
            self._live.__enter__()
        return self

    def update(self) -> None:
        """Record a sample (call after each step); the panel refreshes on its own."""
        if self.enabled:
            now = time.perf_counter()
            self._samples.append((now, self.stats.generated))
            while self._samples and now - self._samples[0][0] > self.window:
                self._samples.popleft()

    def rolling_tokens_per_s(self) -> float:
        if len(self._samples) < 2:
            return self.stats.tokens_per_s
        (t0, n0), (t1, n1) = self._samples[0], self._samples[-1]
        return (n1 - n0) / (t1 - t0) if t1 > t0 else self.stats.tokens_per_s

    def _render(self) -> Any:
        from rich.table import Table

        s = self.stats
        t = Table.grid(padding=(0, 2))
        for _ in range(6):
            t.add_column()
        total = max(s.seconds, 1e-9)
        t.add_row(
            f"[bold]{self.rolling_tokens_per_s():6.2f}[/] tokens/s (now)",
            f"{s.tokens_per_s:6.2f} tokens/s (overall)",
            f"acceptance {s.acceptance_rate:4.0%}",
            f"{s.mean_accepted:4.2f} accepted/step",
            f"K={s.last_draft}",
            f"{time.perf_counter() - self._t0:5.1f} s",
        )
        t.add_row(
            f"{s.generated} tokens",
            f"{s.steps} steps",
            f"target {s.target_seconds / total:4.0%}",
            f"draft {s.draft_seconds / total:4.0%}",
            f"other {s.python_seconds / total:4.0%}",
            f"target alone ~{self.target_alone:.1f} tokens/s" if self.target_alone else "",
        )
        if speculation_lost(s, self.target_alone):
            t.add_row("[bold red]slower than the target alone[/]", "try --drafter auto", "", "",
                      "", "")  # fmt: skip
        return t

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._live is not None:
            self._live.__exit__(exc_type, exc, tb)
            self._live = None


def stream(
    gen: Generation, *, write: bool, live: bool, target_alone: float | None = None
) -> tuple[GenerationResult, bool]:
    """Run ``gen`` to its end: each piece of text to stdout as it comes (when ``write``),
    the live panel on stderr (when ``live``; it compares with ``target_alone`` tokens/s
    when given). Ctrl-C stops the generation and keeps what was committed. Returns the
    result and whether it was interrupted."""
    panel = LiveStats(gen.stats, enabled=live, target_alone=target_alone)
    try:
        with panel:
            for piece in gen:
                if write:
                    sys.stdout.write(piece)
                    sys.stdout.flush()
                panel.update()
    except KeyboardInterrupt:
        return gen.interrupt(), True
    assert gen.result is not None
    return gen.result, False


#: Models at least this large (bytes, all shards) report their loading on stderr.
LOAD_REPORT_BYTES = 1 << 30

#: When stderr is not a terminal, a load still running reports a line this often (seconds).
LOAD_REPORT_EVERY = 10.0


class LoadProgress:
    """Loading progress on stderr, for models of at least ``LOAD_REPORT_BYTES``, so that a
    40 GB target does not look hung: on a terminal a Rich bar per model (llama.cpp's
    progress callback, through :class:`specgguf.engine.Engine`'s ``on_load_progress``),
    otherwise one line per model when it has loaded ("specgguf: loaded X (1.04 GiB) in
    2.31 s"), and one every ``LOAD_REPORT_EVERY`` seconds of ``clock`` while it loads
    ("specgguf: loading X (40.00 GiB): 35%, 20 s"). Nothing with ``quiet``. Use as a
    context manager around loading; the instance is the callback."""

    def __init__(
        self,
        sizes: dict[Path, int],
        *,
        quiet: bool = False,
        live: bool | None = None,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.sizes = sizes
        self.quiet = quiet
        self.live = sys.stderr.isatty() if live is None else live
        self.clock = clock
        self._progress: Any = None
        self._tasks: dict[Path, Any] = {}
        self._started: dict[Path, float] = {}
        self._reported: dict[Path, float] = {}
        self._done: set[Path] = set()

    def _size(self, path: Path) -> int:
        if path not in self.sizes:
            try:
                self.sizes[path] = path.stat().st_size
            except OSError:
                self.sizes[path] = 0
        return self.sizes[path]

    def __enter__(self) -> LoadProgress:
        return self

    def __call__(self, path: Path, share: float) -> None:
        size = self._size(path)
        if self.quiet or size < LOAD_REPORT_BYTES or path in self._done:
            return
        now = self.clock()
        self._started.setdefault(path, now)
        if self.live:
            self._draw(path, share, size)
        if share >= 1.0:
            self._done.add(path)
            if not self.live:
                seconds = now - self._started[path]
                print(f"specgguf: loaded {path.name} ({size / 2**30:.2f} GiB) in {seconds:.2f} s",
                      file=sys.stderr, flush=True)  # fmt: skip
        elif not self.live and now - self._reported.get(path, self._started[path]) >= (
            LOAD_REPORT_EVERY
        ):
            self._reported[path] = now
            print(f"specgguf: loading {path.name} ({size / 2**30:.2f} GiB): {share:.0%}, "
                  f"{now - self._started[path]:.0f} s", file=sys.stderr, flush=True)  # fmt: skip

    def _draw(self, path: Path, share: float, size: int) -> None:
        if self._progress is None:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeElapsedColumn,
            )

            self._progress = Progress(
                TextColumn("loading {task.description}"), BarColumn(),
                DownloadColumn(binary_units=True), TimeElapsedColumn(),
                console=Console(stderr=True), transient=False,
            )  # fmt: skip
            self._progress.start()
        if path not in self._tasks:
            self._tasks[path] = self._progress.add_task(path.name, total=size)
        self._progress.update(self._tasks[path], completed=min(1.0, share) * size)

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
