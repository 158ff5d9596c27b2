"""The engine boundary of the server: requests become :class:`Job` objects that one worker
thread runs on the engine, in arrival order, from a bounded queue: one at a time, or with
``--parallel N`` up to N at once, their evaluations batched.

The HTTP side (asyncio) never touches llama.cpp. It submits a job and reads its events
(text pieces, then the result or an error) from an :class:`asyncio.Queue` that the worker
feeds through ``loop.call_soon_threadsafe``; llama.cpp's calls release the GIL, so the
event loop keeps serving other requests (``/health``, ``/metrics``, queueing, 503s) while
a generation runs. :meth:`Job.cancel` (a client went away) ends a waiting job at once and
a running one before its next speculative step (:meth:`Generation.cancel`).

With several sequences (an engine loaded with ``n_parallel``), the worker takes a waiting
job as soon as a sequence is free and runs every running job as a task of the engine's
:class:`~specgguf.engine.batching.Batcher`: each step of the batcher decodes one batch
holding every running job's verification (and pieces of new prompts), and a finished or
cancelled job frees its sequence for the next waiting one at once. Each job emits its own
events as with one sequence.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import functools
import logging
import math
import threading
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from time import monotonic, sleep
from typing import TYPE_CHECKING, Literal

from specgguf.speculative.loop import Generation, GenerationParams, GenerationResult

if TYPE_CHECKING:
    from specgguf.engine import Engine
    from specgguf.llama.backend import MediaSpan

log = logging.getLogger("specgguf.server")


def engine_thread() -> ThreadPoolExecutor:
    """The one thread that should make every llama.cpp call of a server: loading,
    calibration and the scheduler's worker (:class:`Scheduler` ``executor``).

    Why one: a CPU build of llama.cpp with OpenMP gives each OS thread that computes its
    own OpenMP thread pool, and libgomp, once it manages more threads than there are CPUs,
    cuts its spin-waiting between parallel regions from about 300,000 spins to 100
    (``gomp_throttled_spin_count_var``, libgomp/env.c): every barrier then sleeps and
    wakes. Measured on the 2-core development machine (Qwen2.5-Coder 1.5B Q4_K_M, 128
    tokens, target alone): 33.6 tokens/s from the thread that computed first, 25.9 tokens/s
    from a second thread once the first had computed (scripts/bench-server: the server in
    auto mode at 0.72-0.88x of ``specgguf run`` while calibration ran on the main thread).
    """
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="specgguf-engine")


#: Seconds between two text events of a streamed response at least (see :class:`Scheduler`).
#: Every event wakes the event loop, which then formats and sends a chunk while llama.cpp
#: computes: on 2 cores that time is taken from one of its two threads, which holds up
#: both at their next barrier.
STREAM_INTERVAL = 0.05


class QueueFull(Exception):
    """The queue holds ``max_queue`` waiting jobs already."""


class ShuttingDown(Exception):
    """The scheduler was closed: it takes no new jobs, and ended the waiting ones."""


@dataclasses.dataclass(frozen=True)
class Event:
    """What a job reports: a text ``piece``; at the end either ``done`` (with ``result``)
    or ``error`` (with ``error``). A job that was cancelled before it started ends with
    ``done`` and no result."""

    kind: Literal["piece", "done", "error"]
    text: str = ""
    result: GenerationResult | None = None
    error: BaseException | None = None


class Job:
    """One request's generation: token ids and parameters in, events out.

    Create it on the event loop that will read its events (:meth:`events`). ``cancel`` may
    be called from any thread. Without ``pieces`` (a non-streaming request) the job reports
    only its end: no event per speculative step for the event loop to wake for. ``media``:
    what the target reads at some of the prompt's positions (images, from
    :meth:`Engine.media_prompt`).
    """

    def __init__(
        self,
        prompt: list[int],
        params: GenerationParams,
        *,
        pieces: bool = True,
        media: Sequence[MediaSpan] = (),
    ) -> None:
        self.prompt = prompt
        self.params = params
        self.pieces = pieces
        #: what the target reads at some of the prompt's positions (images)
        self.media = list(media)
        self._loop = asyncio.get_running_loop()
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._lock = threading.Lock()
        self._generation: Generation | None = None
        self.cancelled = False
        self.started = threading.Event()
        #: set by whoever reads the events once the last one was handed on (a response
        #: about to end); see :meth:`Scheduler.fail_all`
        self.delivered = threading.Event()
        #: streamed text generated but not sent yet (see ``stream_interval``)
        self.held: list[str] = []

    def cancel(self) -> None:
        """End the job: a waiting one never starts, a running one stops before its next
        speculative step (its result has finish reason "interrupted"). Never waits: the
        worker may be inside llama.cpp holding the job (see :meth:`Scheduler.fail_all`);
        a generation set after the flag is cancelled by the worker itself."""
        self.cancelled = True
        gen = self._generation
        if gen is not None:
            gen.cancel()

    def emit(self, event: Event) -> None:
        """From the worker thread: hand an event to the event loop (dropped when the loop
        has closed: nobody is listening)."""
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)

    def begin(self, start: Callable[[], Generation]) -> Generation | None:
        """From the worker thread: the job's generation, made by ``start``; None when the
        job was cancelled before it started (its ``done`` event sent) or ``start``
        failed (its ``error`` event sent). A job cancelled while ``start`` ran has its
        generation cancelled (:meth:`cancel` never waits for this)."""
        with self._lock:
            if self.cancelled:
                self.emit(Event("done"))
                return None
            try:
                gen = start()
            except Exception as e:  # a bad setting the request checks did not catch
                self.emit(Event("error", error=e))
                return None
            self._generation = gen
            if self.cancelled:  # cancelled while the generation was being set up
                gen.cancel()
        self.started.set()
        return gen

    async def events(self) -> AsyncIterator[Event]:
        """The job's events in order, ending with its ``done`` or ``error`` event."""
        while True:
            event = await self._events.get()
            yield event
            if event.kind != "piece":
                return


