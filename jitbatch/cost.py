"""Cost model: which policy a flush under ``policy='auto'`` uses, and why.

Everything is measured as jitbatch runs, nothing is a constant tuned to one
machine (the starting values are only priors, replaced by the first
measurements):

* per signature, launch time as a function of its rows: a least-squares line
  ``a + b * rows`` over the launches of *calibrating* flushes (the 2nd and 3rd
  flush under 'auto', then every 64th), which wait for each launch's kernels
  and so time gathers, call, kernels and bookkeeping (a calibrating flush costs
  ~20% more: Python no longer runs ahead of the kernels); the mean per launch
  until rows have varied, and the mean over all timed launches for a signature
  not timed yet. Other flushes do not wait: MXNet computes asynchronously, so
  timing them on the Python side would leave out the kernels (it did, and
  'auto' then preferred cheaper analysis over fewer launches where the fewer
  launches were measured 10% faster);
* per policy, analysis seconds per node (scheduling and gather planning);
* how many launches the agenda saves over depth grouping, learned from every
  flush that ran the agenda (depth groups are counted on every flush: O(N)).

A flush predicts, for each policy, analysis + execution time, drops the
policies whose analysis at its slowest per node of their last 8 flushes
exceeds ``analysis_budget`` x the predicted UNBATCHED execution time (one
launch per node: the time batching is there to save; the budget is a cap, so
the mean would let half the flushes over it), and runs the cheapest that is
left (``sequential``, which needs no analysis, is always allowed). The agenda is predicted to save, per launch it
merges away, that signature's fixed cost ``a``. If no two nodes share (depth,
signature), nothing can merge and ``sequential`` runs without further
analysis."""
import threading
import time

try:
    import cython   # compiled: the local type annotations below are C declarations
except ImportError:  # pragma: no cover - Cython is an install requirement
    cython = None

from .graph import Node


#: nodes per launch a pipelined chunk must hold at least (see Pipe.feasible)
CHUNK_MERGE = 4
#: cycles measured per chunk count before counts are compared (median of the last PIPE_KEEP)
PIPE_SAMPLES = 3
PIPE_KEEP = 5
#: cycles after which the other chunk counts are measured again (see Pipe)
PIPE_REPROBE = 256
#: more chunks are kept only if their median is this much faster than fewer chunks'
PIPE_MARGIN = 0.05


def _ema(old, new):
    return new if old is None else 0.8 * old + 0.2 * new


