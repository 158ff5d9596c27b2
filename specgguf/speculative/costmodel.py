"""When does speculation pay? A cost model from measured timings: pure functions of the
timings and the depth of the context.

Expected tokens per step for per-token acceptance rate ``a`` and draft length K (Leviathan
et al. 2023, section 3.1, equation 1, with i.i.d. acceptance)::

    E(K) = (1 - a^(K+1)) / (1 - a)          (E(0) = 1)

Cost of a step: K draft evaluations plus one verification of K + 1 tokens::

    C(K) = K * t_draft + t_verify(K + 1)

:func:`best_k` is the K (0 included: no speculation) that maximises E(K) / C(K) tokens per
second; :func:`best_tree` the same for a token tree. The timings come from a calibration
(:mod:`specgguf.engine.calibration`, which measures them on the loaded pair) and are
corrected online from every verification (:meth:`Timings.observe_verify`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

from specgguf.speculative.tuning import AUTO_TUNING


def expected_tokens(a: float, k: int) -> float:
    """E(K) = (1 - a^(K+1)) / (1 - a): tokens a step yields with K drafts accepted
    independently with probability ``a`` (the +1 is the target's own token)."""
    if k <= 0:
        return 1.0
    if a >= 1.0:
        return float(k + 1)
    return (1.0 - a ** (k + 1)) / (1.0 - a)


def call_sizes(n: int, rows_per_call: int) -> list[int]:
    """The sizes of the decode calls that evaluate ``n`` rows at most ``rows_per_call`` at a
    time, as even as possible, larger first (the split of deterministic mode's
    :meth:`specgguf.llama.backend.LlamaContext.eval`)."""
    calls = -(-n // rows_per_call)
    return [n // calls + (i < n % calls) for i in range(calls)]


def micro_batches(rows: Sequence[tuple[int, int]], n_ubatch: int) -> list[int]:
    """The rows of each micro-batch (``ubatch``: one evaluation of the graph, which reads
    every weight) that llama.cpp splits one batch into when each sequence has a KV stream
    of its own (``kv_unified`` off, several sequences: ``serve --parallel``).

    ``rows``: each sequence's id and rows, in the batch's order (a sequence's rows
    together); ``n_ubatch``: the context's micro-batch size. As llama.cpp's
    ``llama_batch_allocr::split_equal`` with ``sequential`` (src/llama-batch.cpp, called
    by ``llama_kv_cache::init_batch``): a micro-batch takes the first sequence with rows
    left, in batch order, and after it each sequence whose id is one more than the last
    taken (at most ``n_ubatch + 1`` sequences); then as many rows of each as the fewest
    any of them has left (at most ``n_ubatch`` divided among them, at least one each). So
    sequences that bring different numbers of rows, or ids with a gap, cost more than one
    micro-batch.

    Returns:
        rows per micro-batch, in order; ``[]`` for no rows.
    """
    return list(_micro_batches(tuple(rows), n_ubatch))


def cheapest_micro_batches(
    rows: Sequence[tuple[int, int]], n_ubatch: int, cost: Callable[[int], float]
) -> tuple[list[int], list[int]]:
    """The micro-batches of ``rows`` (ids rising, as the batcher orders a batch) where each
    run of consecutive ids, which llama.cpp never puts in one micro-batch with another
    run, is either left as it is (:func:`micro_batches`) or padded with throw-away rows to
    the most rows any of its sequences brings, whichever costs less by ``cost`` (seconds
    of a micro-batch of n rows); and the rows each sequence is padded with. Where rows
    cost little (a GPU), padding sequences 0-2 of 5, 1 and 1 rows to 5 each is one
    micro-batch of 15 rows instead of two (3 rows, then 4), which costs nearly a second
    pass over the weights; on a CPU the padding's rows usually cost more.
    :class:`specgguf.engine.batching.Batcher` pads a target batch of verifications by this
    rule, and :class:`Timings` costs a step by it.

    Returns:
        (rows per micro-batch, pad rows per entry of ``rows``)
    """
    out: list[int] = []
    pads: list[int] = []
    for split, padded, run_pads in _run_options(tuple(rows), n_ubatch):
        if padded and sum(cost(m) for m in padded) < sum(cost(m) for m in split):
            out += padded
            pads += run_pads
        else:
            out += split
            pads += [0] * len(run_pads)
    return out, pads


@functools.lru_cache(maxsize=4096)
def _run_options(
    rows: tuple[tuple[int, int], ...], n_ubatch: int
) -> tuple[tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]], ...]:
    """Per run of consecutive ids in ``rows``: its micro-batches as they are, padded (``()``
    where padding changes nothing), and the pad rows of each of its entries."""
    options = []
    start = 0
    while start < len(rows):
        end = start + 1
        while end < len(rows) and rows[end][0] == rows[end - 1][0] + 1:
            end += 1
        run = rows[start:end]
        most = max(n for _, n in run)
        padded: tuple[int, ...] = ()
        if len(run) > 1 and any(n != most for _, n in run) and all(n > 0 for _, n in run):
            padded = _micro_batches(tuple((seq, most) for seq, _ in run), n_ubatch)
        options.append((_micro_batches(run, n_ubatch), padded,
                        tuple(most - n for _, n in run)))  # fmt: skip
        start = end
    return tuple(options)


@functools.lru_cache(maxsize=4096)
def _micro_batches(rows: tuple[tuple[int, int], ...], n_ubatch: int) -> tuple[int, ...]:
    left = [[seq, n] for seq, n in rows if n > 0]
    out: list[int] = []
    while left:
        taken = [left[0]]
        for item in left[1:]:
            if len(taken) > n_ubatch:
                break
            if item[0] == taken[-1][0] + 1:
                taken.append(item)
        each = min(min(n for _, n in taken), max(1, n_ubatch // len(taken)))
        for item in taken:
            item[1] -= each
        out.append(each * len(taken))
        left = [item for item in left if item[1] > 0]
    return tuple(out)


#: the most values :class:`Timings` keeps between two changes of its fields
_MEMO_MAX = 4096


@dataclasses.dataclass(slots=True)
class Timings:
    """Seconds per evaluation: ``verify[n]`` for a target batch of n tokens (n = 1 is a
    plain decode step), as calibrated, and ``draft`` per draft-model token (0 without a
    draft model).

    Online refinement keeps the calibrated curve and learns two correction factors, one
    for decode steps and one for batches (``scale_single``, ``scale_batch``): during a run
    the target and the draft evict each other's weights from the CPU caches, which makes
    real steps slower than calibrated ones (about 1.3x for 10-token batches, measured).

    The curve holds at ``depth`` cached positions (the calibration's prefix). Every row of
    a verification attends to every cached position, so a batch costs more deeper in the
    context: ``position_row`` seconds per row and cached position past ``depth``, and a
    lone row ``position_single``, at most ``position_row`` (llama.cpp's CPU FlashAttention
    splits a lone row's positions over the threads: ``ggml-cpu/ops.cpp``, its split-KV
    path). Measured on Qwen2.5-Coder 1.5B, 2-core AMD EPYC: 4 rows cost 2.8x one row at
    64 positions and 3.6x at 1024. Every cost is read at a number of ``cached`` positions
    (the positions before the step's first row).

    Deterministic mode decodes a lone row with a throw-away second row once more than
    ``lone_max`` positions are cached (:attr:`specgguf.llama.backend.LlamaContext.
    lone_rows_max`; with an f16 K cache 256, with q8_0 never): then a lone row costs
    what two rows do, and drafting one token costs no more verification than drafting
    none. Its greedy verification runs in calls of at most ``chunk_rows`` rows and stops
    after the first call that shows a rejection (:meth:`expected_verify_time`).

    ``others``: the other sequences' ids in the same target batch (``serve --parallel``,
    :mod:`specgguf.engine.batching`), ``seq`` this sequence's id and ``n_ubatch`` the
    context's micro-batch size; ``sharing`` is the sequences in the batch, this one
    included. llama.cpp evaluates such a batch in micro-batches (:func:`micro_batches`),
    each reading the weights again, and the batcher pads it to even rows where that costs
    less (:func:`cheapest_micro_batches`), so the batch costs T = the sum of t(m) over its
    micro-batches m. A step's cost is this sequence's share of what the batch costs with
    one row of each sequence, plus what its own rows add::

        t_verify(n) = T(1) / sharing + T(n) - T(1)

    T(n): the batch with this sequence's n rows and each other sequence's one. So a draft
    pays when the tokens it is expected to add over the rows' time, (E(K) - 1) / (T(K + 1) -
    T(1)), beat the batch's own rate, sharing / T(1) (by the margin; a draft model's K
    t_draft counts with the rows): exactly when the batch as a whole yields more tokens per
    second with the draft than without it (Leviathan et al. 2023, section 3.1, for the batch
    rather than one sequence). The length chosen is the best for this sequence's rate, which
    can be shorter than the best for the batch's. Were the step costed at what its last
    token adds to the batch (a row's marginal cost, on a CPU about half the batch's cost per
    row), a draft would have to beat twice the batch's rate, and a copy accepted at 0.98
    would not pay beside three other sequences. The others count one row each, as if they
    drafted nothing: beside their latest drafts, a draft up to the longest of theirs would
    look free wherever the batch is padded, and every sequence would keep drafting however
    little of it were accepted. What a step's rows add is counted from its last token's
    (T(1)): where this sequence fills a gap in the others' ids, T(1) is less than the batch
    without it, and counted from there a draft of up to the rows that saving pays would look
    free. With one sequence this is t(n), as before. Where a batch is compute-bound (a CPU)
    a draft row costs about what a sequence's whole step does and drafts pay less the more
    sequences share the batch; where rows are nearly free (a GPU) the batch is padded and a
    draft costs little more than its rows.
    """

    verify: dict[int, float]
    draft: float = 0.0
    scale_single: float = 1.0
    scale_batch: float = 1.0
    #: positions up to which a lone row is decoded alone (None: always)
    lone_max: int | None = None
    #: deterministic mode's most rows per decode call (None: one evaluation of every row)
    chunk_rows: int | None = None
    #: cached positions at which ``verify`` was measured
    depth: int = 0
    #: seconds each cached position past ``depth`` adds to a lone row, and to each row of
    #: a batch
    position_single: float = 0.0
    position_row: float = 0.0
    #: the other sequences' ids in the same target batch; this sequence's id;
    #: llama.cpp's micro-batch size (see the class)
    others: tuple[int, ...] = ()
    seq: int = 0
    n_ubatch: int = 512
    #: whether no other sequence runs beside this one (a step's time is then its own, and
    #: auto mode refines the timings from it)
    solo: bool = True
    #: checkpoint and replay (a recurrent target without snapshots): seconds to copy its
    #: state before a verification and to load it back after a rejection, and whether
    #: the rows kept are decoded in the next verification's batch (lazily) rather than
    #: at once; None: the target drops rejected drafts by cutting its cache
    #: (:meth:`rollback_time`)
    replay: tuple[float, float, bool] | None = None
    #: T(n) by n, and T(1) / S (key -1), for the step
    #: of ``_shared_key`` (others, depth, ...): best_k asks for every K of every arm
    _shared_key: tuple[object, ...] = dataclasses.field(
        default=(), init=False, repr=False, compare=False
    )
    _shared: dict[int, float] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    #: :meth:`curve` at sizes between (and past) the measured ones, for the ``verify``
    #: that is ``_curve_of`` (a curve is replaced, never changed in place)
    _curve_of: dict[int, float] | None = dataclasses.field(
        default=None, init=False, repr=False, compare=False
    )
    _curve: dict[int, float] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    #: :meth:`verify_time` and :meth:`_at_depth` by (n, cached) for the fields as they
    #: are: setting any field empties both (auto mode's arms ask for the same few sizes
    #: at the same depth many times a step, between two verifications that set a scale)
    _memo_verify: dict[tuple[int, int], float] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _memo_depth: dict[tuple[int, int], float] = dataclasses.field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __copy__(self) -> Timings:
        # (a copy shares no memo with this one: a change to either would leave the other
        # reading the values of the one that asked last)
        return dataclasses.replace(self)

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)
        if name[0] != "_":
            try:
                self._memo_verify.clear()
                self._memo_depth.clear()
            except AttributeError:  # (a field set by __init__ before the memos)
                pass

    @property
    def sharing(self) -> int:
        """The sequences in the target batch, this one included."""
        return 1 + len(self.others)

    def padded(self, cached: int) -> bool:
        """Whether a lone row is decoded with a throw-away row after ``cached`` positions."""
        return self.lone_max is not None and cached + 1 > self.lone_max

    def curve(self, n: int) -> float:
        """The calibrated seconds of a batch of ``n`` rows at the calibration's depth,
        without corrections: linearly interpolated between measured sizes, extrapolated
        past the largest."""
        if n in self.verify:
            return self.verify[n]
        if self.verify is not self._curve_of:
            self._curve_of = self.verify
            self._curve = {}
        if n not in self._curve:
            self._curve[n] = self._interpolate(n)
        return self._curve[n]

    def _interpolate(self, n: int) -> float:
        xs = sorted(self.verify)
        if n <= xs[0]:
            return self.verify[xs[0]]
        lo = max((x for x in xs if x < n), default=xs[0])
        hi = min((x for x in xs if x > n), default=None)
        if hi is None:
            # Past the largest size, from the last two, each row adding at least the mean
            # of what a row added over the measured sizes: noise can make the last two
            # flat or reversed (13 rows measured slower than 17), and a catch-up of 90
            # tokens then cost nothing.
            last = xs[-1]
            if len(xs) == 1:
                return self.verify[last] * n / last
            v = self.verify
            slope = max((v[last] - v[xs[-2]]) / (last - xs[-2]),
                        (v[last] - v[xs[0]]) / (last - xs[0]), 0.0)  # fmt: skip
            return v[last] + (n - last) * slope
        w = (n - lo) / (hi - lo)
        return self.verify[lo] + w * (self.verify[hi] - self.verify[lo])

    def _at_depth(self, n: int, cached: int) -> float:
        """The calibrated curve at n rows, plus what attention to the positions cached past
        the calibration's ``depth`` adds."""
        key = (n, cached)
        if (t := self._memo_depth.get(key)) is not None:
            return t
        if len(self._memo_depth) > _MEMO_MAX:
            self._memo_depth.clear()
        deeper = max(0, cached - self.depth)
        # A lone row attends to the positions one row of a batch does, and llama.cpp's
        # split-KV path only makes that cheaper: its slope is at most a batch row's. Its
        # measurement is the noisiest (one row, about 1 ms over 320 positions), and a
        # measured 60 us (against 14 for a batch row, and no slope by llama-bench -d
        # 64,384,800) made one row at 779 positions cost what two did: the draft model
        # looked free and auto ran at 0.83x of the target alone on Spec-Bench's rag.
        single = min(self.position_single, self.position_row)
        per = single if n == 1 else n * self.position_row
        t = self._memo_depth[key] = self.curve(n) + deeper * per
        return t

    def _batch_at_depth(self, n: int, cached: int) -> float:
        """T(n): the target batch of :attr:`others` and this sequence's ``n`` rows, summed
        over its micro-batches, padded where that costs less
        (:func:`cheapest_micro_batches`; every row at this sequence's depth)."""
        # The others at one row each: what this step's rows cost were they to draft
        # nothing. Counted beside their latest drafts, a draft up to the longest of theirs
        # would look free wherever the batch is padded, and every sequence would keep
        # drafting however little of it is accepted.
        rows = sorted((*((seq, 1) for seq in self.others), (self.seq, n)))

        def cost(m: int) -> float:
            return self._at_depth(m, cached)

        return sum(cost(m) for m in cheapest_micro_batches(rows, self.n_ubatch, cost)[0])

    def _share(self, n: int, cached: int) -> float:
        """T(1) / S + T(n) - T(1) (see the class), uncorrected; each T computed once per
        step."""
        key = (self.others, self.seq, self.n_ubatch, cached, self.depth,
               self.position_single, self.position_row, self.verify)  # fmt: skip
        memo = self._shared
        if key != self._shared_key:
            self._shared_key = key
            memo.clear()
            one = memo[1] = self._batch_at_depth(1, cached)
            memo[-1] = one / self.sharing
        if n not in memo:
            memo[n] = self._batch_at_depth(n, cached)
        return memo[-1] + memo[n] - memo[1]

    def batch_time(self, n: int, cached: int = 0) -> float:
        """The calibrated seconds of one micro-batch of ``n`` rows after ``cached``
        positions, without the learnt corrections (what the batcher weighs padding by)."""
        return self._at_depth(n, cached)

    def verify_time(self, n: int, cached: int = 0) -> float:
        """t_verify(n) in seconds after ``cached`` positions: the calibrated curve, with
        what depth adds, times the learned correction; a lone row that is padded
        (:meth:`padded`) costs two rows. With :attr:`others`, this sequence's share of a
        batch (see the class; at least a thousandth of a lone row: a flat stretch of the
        measured curve is noise, not free rows)."""
        key = (n, cached)
        if (t := self._memo_verify.get(key)) is not None:
            return t
        if len(self._memo_verify) > _MEMO_MAX:
            self._memo_verify.clear()
        if self.others:
            t = max(self._share(n, cached), 0.001 * self.curve(1)) * self.scale_batch
        else:
            m = 2 if n == 1 and self.padded(cached) else n
            t = self._at_depth(m, cached) * (self.scale_single if m == 1 else self.scale_batch)
        self._memo_verify[key] = t
        return t

    def rollback_time(self, n: int, a: float, cached: int = 0) -> float:
        """The expected seconds checkpoint and replay (:attr:`replay`) adds to a
        verification of ``n`` rows, the last token and n - 1 drafts each accepted with
        probability ``a`` when those before it are. Where draft j + 1 is the first
        rejected (probability a^j (1 - a); some draft is, r = 1 - a^(n - 1)), the copy is
        loaded back and the j + 1 rows kept are decoded again.

        At once (:attr:`replay`'s third field False): every step copies the state, and a
        rejection costs t(j + 1) on the calibrated curve. Lazily: the rows kept join the
        next verification's batch, which then needs no copy of its own (t(n + j + 1) -
        t(n), that batch taken to be of ``n`` rows too); a rejection of such a joined step
        decodes its kept rows and the earlier ones at once (t(j + 1 + p), p the rows a
        rejection keeps on average), so that the next step copies afresh. A step is a
        joined one with probability x = r / (1 + r) (after a fresh step that was
        rejected), and only the others copy the state. 0 without replay, or for a lone
        row. (llama-server's checkpoints, #19493; a user measured their cost making MTP
        slower than the target alone, #28118.)"""
        if self.replay is None or n < 2:
            return 0.0
        save, restore, lazy = self.replay
        weights = [a**j * (1.0 - a) for j in range(n - 1)]
        r = sum(weights)
        if not lazy:
            return save + sum(w * (restore + self._at_depth(j + 1, cached))
                              for j, w in enumerate(weights))  # fmt: skip
        x = r / (1.0 + r)
        kept = sum(w * (j + 1) for j, w in enumerate(weights)) / r if r else 0.0
        base = self._at_depth(n, cached)
        total = (1.0 - x) * save
        for j, w in enumerate(weights):
            joined = self._rows_at(j + 1 + kept, cached)
            total += w * (restore + (1.0 - x) * (self._at_depth(n + j + 1, cached) - base)
                          + x * joined)  # fmt: skip
        return total

    def _rows_at(self, m: float, cached: int) -> float:
        """The calibrated curve at a fractional number of rows, linearly between."""
        lo = max(1, int(m))
        t = self._at_depth(lo, cached)
        return t + (m - lo) * (self._at_depth(lo + 1, cached) - t) if m > lo else t

    def expected_verify_time(self, n: int, a: float, cached: int = 0) -> float:
        """The expected t_verify of ``n`` rows (the last token, then n - 1 drafts each
        accepted with probability ``a``) when greedy verification is decoded in calls of
        at most ``chunk_rows`` rows (sizes as even as possible, larger first, as
        :meth:`specgguf.llama.backend.LlamaContext.eval` splits them) and stops after the
        first call that shows a rejection: call j runs only when the s_0 + ... + s_(j-1)
        drafts the calls before it verified were all accepted, so the expectation is
        sum_j a^(s_0 + ... + s_(j-1)) t_verify(s_j). Without ``chunk_rows``, or for one
        call, t_verify(n)."""
        r = self.chunk_rows
        if not r or n <= r:
            return self.verify_time(n, cached)
        total, before = 0.0, 0
        for size in call_sizes(n, r):
            total += a**before * self.verify_time(size, cached)
            before += size
        return total

    def share_batch(self, others: tuple[int, ...], *, solo: bool) -> None:
        """The next step's company: the other sequences' ids in its target batch
        (``others``) and whether no other sequence runs at all (``solo``)."""
        self.others = others
        self.solo = solo

    def observe_verify(
        self,
        n: int,
        seconds: float,
        cached: int = 0,
        *,
        weight: float = AUTO_TUNING.timing_weight,
        clamp: tuple[float, float] = AUTO_TUNING.timing_clamp,
    ) -> None:
        """Refine the correction for batches of ``n`` with a measurement of ``seconds``
        after ``cached`` positions (a padded lone row is a batch of two): the ratio to the
        calibration, within ``clamp``, moves the correction by ``weight``."""
        if n == 1 and self.padded(cached):
            n = 2
        ratio = min(clamp[1], max(clamp[0], seconds / self._at_depth(n, cached)))
        if n == 1:
            self.scale_single += weight * (ratio - self.scale_single)
        else:
            self.scale_batch += weight * (ratio - self.scale_batch)

    def observe_draft(
        self, seconds_per_token: float, *, weight: float = AUTO_TUNING.timing_weight
    ) -> None:
        """Move ``draft`` towards a measurement (seconds per draft-model token)."""
        self.draft += weight * (seconds_per_token - self.draft)


def best_k(
    a: float,
    timings: Timings,
    k_max: int,
    *,
    cached: int = 0,
    draft_cost: float | None = None,
    k_min: int = 1,
    greedy: bool = False,
) -> tuple[int, float]:
    """The draft length maximising E(K) / C(K) after ``cached`` positions, and that rate
    (tokens/s); K is 0 (no drafts) or between ``k_min`` and ``k_max``. ``draft_cost``
    overrides t_draft (seconds per drafted token; 0 for lookups). ``greedy``: the
    verification's expected cost where it stops at a rejection
    (:meth:`Timings.expected_verify_time`). C(K) includes what dropping the rejected
    drafts costs (:meth:`Timings.rollback_time`)."""
    td = timings.draft if draft_cost is None else draft_cost
    verify_time = timings.verify_time
    best, rate = 0, 1.0 / verify_time(1, cached)
    if timings.replay is None and not (greedy and timings.chunk_rows):
        # (the usual case, without the general one's calls: no rollback's cost, and one
        # verification of every row)
        for k in range(max(1, k_min), max(0, k_max) + 1):
            r = expected_tokens(a, k) / (k * td + verify_time(k + 1, cached))
            if r > rate:
                best, rate = k, r
        return best, rate
    for k in range(max(1, k_min), max(0, k_max) + 1):
        if greedy:
            verify = timings.expected_verify_time(k + 1, a, cached)
        else:
            verify = verify_time(k + 1, cached)
        verify += timings.rollback_time(k + 1, a, cached)
        r = expected_tokens(a, k) / (k * td + verify)
        if r > rate:
            best, rate = k, r
    return best, rate


def best_tree(
    probs: Sequence[float], timings: Timings, *, cached: int = 0, k_min: int = 1
) -> tuple[int, float]:
    """The number of nodes m (0, or ``k_min`` to ``len(probs)``) of a tree draft whose
    first m nodes maximise E(m) / t_verify(m + 1) after ``cached`` positions, and that rate
    (tokens/s).

    ``probs[i]`` is the estimated probability that node i is accepted (that the target's
    argmax follows its whole branch), in an order where parents come first, so that every
    prefix is a tree. A step yields one token of the target's own plus every accepted
    node, and at most one node per depth is accepted, so E(m) = 1 + sum(probs[:m])
    (SpecInfer, Miao et al. 2023; Sequoia, Chen et al. 2024, section 3.1). A chain with
    i.i.d. acceptance ``a`` has probs a, a^2, ..., and E(m) is :func:`expected_tokens`.
    The verification is one batch of m + 1 rows, costed from the measured curve."""
    best, rate = 0, 1.0 / timings.verify_time(1, cached)
    e = 1.0
    for m, p in enumerate(probs, start=1):
        e += p
        r = e / timings.verify_time(m + 1, cached)
        if m >= k_min and r > rate:
            best, rate = m, r
    return best, rate


def row_share(timings: Timings, k: int, cached: int = 0) -> float:
    """What each of ``k`` draft rows adds to a verification after ``cached`` positions,
    relative to a lone row, on the calibrated curve with what depth adds:
    (t(k + 1) - t(1)) / (k t(1)), at least 0 (a ratio of seconds). The curve's shape, as
    :meth:`ModelArm.p_stop_at <specgguf.speculative.arms.model.ModelArm.p_stop_at>` reads
    it: without the learnt corrections (lone rows and batches differ there by Python's
    share of a step, not by what a row adds) or deterministic mode's padded lone row. From
    the measured curves at k = 4: 0.2 on a 2-core Xeon; on a 2-core AMD EPYC 0.45 near the
    start of a context and 0.7-0.8 at 700 positions (by the fitted 16 and 6 us a position,
    and as measured); under 0.01 on the GPU-like curve of issue 34. Beside other
    sequences (:attr:`Timings.others`), relative to this sequence's share of the batch
    instead, the rows as they add to it (see :class:`Timings`): on the Xeon's curve beside
    three others, 1.0 (each draft row costs a sequence's share), where the solo curve says
    0.2 and n-gram lookups were judged four times too hopefully. (The draft model's
    stopping rule keeps the solo curve: read this way it stopped a GPU's drafts too early;
    docs/performance.md.)

    Raises:
        ZeroDivisionError: a lone row that costs nothing.
    """
    k = max(1, k)
    at = timings._share if timings.others else timings._at_depth
    one = at(1, cached)
    return max(0.0, at(k + 1, cached) - one) / (k * one)


def verify_time_at(timings: Timings, n: float, cached: int = 0) -> float:
    """t_verify at a fractional batch size (an expected number of rows), linearly
    interpolated between the whole sizes around it."""
    lo = int(n)
    w = n - lo
    t = timings.verify_time(lo, cached)
    return t if w == 0.0 else t + w * (timings.verify_time(lo + 1, cached) - t)