class Scheduler:
    """Runs jobs on ``engine`` in arrival order on one worker thread: one at a time, or,
    on an engine loaded with parallel sequences (``engine.slots``), as many at once as it
    has (:attr:`parallel`).

    Args:
        engine: the loaded engine (only the worker thread generates with it).
        max_queue: the most jobs that may wait while every sequence runs one;
            :meth:`submit` raises :class:`QueueFull` beyond it.
        on_result: called on the worker thread with every finished generation's result
            (cancelled ones included), e.g. to count tokens.
        executor: a one-thread executor whose thread becomes the worker (it should be the
            thread that loaded and calibrated ``engine``: see :func:`engine_thread`);
            without it, a thread of the scheduler's own.
        stream_interval: the shortest time between two text events of a streamed job
            (seconds): the text of steps that end sooner is held and sent with the next
            (the first step's at once). 0: an event per speculative step.
    """

    def __init__(
        self,
        engine: Engine,
        max_queue: int,
        *,
        on_result: Callable[[GenerationResult], None] | None = None,
        executor: ThreadPoolExecutor | None = None,
        stream_interval: float = STREAM_INTERVAL,
    ) -> None:
        if max_queue < 0:
            raise ValueError(f"max_queue must be 0 or more, not {max_queue}")
        self.engine = engine
        self.max_queue = max_queue
        self.on_result = on_result
        self.stream_interval = stream_interval
        self._waiting: collections.deque[Job] = collections.deque()
        #: jobs generating, by sequence
        self._running: dict[int, Job] = {}
        #: how many jobs may generate at once
        self.parallel = engine.n_parallel
        self._cond = threading.Condition()
        #: held while a job of one sequence generates, or a step of parallel sequences
        #: runs: the projector's work on another thread (a request's images) takes it
        #: too, through :meth:`turn`, so that llama.cpp never computes on two threads at
        #: once, as llama-server encodes images on its one thread
        self.llama = threading.Lock()
        self._turns_wanted = 0  # threads waiting in turn(): the worker lets them go first
        self._reserved = 0  # requests holding a place while their images are read (reserve)
        self._closed = False
        self._thread: threading.Thread | None = None
        self._future: Future[None] | None = None
        if executor is not None:
            self._future = executor.submit(self._work)
        else:
            self._thread = threading.Thread(target=self._work, name="specgguf-engine", daemon=True)
            self._thread.start()

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """Hold :attr:`llama` between two generations of one sequence, or two steps of
        parallel sequences (the worker waits for this turn before it takes the lock
        again: a lock alone would be taken back by the worker at once, step after step).
        For llama.cpp's work on another thread (:meth:`Service.prompt_ids
        <specgguf.server.service.Service.prompt_ids>`: a request's images).

        Raises:
            ShuttingDown: the scheduler was closed (before or while waiting): the work
                would be for a job it will not take.
        """
        with self._cond:
            if self._closed:
                raise ShuttingDown()
            self._turns_wanted += 1
        try:
            with self.llama:
                if self._closed:
                    raise ShuttingDown()
                yield
        finally:
            with self._cond:
                self._turns_wanted -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def reserve(self) -> Iterator[None]:
        """Hold a place in the queue while a request gets ready to be submitted (its
        images read, which waits for :meth:`turn`): counted as waiting, and by
        :meth:`full` and :meth:`submit`'s limit, so that requests cannot pile up before
        the queue where ``max_queue`` cannot see them.

        Raises:
            QueueFull: ``max_queue`` jobs (and places) are waiting already.
            ShuttingDown: the scheduler was closed.
        """
        with self._cond:
            if self._closed:
                raise ShuttingDown()
            if self._taken() >= self.max_queue + self.parallel:
                raise QueueFull()
            self._reserved += 1
        try:
            yield
        finally:
            with self._cond:
                self._reserved -= 1

    def _taken(self) -> int:
        """Places taken: jobs waiting (cancelled ones not counted) and running, places
        held (:meth:`reserve`). Call it holding ``_cond``."""
        return sum(not j.cancelled for j in self._waiting) + len(self._running) + self._reserved

    @property
    def closed(self) -> bool:
        """Whether the scheduler takes no more jobs (the server stops)."""
        return self._closed

    @property
    def waiting(self) -> int:
        """Jobs in the queue, not yet started (cancelled ones not counted), and requests
        holding a place while their images are read (:meth:`reserve`)."""
        return sum(not job.cancelled for job in list(self._waiting)) + self._reserved

    @property
    def busy(self) -> bool:
        """Whether a job is running."""
        return bool(self._running)

    @property
    def running(self) -> int:
        """Jobs generating now (0 to :attr:`parallel`)."""
        return len(self._running)

    def full(self) -> bool:
        """Whether :meth:`submit` would refuse a job now (:class:`QueueFull`)."""
        with self._cond:
            return self._taken() >= self.max_queue + self.parallel

    def submit(self, job: Job) -> None:
        """Queue ``job`` behind the others.

        Raises:
            QueueFull: ``max_queue`` jobs are waiting already.
            ShuttingDown: the scheduler was closed.
        """
        with self._cond:
            if self._closed:
                raise ShuttingDown()
            self._waiting = collections.deque(j for j in self._waiting if not j.cancelled)
            # `parallel` jobs run, up to max_queue wait their turn (places held included).
            if self._taken() >= self.max_queue + self.parallel:
                raise QueueFull()
            self._waiting.append(job)
            self._cond.notify()

    def close(self) -> None:
        """Take no more jobs, end the waiting ones (an ``error`` event with
        :class:`ShuttingDown`) and cancel the running one. Returns at once; :meth:`join`
        waits for the worker."""
        with self._cond:
            self._closed = True
            waiting, self._waiting = list(self._waiting), collections.deque()
            running = list(self._running.values())
            self._cond.notify_all()
        for job in waiting:
            job.cancel()
            job.emit(Event("error", error=ShuttingDown()))
        for job in running:
            job.cancel()

    def fail_all(self, error: BaseException, *, timeout: float = 3.0) -> int:
        """End every job at once with an ``error`` event for ``error`` (the text each
        running one holds sent first), from any thread, and wait up to ``timeout`` seconds
        for their readers to hand the events on: the process is about to end (an RPC server
        was lost and llama.cpp aborts). Takes no more jobs. Returns the jobs ended."""
        with self._cond:
            self._closed = True
            jobs = [*self._waiting, *self._running.values()]
            self._waiting = collections.deque()
            self._cond.notify_all()
        for job in jobs:
            job.cancelled = True  # no lock: the engine thread may hold it, stopped in llama.cpp
            if job.held:
                job.emit(Event("piece", text="".join(job.held)))
                job.held.clear()
            job.emit(Event("error", error=error))
        deadline = monotonic() + timeout
        for job in jobs:
            job.delivered.wait(max(0.0, deadline - monotonic()))
        sleep(0.2)  # for the responses' last bytes to leave after their events
        return len(jobs)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the worker to finish its job and stop; True when it has."""
        if self._future is not None:
            import concurrent.futures

            concurrent.futures.wait([self._future], timeout)
            return self._future.done()
        assert self._thread is not None
        self._thread.join(timeout)
        return not self._thread.is_alive()

    # -- the worker thread ------------------------------------------------------------

    def _work(self) -> None:
        if self.parallel > 1:
            self._work_batched()
            return
        while True:
            with self._cond:
                while (not self._waiting or self._turns_wanted) and not self._closed:
                    self._cond.wait()
                if not self._waiting:
                    return  # closed and drained
                job = self._waiting.popleft()
                self._running[0] = job
            with self.llama:
                self._run_safely(job)

    def _work_batched(self) -> None:
        """The worker of parallel sequences: waiting jobs take free sequences as tasks of
        the engine's batcher, which is stepped while any runs."""
        free = list(range(self.parallel))
        try:
            batcher = self.engine.start_batching()
        except Exception as e:  # the calibration failed: every job learns why
            log.exception("the engine's worker could not start")
            batcher, failed = None, e
        while True:
            with self._cond:
                while (
                    (not self._waiting and not (batcher and batcher.active)) or self._turns_wanted
                ) and not self._closed:
                    self._cond.wait()
                if not self._waiting and not (batcher and batcher.active):
                    return  # closed and drained
                while self._waiting and free:
                    job = self._waiting.popleft()
                    if batcher is None:
                        job.emit(Event("error", error=failed))
                        continue
                    # the free sequence whose cache shares most of the prompt
                    slot = self.engine.pick_slot(job.prompt, free, job.media)
                    free.remove(slot)
                    self._running[slot] = job
                    batcher.add(slot, functools.partial(self._run_safely, job, slot, free))
            if batcher is None:
                continue
            try:
                with self.llama:
                    batcher.step()
            except Exception as e:  # a bug: every running job learns of it, none hangs
                log.exception("the engine's batched worker failed")
                with self._cond:
                    running, self._running = list(self._running.values()), {}
                    free[:] = range(self.parallel)
                for job in running:
                    job.emit(Event("error", error=e))
                batcher = self.engine.start_batching()

    def _run_safely(self, job: Job, slot: int = 0, free: list[int] | None = None) -> None:
        """Run ``job`` on sequence ``slot``, then free it (in ``free``)."""
        try:
            self._run(job, slot if free is not None else None)
        except Exception as e:  # never lose the worker: the job reports the error
            log.exception("the engine's worker failed")
            job.emit(Event("error", error=e))
        finally:
            with self._cond:
                if self._running.get(slot) is job:  # (not after a failed step ended it)
                    del self._running[slot]
                    if free is not None:
                        free.append(slot)
                        free.sort()

    def _run(self, job: Job, slot: int | None = None) -> None:
        engine = self.engine
        if job.media:  # (Engine.media_prompt's)
            gen = job.begin(
                lambda: engine.generate(job.prompt, job.params, slot=slot, media=job.media)
            )
        elif slot is None:
            gen = job.begin(lambda: engine.generate(job.prompt, job.params))
        else:
            gen = job.begin(lambda: engine.generate(job.prompt, job.params, slot=slot))
        if gen is None:
            return
        held = job.held  # text not sent yet (see stream_interval)
        try:
            if job.pieces:
                sent = -math.inf
                for piece in gen:
                    held.append(piece)
                    now = monotonic()
                    if now - sent >= self.stream_interval:
                        job.emit(Event("piece", text="".join(held)))
                        held.clear()
                        sent = now
            else:
                for _ in gen:
                    pass
        except Exception as e:  # llama.cpp failed (BackendError) or a bug: the job ends
            if held:  # the text before the failure is the client's
                job.emit(Event("piece", text="".join(held)))
            job.emit(Event("error", error=e))
            return
        if held:
            job.emit(Event("piece", text="".join(held)))
        result = gen.result
        assert result is not None
        if self.on_result is not None:
            self.on_result(result)
        job.emit(Event("done", result=result))
