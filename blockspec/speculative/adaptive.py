"""Adaptive verify width: each speculative step verifies the first w - 1 drafts (w in 1..W),
w chosen for the whole batch to maximise expected committed tokens per second.

* Live acceptance (``AcceptanceEWMA``): per request slot and draft position j, an EWMA of
  P(draft j accepted | drafts before it accepted), updated inside the step function from the
  accept lengths (device ops only; a graph replays it). Position j is observed only when the
  step verified it (j < w - 1) and reached it (j <= accepted drafts); the others keep their
  value. Beside the rows, one engine-wide row follows the batch's observed rate at each
  position more slowly: a new request starts from it (what recent requests achieved, an
  optimistic prior before any verify), and the chooser leans on it where the batch is small.
* Cost table (``CostTable``): step seconds per (batch size, width), timed at start-up on the
  dummy rows: a captured size by replays of its graphs, a batch that runs eagerly (CPU, no
  graphs, past the largest graph) by eager steps at its power-of-two size (``eager_size``)
  of three widths, the others interpolated (``eager_timed_widths``).
  Only under tensor parallelism without graphs does an analytic shape stand in (a dummy step
  on rank 0 alone would wait on the workers' collectives). From then on every step the
  engine runs is timed on the device (CUDA events around it, read with its outputs: no sync)
  and refines its entry: the dummy rows share one slot at context 0, the live batch does not,
  and its contexts grow.
* Choice (``WidthChooser``): E[w] = 1 + sum_{i < w-1} prod_{j <= i} p_j, with p the batch's
  rows pooled with ``ENGINE_WEIGHT`` rows' worth of the engine row (a lone request's coin
  flips then do not swing the width); argmax_w E[w] / step_time(b, w) over the captured
  widths. Now and then a choice takes the next wider width instead (a probe), so positions
  the chosen width never verifies (all of them at width 1) are measured again and a batch
  that fell back to plain decoding finds out when its drafts recover: at most every
  ``probe_every``-th choice, and only as often as the probes' extra step time stays within
  ``PROBE_SHARE`` of the steps' (at 128 requests a width-2 probe costs most of a width-1
  step, so it comes about every 90 steps rather than every 32). Width 1 verifies nothing, so
  once chosen its choice is revisited only by probes: it is taken only if it still wins with
  position 1's estimate raised by ``BLIND_MARGIN`` / sqrt(batch), the estimate's noise shrinking
  with the rows pooled (its effect, simulated: docs/benchmarks.md). Past batch 1, near-ties
  go to the narrower width (``TIE_MARGIN``): in a batch that finishes together the requests'
  verify counts spread more at a wider width, which costs more than the expected gain of a
  near-tie (docs/benchmarks.md); a lone request has no spread. No host sync is added: with
  launch-ahead, step k + 1 is launched before step k is read back, so its width uses the EWMA
  of step k - 1. Until the first step is read back the chooser takes the widest width: the
  prior (``PRIOR``) is a guess, and had it picked width 1 (a CPU at batch 50 prices width 8
  at 5.6 width-1 steps) no position would ever be measured; the engine row begins as a
  running mean for the same reason.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator, Sequence

import torch

# graphs captured per batch size and sampling mode when adaptive (the memory / start-up budget)
WIDTH_BUDGET = 8
# analytic step time (tensor parallelism without graphs): fixed cost 1, the draft forward's
# share, and the verify rows at which a step's compute matches its weight reads (a placeholder
# shape, not a measurement)
DRAFT_SHARE, ROWS_KNEE = 0.15, 256.0
# timed steps per cost-table entry: graph replays after an untimed one; an eager step once,
# untimed runs none (on a CPU tens of ms each, three widths at every size a batch drains
# through; the live steps refine the entry)
GRAPH_REPS, EAGER_REPS = 5, 1
LIVE_ALPHA = 0.1        # the cost table's EWMA rate over the engine's own timed steps
PRIOR = 0.8             # the engine row before any verify (every position)
ENGINE_ALPHA = 0.05     # the engine row's EWMA rate per step (the rows': 0.25)
ENGINE_PRIOR_N = 4.0    # observations the prior counts as in the engine row's first mean
ENGINE_WEIGHT = 4.0     # request rows' worth of the engine row in the chooser's pooled p
PROBE_EVERY = 32        # at most every this many choices, one width wider than the best
PROBE_SHARE = 0.01      # the probes' extra step time, as a share of the steps' time
BLIND_MARGIN = 0.1      # optimism on position 1 before plain decoding, at batch 1 (/ sqrt(bs))
TIE_MARGIN = 0.01       # a wider width must beat a narrower one's expected rate by this share


def candidate_widths(max_width: int, adaptive: bool, budget: int = WIDTH_BUDGET) -> tuple[int, ...]:
    """The widths a step may run at: W alone when fixed, else 1..W, thinned to ``budget``
    widths (denser at the low end, where acceptance decays fastest) when W is larger."""
    if not adaptive:
        return (max_width,)
    if max_width <= budget:
        return tuple(range(1, max_width + 1))
    picks = {1 + round((max_width - 1) * (i / (budget - 1)) ** 1.5) for i in range(budget)}
    return tuple(sorted(picks | {1, max_width}))


def eager_size(bs: int, max_bs: int) -> int:
    """The batch size an eager batch of ``bs`` requests is timed at: the next power of two,
    at most ``max_bs`` (its step time scales with the rows, so the widths' ratios carry over)."""
    return min(1 << max(bs - 1, 0).bit_length(), max(max_bs, bs))


def eager_timed_widths(widths: Sequence[int]) -> tuple[int, ...]:
    """The widths an eager size times by a step each: the narrowest (no draft forward), the
    next (the draft's fixed cost) and the widest. An eager step's cost grows about linearly
    in its verify rows past the draft's, so the others are interpolated
    (``CostTable.interpolate``): on a CPU the widest steps cost the most to time, and these
    three are about a third of all eight widths' time."""
    return tuple(widths) if len(widths) <= 3 else (widths[0], widths[1], widths[-1])


def expected_tokens(p: Sequence[float], width: int) -> float:
    """Expected committed tokens of a step at ``width`` given conditional per-position
    acceptance ``p`` (the bonus always commits)."""
    e, run = 1.0, 1.0
    for j in range(width - 1):
        run *= p[j]
        e += run
    return e


class AcceptanceEWMA:
    """Per slot, per draft position acceptance EWMA on the device ([slots, W - 1] fp32; the
    last slot is the dummy rows' and never feeds the engine row), and the engine row [W - 1].
    The engine row starts as the running mean of every observation, the prior counting as
    ``ENGINE_PRIOR_N`` of them, and turns into its EWMA once a step would weigh less than
    ``engine_alpha``: a prior is a guess, and one that outweighs the first verifies can hold
    the chooser at width 1, where nothing is observed. A request's row starts from the engine
    row as this step leaves it, so a batch of new requests starts from its own first rate.
    ``stop``: the end-of-sequence ids the scheduler stops on (see ``update``)."""

    def __init__(self, slots: int, positions: int, device: torch.device, alpha: float = 0.25,
                 prior: float = PRIOR, engine_alpha: float = ENGINE_ALPHA,
                 engine_prior_n: float = ENGINE_PRIOR_N, stop: Sequence[int] = ()) -> None:
        self.alpha, self.engine_alpha, self.engine_prior_n = alpha, engine_alpha, engine_prior_n
        self.table = torch.full((slots, max(positions, 1)), prior, dtype=torch.float32,
                                device=device)
        self.engine = torch.full((max(positions, 1),), prior, dtype=torch.float32, device=device)
        self.engine_n = torch.zeros_like(self.engine)    # observations of each position
        # per slot: its request has committed an end-of-sequence id (int32 0 / 1)
        self.ended = torch.zeros(slots, dtype=torch.int32, device=device)
        self.stop = torch.tensor(sorted(set(stop)), dtype=torch.long, device=device)
        self.dummy = slots - 1
        # 0 .. the widest step's last column (positions + 1 tokens)
        self._pos = torch.arange(self.table.shape[1] + 1, device=device)

    def kernel_args(self) -> dict[str, torch.Tensor | float]:
        """This state and these rates as the keyword arguments of
        ``kernels/spec_commit.spec_commit_fused``, which runs ``update`` inside its launch."""
        return {"table": self.table, "engine": self.engine, "engine_n": self.engine_n,
                "ended": self.ended, "stop": self.stop, "alpha": self.alpha,
                "engine_alpha": self.engine_alpha, "engine_prior_n": self.engine_prior_n}

    def update(self, slot: torch.Tensor, verify_ctr: torch.Tensor, accepted: torch.Tensor,
               width: int, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Fold one step (``accepted`` drafts of ``width - 1`` verified) into the rows of
        ``slot`` and into the engine row; a request's first step (``verify_ctr`` 0) starts
        from the engine row as this step leaves it. A row whose committed ``tokens`` ([B,
        width], the first ``accepted`` + 1 committed) hold a ``stop`` id observes nothing in
        this step and in the steps its request still runs after it (launched ahead before the
        host saw the end): a draft that misses the end of its answer, or the text past it, says
        nothing of the requests that go on, and at a batch's end, where most steps are such,
        those misses dragged the engine row that the next requests start from. Returns what
        the step reports, [B, 2P] fp64: the rows' new values, then the new engine row in every
        row. (A speculative step on CUDA runs this inside ``kernels/spec_commit.py``'s
        launch.)"""
        j, a = self._pos[None, :self.table.shape[1]], accepted[:, None]
        tested = (j <= a) & (j < width - 1)     # nothing at width 1: only new rows change
        done = (self.ended[slot] != 0) & (verify_ctr != 0)
        if tokens is not None:
            committed = self._pos[None, :width] <= a
            done = done | ((tokens[..., None] == self.stop).any(-1) & committed).any(1)
        self.ended[slot] = done.to(self.ended.dtype)
        tested = tested & ~done[:, None]
        hit = (j < a).to(self.engine.dtype)
        # the engine row first: the running mean of every observation (the prior counting as
        # engine_prior_n) until a step would weigh less than engine_alpha
        seen = (tested & (slot != self.dummy)[:, None]).to(hit.dtype)
        n = seen.sum(0)
        rate = (hit * seen).sum(0) / n.clamp_min(1.0)
        self.engine_n.add_(n)
        weight = (n / (self.engine_n + self.engine_prior_n)).clamp_min(self.engine_alpha)
        self.engine.add_(torch.where(n > 0, weight * (rate - self.engine), 0.0))
        prev = torch.where(verify_ctr[:, None] == 0, self.engine[None], self.table[slot])
        new = torch.where(tested, prev + self.alpha * (hit - prev), prev)
        self.table[slot] = new
        return torch.cat([new, self.engine[None].expand_as(new)], dim=1).double()


class CostTable:
    """Step seconds per (batch size, width): timed at start-up on the dummy rows (else the
    analytic shape, relative units: only ratios matter to the choice), then followed by the
    steps the engine runs (``observe``). The dummy rows are not the live batch (one shared
    slot at context 0; the live contexts grow, and with them the verify's attention), so each
    width the chooser runs or probes takes its own measured time; a width not run since takes
    its start-up time scaled by the ratio live / start-up seen at that size."""

    def __init__(self, live_alpha: float = LIVE_ALPHA) -> None:
        self.measured: dict[tuple[int, int], float] = {}
        self.live: dict[tuple[int, int], float] = {}
        self.live_alpha = live_alpha
        self._scale: dict[int, float] = {}            # per size: live / start-up
        # samples behind each live entry, and behind each size's scale as (size, 0)
        self._count: dict[tuple[int, int], int] = {}
        # the table size a (batch, width) reads, while no entry is added
        self._key: dict[tuple[int, int], int] = {}
        self._entries = 0

    @staticmethod
    def analytic(bs: int, width: int) -> float:
        return 1.0 + (DRAFT_SHARE if width > 1 else 0.0) + bs * width / ROWS_KNEE

    def measure(self, bs: int, width: int, run: Callable[[], object], device: torch.device,
                reps: int = GRAPH_REPS, warm: bool = True) -> float:
        """The median of ``reps`` timed runs of a step on the dummy rows (a graph replay or an
        eager step), after one untimed (``warm``): one slow run (a clock change, another
        process) does not skew the table."""
        def sync() -> None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)

        if warm:
            run()
            sync()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            run()
            sync()
            times.append(time.perf_counter() - t0)
        self.measured[(bs, width)] = statistics.median(times)
        return self.measured[(bs, width)]

    def interpolate(self, bs: int, widths: Sequence[int]) -> None:
        """Entries for the ``widths`` not timed at ``bs``: linear in the width between the
        nearest timed widths on either side (``eager_timed_widths``)."""
        timed = sorted(w for w in widths if (bs, w) in self.measured)
        for w in widths:
            lo = max((t for t in timed if t < w), default=None)
            hi = min((t for t in timed if t > w), default=None)
            if (bs, w) in self.measured or lo is None or hi is None:
                continue
            a, b = self.measured[(bs, lo)], self.measured[(bs, hi)]
            self.measured[(bs, w)] = a + (b - a) * (w - lo) / (hi - lo)

    def size(self, bs: int, width: int) -> int:
        """The table size a batch of ``bs`` reads: the smallest measured size >= ``bs`` with
        this width, else ``bs`` (analytic; a mix never happens: every width of a size is
        timed together)."""
        if len(self.measured) != self._entries:
            self._key.clear()
            self._entries = len(self.measured)
        got = self._key.get((bs, width))
        if got is None:
            sizes = sorted(s for s, w in self.measured if w == width and s >= bs)
            got = self._key[(bs, width)] = sizes[0] if sizes else bs
        return got

    def startup(self, bs: int, width: int) -> float:
        """The start-up time of a step (measured at its table size, else analytic)."""
        s = self.size(bs, width)
        got = self.measured.get((s, width))
        return got if got is not None else self.analytic(s, width)

    def observe(self, bs: int, width: int, seconds: float) -> None:
        """One step the engine ran, timed on the device. Its (size, width) entry averages its
        runs, the start-up time counting as one run, the last ``1 / live_alpha`` weighing most;
        the size's scale follows every run's live / start-up ratio the same way."""
        s, base = self.size(bs, width), self.startup(bs, width)
        prior = 1 if (s, width) in self.measured else 0   # analytic units are not seconds
        scale = self._scale.get(s, 1.0)
        self.live[(s, width)] = self._mean((s, width), self.live.get((s, width), base * scale),
                                           seconds, prior)
        self._scale[s] = self._mean((s, 0), scale, seconds / base, prior)

    def _mean(self, key: tuple[int, int], old: float, new: float, prior: int) -> float:
        """``old`` moved towards ``new``: a running mean (``old`` as ``prior`` samples at
        first) until ``1 / live_alpha`` samples, then an EWMA."""
        n = self._count[key] = self._count.get(key, prior) + 1
        return old + max(1.0 / n, self.live_alpha) * (new - old)

    def time(self, bs: int, width: int) -> float:
        """The step time the chooser uses: live where this width ran at this size, else the
        start-up time times the size's live / start-up scale."""
        s = self.size(bs, width)
        got = self.live.get((s, width))
        return got if got is not None else self.startup(bs, width) * self._scale.get(s, 1.0)


class WidthChooser:
    """Picks each step's width from the last read-back acceptance and the cost table.
    ``force`` (tests, benchmarks): an iterator of widths that overrides the choice; a width
    that is not a candidate runs at the largest candidate below it."""

    def __init__(self, widths: Sequence[int], cost: CostTable, prior: float = PRIOR,
                 probe_every: int = PROBE_EVERY, engine_weight: float = ENGINE_WEIGHT,
                 probe_share: float = PROBE_SHARE, blind_margin: float = BLIND_MARGIN,
                 tie_margin: float = TIE_MARGIN) -> None:
        self.widths = tuple(sorted(widths))
        self.max_width = self.widths[-1]
        self.cost = cost
        self.p = [prior] * max(self.max_width - 1, 1)
        self.probe_every, self.engine_weight = probe_every, engine_weight
        self.probe_share = probe_share
        self.blind_margin, self.tie_margin = blind_margin, tie_margin
        self.force: Iterator[int] | None = None
        self._read_back = False  # no step's acceptance read back yet: explore at the widest
        self._since_probe = 0
        self._bank = 0.0        # step time saved up for the next probe's extra cost

    def observe(self, rows: Sequence[Sequence[float]],
                engine: Sequence[float] | None = None) -> None:
        """The EWMA rows of a read-back step's requests and the engine row: per position,
        the rows' sum plus ``engine_weight`` times the engine row, over their count."""
        if not rows:
            return
        self._read_back = True
        k = self.engine_weight
        if engine is None:
            engine, k = [0.0] * len(rows[0]), 0.0
        self.p = [(sum(col) + k * e) / (len(rows) + k) for col, e in zip(zip(*rows), engine)]

    def _best(self, bs: int, p: Sequence[float]) -> int:
        """The narrowest candidate whose E[w] / step time at acceptance ``p`` is within
        ``tie_margin`` of the best one's (at batch 1 the best: one request has no spread)."""
        rates = [(w, expected_tokens(p, w) / self.cost.time(bs, w)) for w in self.widths]
        top = max(r for _, r in rates) / (1 + (self.tie_margin if bs > 1 else 0.0))
        return next(w for w, r in rates if r >= top)

    def fit(self, width: int) -> int:
        """The largest candidate width <= ``width`` (at least the smallest candidate)."""
        below = [w for w in self.widths if w <= width]
        return below[-1] if below else self.widths[0]

    def choose(self, bs: int) -> int:
        if self.force is not None:
            return self.fit(next(self.force))
        if len(self.widths) == 1:
            return self.widths[0]
        if not self._read_back:     # the prior is a guess: the first steps measure every position
            return self.max_width
        best = self._best(bs, self.p)
        if best == 1 and self.blind_margin:     # plain decoding verifies, so learns, nothing
            best = self._best(bs, [min(1.0, self.p[0] + self.blind_margin / bs ** 0.5),
                                   *self.p[1:]])
        if not self.probe_every or best == self.max_width:
            return best
        wider = self.widths[self.widths.index(best) + 1]
        t_best = self.cost.time(bs, best)
        extra = max(self.cost.time(bs, wider) - t_best, 0.0)
        self._since_probe += 1
        self._bank = min(self._bank + self.probe_share * t_best, extra)
        if self._since_probe >= self.probe_every and self._bank >= extra:
            self._since_probe, self._bank = 0, 0.0
            return wider
        return best