def _middle(xs):
    """The median of a short list (the upper one of an even count)."""
    return sorted(xs)[len(xs) // 2]


class Pipe(object):
    """Per recording thread and autograd mode, how pipelined flushes cut a
    graph, chosen by measuring.

    A *cycle* runs from one graph's first record to the next graph's: the
    throughput a user sees, kernels, waits and the user's own Python included.
    Each cycle runs with ``chunks`` chunks (1: whole) and adds its seconds per
    node to that count's last few measurements (:data:`PIPE_KEEP`); the
    fewest chunks whose median is within :data:`PIPE_MARGIN` of the least is
    kept, and a neighbour not measured yet is tried while the current count is
    the one kept (one more chunk first): more chunks are tried only while
    each step paid. Every :data:`PIPE_REPROBE` cycles the other counts'
    measurements are dropped, so they are measured again as things change.
    Not measured: a cycle with a calibrating flush (it waits for every
    launch), one that did not start here (the chunk size is asked for at a
    graph's first record), and the first cycle after the count changed (its
    launches have sizes not run before, whose kernels the framework prepares
    on first use: measured, that made a better count look worse).
    One more chunk is tried only where it could pay (:meth:`may_pay`): the
    time the kernels (the process's other threads) waited in the current
    count's cycles, at most what chunks can fill, must exceed what the
    launches one more chunk adds cost (fixed kernel time plus Python issue
    time each; a Tree-LSTM training step, kernels ~93-99% busy: ~2 ms to
    fill against ~4-5 ms of added launches; it measured 1.4-2x slower in two
    chunks).

    Also kept: the mean nodes per graph (between reads: ``graph``) and
    launches per flush (``launches``), the current graph's nodes so far
    (``open``), its start time and whether its measurement stands."""
    __slots__ = ("launches", "graph", "open", "chunks", "times", "start", "valid", "last",
                 "cycles", "busy", "cpu")

    def __init__(self):
        self.launches = self.graph = self.start = self.last = self.cpu = None
        self.open = 0
        self.chunks = 1
        self.times = {}
        self.busy = {}      # chunk count -> the other threads' CPU / wall of its last cycles
        self.valid = False
        self.cycles = 0

    def feasible(self, c):
        """Whether ``c`` chunks of the usual graph each hold two nodes or more
        and at least ``CHUNK_MERGE`` nodes per launch: in a small graph or a
        chain a chunk would merge little or nothing (and a flush that merges
        nothing sends the next calls past recording)."""
        if c == 1:
            return True
        n = self.size(c)
        return n >= 2 and n >= CHUNK_MERGE * self.launches

    def median(self, c):
        ts = self.times.get(c)
        if not ts or len(ts) < PIPE_SAMPLES:
            return None
        return _middle(ts)

    def choose(self, fixed=None):
        """The chunk count of the next cycle (see the class docstring);
        ``fixed``: what one more launch costs, its mean fixed kernel seconds
        (``Model.fixed_launch``) plus the Python seconds to issue it
        (``Model.issue``)."""
        c = self.chunks
        while not self.feasible(c):
            c -= 1
        if c != self.chunks or self.median(c) is None:
            return c
        known = {}
        for k in self.times:
            t = self.median(k)
            if t is not None and self.feasible(k):
                known[k] = t
        # the fewest chunks within PIPE_MARGIN of the fastest: more chunks must
        # pay clearly (on a flat, noisy curve the search stays near 1)
        least = min(known.values())
        best = min(k for k, t in known.items() if t <= least * (1.0 + PIPE_MARGIN))
        if best != c:
            return best
        for k in (c + 1, c - 1):
            if k >= 1 and k not in known and self.feasible(k):
                if k > c and not self.may_pay(c, fixed):
                    continue
                return k
        return c

    def may_pay(self, c, fixed):
        """Whether one chunk more than ``c`` could pay: chunks overlap Python
        with kernels, so the most they save is the time the kernels waited in
        a cycle of ``c`` chunks (its seconds times the share the other threads
        were idle), and one more chunk costs about one more set of launches
        (``launches`` x ``fixed``). True while either side is unmeasured."""
        t = self.median(c)
        busy = self.busy_of(c)
        if t is None or busy is None or not fixed or not self.launches:
            return True
        return (1.0 - busy) * t * self.graph > self.launches * fixed

    def busy_of(self, c):
        """Median share of ``c`` chunks' last cycles the other threads (the
        kernels) were busy, or None."""
        bs = self.busy.get(c)
        return _middle(bs) if bs else None

    def size(self, c=None):
        """Nodes per chunk of the usual graph cut into ``c`` chunks (default:
        the current count); None: the graph runs whole."""
        c = self.chunks if c is None else c
        return -(-int(self.graph) // c) if c > 1 else None


class Model(object):
    def __init__(self):
        self.analysis = {"depth": 3e-6, "agenda": 8e-6, "sequential": 1e-7}
        self.analysis_recent = {}    # policy -> its last ANALYSIS_KEEP per-node analysis times
        self.launch = 3e-4           # mean seconds per launch, all signatures
        self.agenda_ratio = 0.7      # agenda launches / depth groups
        self._measured = set()       # which priors a measurement has replaced
        self.flushes = 0             # 'auto' flushes so far (calibrate_now counts them)
        self.unbatched = None        # predicted one-launch-per-node seconds of this flush
        self.unbatched_node = None   # and per node
        self.last_groups = {}        # its depth groups (see depth_groups)
        self.pipe = {}               # (thread, autograd mode) -> pipelining measurements
        self.fixed_launch = None     # mean fixed seconds of a launch of the last flush chosen
        self.issue = None            # seconds to issue a launch (flushes that do not wait)

    def calibrate_now(self):
        """Whether this 'auto' flush waits for and times every launch: the 2nd
        and 3rd (the 1st pays first-call costs), then every 64th. A signature
        not timed yet is predicted by the mean over the timed launches."""
        self.flushes += 1
        return self.flushes in (2, 3) or self.flushes % 64 == 0

    def _update(self, name, old, new):
        if name not in self._measured:
            self._measured.add(name)
            return new
        return 0.8 * old + 0.2 * new

    def observe(self, policy, nodes, analysis_s, launches, execute_s, depth_groups,
                calibrated=True, staged=False):
        if nodes:
            # a flush that split calls into stages is its own analysis entry:
            # the split's extra nodes and gathers are what 'auto' weighs
            key = policy + "+split" if staged else policy
            self.analysis[key] = self._update(key, self.analysis.get(key, 0.0),
                                              analysis_s / nodes)
            recent = self.analysis_recent.setdefault(key, [])
            recent.append(analysis_s / nodes)
            del recent[:-ANALYSIS_KEEP]
        if launches and calibrated:
            self.launch = self._update("launch", self.launch, execute_s / launches)
        elif launches:
            # not waiting for kernels: the Python time to issue a launch
            self.issue = self._update("issue", self.issue or 0.0, execute_s / launches)
        if policy == "agenda" and depth_groups:
            self.agenda_ratio = self._update("ratio", self.agenda_ratio,
                                             launches / depth_groups)

    def worth_looking(self, budget):
        """Whether a flush under ``budget`` (not None) may look at its graph at
        all: even counting what could merge costs a flush the analysis of a
        sequential one per node, and the budget (a fraction of the unbatched
        execution, per node as on the last flush) may be smaller than that.
        True until both are measured."""
        if budget is None:
            return True
        if not budget:
            return False
        per = self.unbatched_node
        if per is None or "sequential" not in self.analysis_recent:
            return True
        return self.analysis_high("sequential") <= budget * per

    def analysis_high(self, key):
        """Seconds per node of ``key``'s analysis at its slowest of the last
        :data:`ANALYSIS_KEEP` flushes (the prior while none was measured)."""
        recent = self.analysis_recent.get(key)
        return max(recent) if recent else self.analysis[key]

    def launch_cost(self, info, rows=1):
        """Predicted seconds of one launch of ``info`` over ``rows`` nodes
        (``rows=0``: the fixed cost of a launch)."""
        n = info.launches
        if not n:
            return self.launch
        sr, sc = info.launch_rows, info.launch_cost
        den = n * info.launch_rr - sr * sr
        if n < 3 or den <= 0:
            return sc / n
        b = max((n * info.launch_cr - sc * sr) / den, 0.0)
        a = max((sc - b * sr) / n, 0.0)
        return a + b * rows

    @staticmethod
    def observe_padded(info, rows, units, seconds):
        """One timed launch of a zero-padded signature: ``rows`` nodes padded to
        ``units`` = rows x the largest size (sums for a least-squares plane)."""
        f = info.pad_fit
        if f is None:
            f = info.pad_fit = [0.0] * 9
        f[0] += 1
        f[1] += rows
        f[2] += units
        f[3] += seconds
        f[4] += rows * rows
        f[5] += rows * units
        f[6] += units * units
        f[7] += seconds * rows
        f[8] += seconds * units

    def pad_costs(self, info):
        """(fixed seconds per launch, seconds per padded unit) of a zero-padded
        signature: the plane ``a + b * rows + c * units`` fitted to its timed
        launches (units: rows x the launch's largest size), or None while the
        launches timed so far cannot tell ``c`` apart (then nothing is split:
        padding all into one launch is what ran before). ``b`` is the same for
        every split of a batch and drops out."""
        f = info.pad_fit
        if f is None or f[0] < 4:
            return None
        m = [[f[0], f[1], f[2], f[3]],
             [f[1], f[4], f[5], f[7]],
             [f[2], f[5], f[6], f[8]]]
        det = (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
               - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
               + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))
        if det <= 1e-9 * m[0][0] * m[1][1] * m[2][2]:
            return None     # rows and units moved together: no padding cost seen
        for col in range(3):                 # Gaussian elimination, partial pivoting
            piv = max(range(col, 3), key=lambda r: abs(m[r][col]))
            m[col], m[piv] = m[piv], m[col]
            for r in range(3):
                if r != col:
                    q = m[r][col] / m[col][col]
                    for c in range(col, 4):
                        m[r][c] -= q * m[col][c]
        a = m[0][3] / m[0][0]
        c = m[2][3] / m[2][2]
        if c <= 0:
            return None
        return max(a, 0.0), c

    @staticmethod
    def depth_groups(nodes):
        """{(depth, signature): [first node, node count]} - the launches of
        depth grouping and their sizes."""
        groups = {}
        n: Node
        for n in nodes:
            k = (n.depth, n.info)
            g = groups.get(k)
            if g is None:
                groups[k] = [n, 1]
            else:
                g[1] += 1
        return groups

    def choose(self, nodes, budget):
        """Return ``(policy, reason, predictions, depth group count)``."""
        n = len(nodes)
        groups = self.last_groups = self.depth_groups(nodes)
        if n <= 1 or len(groups) == n:
            return "sequential", "no two nodes can run together: nothing to merge", {}, len(groups)
        lc = self.launch_cost
        exec_seq = exec_depth = fixed = 0.0
        for first, count in groups.values():
            exec_seq += lc(first.info, 1) * count
            exec_depth += lc(first.info, count)
            fixed += lc(first.info, 0)
        pred = {
            "sequential": (self.analysis["sequential"] * n, exec_seq),
            "depth": (self.analysis["depth"] * n, exec_depth),
            # the same rows in fewer launches: each merged-away launch saves its fixed cost
            "agenda": (self.analysis["agenda"] * n,
                       exec_depth - (1.0 - min(self.agenda_ratio, 1.0)) * fixed),
        }
        self.unbatched = exec_seq
        self.unbatched_node = exec_seq / n
        self.fixed_launch = fixed / len(groups)
        # the budget is a cap: a policy is allowed if its analysis stays within
        # it even at the slowest per node of its last flushes (the mean predicts
        # the cost; flushes vary around it)
        allowed = [p for p in pred if p == "sequential" or budget is None
                   or self.analysis_high(p) * n <= budget * exec_seq]
        best = min(allowed, key=lambda p: sum(pred[p]))
        if len(allowed) < len(pred):
            why = "cheapest predicted within analysis budget %g" % budget
        else:
            why = "cheapest predicted (analysis + execution)"
        return best, why, {p: {"analysis": a, "execute": e} for p, (a, e) in pred.items()}, len(groups)

    def split_gain(self, info, plan, depths, nodes, policy, budget, calibrate):
        """Whether the calls of block signature ``info`` (``depths``: their count
        per depth, in a flush of ``nodes`` nodes scheduled by ``policy``) run
        their input stage as one
        launch of its own. Predicted per depth group: the block's launches
        against one input-stage launch over all of them plus the main stage's
        launches, plus the measured extra analysis per node of flushes that
        split. Until both stages are timed, a calibrating flush splits (once
        the block itself is timed) to time them. Returns (split?, why,
        predictions)."""
        a_info, b_info = plan.a_info, plan.b_info
        if not info.launches:
            return False, "block launches not timed yet", None
        if not a_info.launches or not b_info.launches:
            if calibrate:
                return True, "timing the split (calibrating flush)", None
            return False, "split not timed yet (next calibrating flush)", None
        lc = self.launch_cost
        block = split = 0.0
        for c in depths.values():
            block += lc(info, c)
            split += lc(b_info, c)
        split += lc(a_info, sum(depths.values()))
        an = self.analysis
        key = policy + "+split"
        extra = max(an.get(key, an[policy]) - an[policy], 0.0) * nodes
        pred = {"block": {"execute": block},
                "split": {"execute": split, "extra_analysis": extra}}
        if budget is not None and self.unbatched is not None and \
                (self.analysis_high(key) if key in an else self.analysis_high(policy)) \
                * nodes > budget * self.unbatched:
            return False, "split analysis over budget %g" % budget, pred
        if split + extra < block:
            return True, "cheaper predicted (input stage merged across %d depths)" \
                % len(depths), pred
        return False, "block cheaper predicted", pred

    def observe_pipeline(self, mode, nodes, launches, ends_graph, calibrated=False):
        """One 'auto' flush of ``nodes`` nodes recorded in ``mode`` (autograd
        recording, training) in ``launches`` launches; ``ends_graph``: a read
        or ``jitbatch.flush()`` ended the graph there (else it was a chunk,
        and recording goes on); ``calibrated``: it waited for every launch."""
        if self.flushes < 2:
            return      # the process's first flush pays tracing
        key = (threading.get_ident(), mode)   # each thread records its own graphs
        p = self.pipe.get(key)
        if p is None:
            p = self.pipe[key] = Pipe()
        if nodes >= 2:
            p.launches = _ema(p.launches, launches)
        p.open += nodes
        if calibrated:
            p.valid = False
        if ends_graph:
            if p.open:
                p.graph = _ema(p.graph, p.open)
            p.last = p.open if p.valid else None
            p.valid = False
            p.open = 0

    def pipeline_limit(self, mode):
        """Pending nodes after which a graph recorded in ``mode`` runs what it
        has while recording goes on (None: never), asked at a graph's first
        record. At the first record after a read a cycle starts: the last
        one's time is measured and the next chunk count chosen (:class:`Pipe`)."""
        p = self.pipe.get((threading.get_ident(), mode))
        if p is None or p.graph is None or not p.launches:
            return None
        if p.open == 0:     # the previous graph ended at a read: a cycle starts
            now = time.perf_counter()
            # CPU of the process's other threads: the framework's kernels
            cpu = time.process_time() - time.thread_time()
            if p.last and p.start is not None:
                ts = p.times.setdefault(p.chunks, [])
                ts.append((now - p.start) / p.last)
                del ts[:-PIPE_KEEP]
                if now > p.start and p.cpu is not None:
                    bs = p.busy.setdefault(p.chunks, [])
                    bs.append((cpu - p.cpu) / (now - p.start))
                    del bs[:-PIPE_KEEP]
                p.cycles += 1
                if p.cycles % PIPE_REPROBE == 0:
                    p.times = {p.chunks: ts}
            p.cpu = cpu
            p.last = None
            per = None if self.fixed_launch is None or self.issue is None else \
                self.fixed_launch + self.issue
            c = p.choose(per)
            p.start = now
            # the first cycle with another count runs launches of sizes not run
            # before, whose kernels the framework prepares then (oneDNN: per
            # shape): it is not measured
            p.valid = c == p.chunks
            p.chunks = c
        return p.size()

    def pipe_of(self, mode):
        """This thread's :class:`Pipe` of autograd mode ``mode`` (or None)."""
        return self.pipe.get((threading.get_ident(), mode))

    def pipeline_report(self):
        """Per recording thread and autograd mode: the chunk count in use and
        the measured microseconds per node of each count (median of the last
        cycles)."""
        out = []
        for (_, (rec, train)), p in sorted(self.pipe.items()):
            if p.graph is None:
                continue
            medians = ((c, p.median(c)) for c in sorted(p.times))
            out.append({"recording": rec, "training": train, "chunks": p.chunks,
                        "chunk_size": p.size(), "graph_nodes": int(p.graph),
                        "us_per_node": {c: round(t * 1e6, 2) for c, t in medians
                                        if t is not None},
                        "kernels_busy": {c: round(p.busy_of(c), 3) for c in sorted(p.busy)}})
        return out

    @staticmethod
    def passthrough_after(nodes, launches, nothing_to_merge=True, streak=0):
        """Calls to run eagerly (unrecorded) after an 'auto' flush in which no
        two nodes could run together: recording would be pure overhead. Bounded,
        so batchable work that follows is recorded again soon (the next flush
        re-checks): 4x the flush's nodes, at least 64, doubled for each flush
        before it in a row that found the same (``streak``) up to 4096 calls, so
        a long run of unmergeable work records ever less of itself. Not after a
        flush the budget kept sequential."""
        if not nothing_to_merge or launches < nodes or nodes < 2:
            return 0
        base = max(64, 4 * nodes)
        return max(base, min(base << min(streak, 8), PASSTHROUGH_CAP))


#: flushes whose analysis per node the budget check takes the slowest of
ANALYSIS_KEEP = 8
PASSTHROUGH_CAP = 4096   # most calls run eagerly between two re-checks (grown windows)
MODEL = Model()
