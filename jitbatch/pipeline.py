"""Pipelined flushes: how many chunks a large graph runs in, chosen by measuring.

A graph runs only when read, so the kernels of a big batch start after all of
its recording. Under ``policy='auto'`` a graph may run itself in chunks while
recording goes on, each chunk's kernels overlapping the next chunk's recording.
What a chunk count is worth cannot be predicted well from parts, so it is
measured per recording thread, autograd mode and network (``Pipe``, held by
``Pipelines``): one network's times say nothing of another's, which a process
may train or evaluate between its steps. Chunking needs a core free of the framework's kernels
(``kernels_leave_a_core``)."""
import os
import time

from .graph import recorder

#: nodes per launch a pipelined chunk must hold at least (see Pipe.feasible)
CHUNK_MERGE = 4
#: cycles measured per chunk count before counts are compared (median of the last PIPE_KEEP)
PIPE_SAMPLES = 3
PIPE_KEEP = 5
#: pipes kept (per recording thread, autograd mode and network), the oldest dropped
PIPES_KEPT = 64
#: cycles after which the other chunk counts are measured again (see Pipe)
PIPE_REPROBE = 256
#: more chunks are kept only if their median is this much faster than fewer chunks'
PIPE_MARGIN = 0.05
#: a cycle whose time between its graph's end and the next graph's start exceeds
#: this many times the graph's own time (first record to its last flush) is not
#: measured: other work ran between the two graphs (see Pipe)
PIPE_OUTSIDE = 3.0

def _ema(old, new):
    return new if old is None else 0.8 * old + 0.2 * new


def _middle(xs):
    """The median of a short list (the upper one of an even count)."""
    return sorted(xs)[len(xs) // 2]


class Pipe(object):
    """Per recording thread, autograd mode and network, how pipelined flushes cut a
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
    graph's first record), the first cycle after the count changed (its
    launches have sizes not run before, whose kernels the framework prepares
    on first use: measured, that made a better count look worse), and one
    where more than :data:`PIPE_OUTSIDE` times the graph's own time passed
    between its last flush and the next graph's first record: the thread did
    other work there (other models or modes timed between two steps, an
    evaluation pass without jitbatch), which is not this graph's throughput.
    One more chunk is tried only where it could pay (:meth:`may_pay`): what
    overlapping can save in the current count's cycles must exceed what the
    launches one more chunk adds cost (fixed kernel time plus Python issue
    time each). Overlap hides the smaller of the two threads' work and cannot
    make a cycle shorter than the larger: a cycle whose recording thread is
    nearly always busy (per-sample Python) or whose kernels are (a Tree-LSTM
    training step) has little to gain, however long the other one waits.

    Also kept: the mean nodes per graph (between reads: ``graph``) and
    launches per flush (``launches``), the current graph's nodes so far
    (``open``), its start time and whether its measurement stands."""
    __slots__ = ("launches", "graph", "open", "chunks", "times", "start", "valid", "last",
                 "cycles", "busy", "main", "cpu", "end", "ended")

    def __init__(self):
        self.launches = self.graph = self.start = self.last = self.cpu = self.end = None
        self.ended = None   # when the current cycle's graph's last flush ended
        self.open = 0
        self.chunks = 1
        self.times = {}
        self.busy = {}      # chunk count -> the other threads' CPU / wall of its last cycles
        self.main = {}      # chunk count -> the recording thread's CPU / wall of its last cycles
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
        """Whether one chunk more than ``c`` could pay: chunks overlap the
        recording thread's Python with the kernels (the other threads), so in
        a cycle of ``c`` chunks they save at most the smaller thread's share
        and at most what the busier one leaves idle (shares of the cycle's
        seconds), and one more chunk costs about one more set of launches
        (``launches`` x ``fixed``). True while either side is unmeasured."""
        t = self.median(c)
        kernels, main = self.busy_of(c), self.busy_of(c, self.main)
        if t is None or kernels is None or main is None or not fixed or not self.launches:
            return True
        room = min(kernels, main, 1.0 - kernels, 1.0 - main)
        return room * t * self.graph > self.launches * fixed

    def busy_of(self, c, shares=None):
        """Median share of ``c`` chunks' last cycles the other threads (the
        kernels; ``shares=self.main``: the recording thread) were busy, or None."""
        bs = (self.busy if shares is None else shares).get(c)
        return _middle(bs) if bs else None

    def size(self, c=None):
        """Nodes per chunk of the usual graph cut into ``c`` chunks (default:
        the current count); None: the graph runs whole."""
        c = self.chunks if c is None else c
        return -(-int(self.graph) // c) if c > 1 else None


class Pipelines(object):
    """Every recording thread's, autograd mode's and network's :class:`Pipe`."""

    def __init__(self):
        self.pipe = {}               # (thread, autograd mode, network) -> its Pipe

    def _key(self, mode, net):
        # a network is the number of the flags its hybridize call made
        # (BatchConfig.serial); at most PIPES_KEPT pipes, the oldest dropped
        return (recorder(), mode, net)

    def observe(self, mode, nodes, launches, ends_graph, calibrated=False, warm=True,
                net=None):
        """One 'auto' flush of ``nodes`` nodes recorded in ``mode`` (autograd
        recording, training) in ``launches`` launches; ``ends_graph``: a read
        or ``jitbatch.flush()`` ended the graph there (else it was a chunk,
        and recording goes on); ``calibrated``: it waited for every launch;
        ``warm``: not the process's first flush (which pays tracing); ``net``:
        the number of the network whose block began the graph (its flags'
        ``serial``)."""
        if not warm:
            return
        key = self._key(mode, net)   # each thread records its own graphs
        p = self.pipe.get(key)
        if p is None:
            # threads share this dict: each step is one atomic dict operation
            # (two evicting the same oldest pipe, or one iterating while another
            # inserts, failed in a serving thread pool)
            if len(self.pipe) >= PIPES_KEPT:
                self.pipe.pop(next(iter(list(self.pipe)), None), None)
            p = self.pipe.setdefault(key, Pipe())
        if nodes >= 2:
            p.launches = _ema(p.launches, launches)
        p.open += nodes
        if calibrated:
            p.valid = False
        if ends_graph:
            p.ended = time.perf_counter()
            if p.open:
                p.graph = _ema(p.graph, p.open)
            p.last = p.open if p.valid else None
            p.valid = False
            p.open = 0

    def limit(self, mode, launch_price=None, net=None):
        """Pending nodes after which a graph recorded in ``mode`` runs what it
        has while recording goes on (None: never), asked at a graph's first
        record. At the first record after a read a cycle starts: the last
        one's time is measured and the next chunk count chosen (:class:`Pipe`);
        ``launch_price``: what one more launch costs (see ``Pipe.choose``)."""
        key = self._key(mode, net)
        tid = key[0]
        p = self.pipe.get(key)
        if p is not None and p.open:
            return p.size()
        now = time.perf_counter()
        # CPU of this (recording) thread, and of the process's other threads:
        # the framework's kernels
        mine = time.thread_time()
        cpu = (time.process_time() - mine, mine)
        # a graph of another mode starts here: the ended cycles of this thread's
        # other modes end now, so a training cycle does not count the evaluation
        # run between two training steps (or the other way round)
        for (t, _, _), q in list(self.pipe.items()):
            if t == tid and q is not p and q.last and q.end is None:
                q.end = (now, cpu)
        if p is None or p.graph is None or not p.launches:
            return None
        if p.open == 0:     # the previous graph ended at a read: a cycle starts
            stop, stop_cpu = p.end if p.end is not None else (now, cpu)
            p.end = None
            inside = p.ended - p.start if p.ended is not None and p.start is not None else None
            if p.last and inside is not None and stop - p.ended <= PIPE_OUTSIDE * inside:
                ts = p.times.setdefault(p.chunks, [])
                ts.append((stop - p.start) / p.last)
                del ts[:-PIPE_KEEP]
                if stop > p.start and p.cpu is not None:
                    for shares, used, was in zip((p.busy, p.main), stop_cpu, p.cpu):
                        bs = shares.setdefault(p.chunks, [])
                        bs.append((used - was) / (stop - p.start))
                        del bs[:-PIPE_KEEP]
                p.cycles += 1
                if p.cycles % PIPE_REPROBE == 0:
                    p.times = {p.chunks: ts}
            p.cpu = cpu
            p.last = None
            c = p.choose(launch_price)
            p.start = now
            # the first cycle with another count runs launches of sizes not run
            # before, whose kernels the framework prepares then (oneDNN: per
            # shape): it is not measured
            p.valid = c == p.chunks
            p.chunks = c
        return p.size()

    def of(self, mode, net=None):
        """This thread's :class:`Pipe` of autograd mode ``mode`` and network
        ``net`` (or None)."""
        return self.pipe.get(self._key(mode, net))

    def report(self):
        """Per recording thread, autograd mode and network: the chunk count in use,
        the measured microseconds per node of each count and the share of its
        cycles the kernels and the recording thread were busy (medians of the
        last cycles)."""
        out = []
        for (_, (rec, train), _), p in sorted(self.pipe.items(), key=lambda kv: kv[0][:2]):
            if p.graph is None:
                continue
            medians = ((c, p.median(c)) for c in sorted(p.times))
            out.append({"recording": rec, "training": train, "chunks": p.chunks,
                        "chunk_size": p.size(), "graph_nodes": int(p.graph),
                        "us_per_node": {c: round(t * 1e6, 2) for c, t in medians
                                        if t is not None},
                        "kernels_busy": {c: round(p.busy_of(c), 3) for c in sorted(p.busy)},
                        "recording_busy": {c: round(p.busy_of(c, p.main), 3)
                                           for c in sorted(p.main)}})
        return out


def kernels_leave_a_core():
    """Whether MXNet's kernels leave a core to Python: pipelined flushes run a
    chunk's kernels while Python records the next, which needs one. MXNet's
    OpenMP reads ``OMP_NUM_THREADS`` once, when it loads; unset, its kernels
    use every core. Measured with two threads on two cores (runs of
    scripts/bench_tree_lstm.py --threads 2, 2026-11-23): pipelined inference
    0.41x / 0.58x of the hand-written code (default / passive OpenMP waiting)
    against 0.53x / 0.66x without."""
    try:
        threads = int(os.environ.get("OMP_NUM_THREADS", ""))
    except ValueError:
        return False
    return (os.cpu_count() or 1) > threads


#: kernels_leave_a_core(), taken when jitbatch is imported (MXNet has loaded by then)
FREE_CORE = kernels_leave_a_core()
PIPELINES = Pipelines()
