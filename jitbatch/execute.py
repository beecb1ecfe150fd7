"""Flush: choose a policy, schedule, and run batches through a backend.

The core knows a framework only through the :class:`Backend` protocol below,
and a signature's executor (``SigInfo.op``) only as what the backend launches.
A flush runs in named phases: choose (``cost``), split calls into stages
(``granularity``), schedule (``schedule``), group, prepare the gathers,
launch, account."""
import time
import warnings

try:
    import cython   # compiled: the local type annotations below are C declarations
except ImportError:  # running from source without Cython installed
    from . import _nocython as cython

from . import config, cost, gcdefer, schedule
from .errors import BudgetWarning, ExecutionError, JitBatchError
from .graph import Group, Node
from .pipeline import PIPELINES
from .stats import STATS


class Backend(object):
    """What a flush needs from a framework. A backend subclasses this and
    overrides ``launch`` and whatever else it can do:

    ``prepare(batches)``
        Called with the flush's first batches, then the rest, before any of
        them launches: plan their input gathers (default: nothing).
    ``launch(batch)``
        Run one batch of same-signature nodes (``batch[0].info.op`` is the
        signature's executor, the backend's own object) and store each node's
        outputs (``Node.batch``; rows located by ``Node.row``/``Node.group``).
    ``wait(batch)``
        Block until a launched batch's outputs are computed: calibrating
        flushes time launches with it (``can_wait`` False: the backend cannot,
        and launches are never timed).
    ``stages(info, nodes)``
        The input-stage plan of block signature ``info`` in a flush of
        ``nodes`` (see ``granularity``), or None (default: no stages).
    """
    can_wait = False

    def prepare(self, batches):
        pass

    def launch(self, batch):
        raise NotImplementedError

    def wait(self, batch):
        pass

    def stages(self, info, nodes):
        return None


def run_graph(graph, forced=False, reason="flush", first=None):
    """Run every pending node of ``graph`` under the flags it was recorded with
    (``first``: see :func:`flush`)."""
    flush(graph, graph.backend, graph.policy or "auto", graph.budget, forced, reason,
          graph.granularity or "auto", first)


def flush(graph, backend, policy="auto", budget=None, forced=False, reason="flush",
          granularity="auto", first=None):
    """Run every pending node of ``graph`` through ``backend``. ``granularity``:
    'block' (a call is one node), 'split' (calls whose block has an input stage
    run it as a node of its own) or 'auto' (the cost model decides per
    signature, under policy 'auto'). ``first``: ids of pending nodes (with
    every node they read) that run as a flush of their own, before the rest,
    so that no launch mixes them with the others."""
    if graph.executing or not graph.nodes:
        return
    limit = graph.limit       # the graph's chunk size, if pipelined (take resets it)
    held = graph.reads        # what the pending calls read stays alive through the flush
    collecting = config.defer_gc
    if collecting:
        # before take(): a collection its allocations start would run finalizers
        # that read nodes it has taken and not yet computed
        gcdefer.pause()
    try:
        nodes = graph.take()
        chunk_size = limit if limit < config.max_pending else None
        if first is None:
            _flush(graph, nodes, backend, policy, budget, forced, reason, granularity,
                   chunk_size)
        else:
            for part in _apart(nodes, first):
                if part:
                    _flush(graph, part, backend, policy, budget, forced, reason,
                           granularity, chunk_size)
    finally:
        if collecting:
            gcdefer.resume()
        graph.done()
    chunk = reason in _CHUNKS
    graph.retire(nodes, release=(forced or chunk) and not keeps_inputs(graph, nodes),
                 ends_graph=not chunk)
    del held


def keeps_inputs(graph, nodes):
    """Whether a flush keeps its nodes' inputs past a read or a chunk (until a
    later release): nodes recorded by autograd may be reached by a later
    backward that walks them (``gluon.history.keep_unreached``, which
    releases them after a backward that frees the graph; training keeps
    their values alive anyway); not under ``jitbatch.map``, whose backwards
    are kept apart otherwise."""
    return graph.sharing is None and bool(nodes) and bool(nodes[-1].mode[0])


def _apart(nodes, first):
    """``nodes`` as the two flushes ``first`` asks for: the nodes whose ids are
    in ``first``, then the others; the others stop waiting for (and being
    users of) the first ones, which will have run."""
    ahead, rest = [], []
    for n in nodes:
        (ahead if id(n) in first else rest).append(n)
    for n in ahead:
        if n.users:
            keep = []
            for u in n.users:
                if id(u) in first:
                    keep.append(u)
                else:
                    u.wait -= 1
            n.users = keep or None
    return ahead, rest


#: flush reasons that cut a graph whose recording goes on (pipelined chunks, max_pending)
_CHUNKS = ("pipeline", "limit")

_FIRST_PLANNED = 2   # launches whose gathers are planned before the first launch


class _Flush(object):
    """What one flush decided and measured, passed from phase to phase."""
    __slots__ = ("policy", "chosen", "why", "predicted", "groups", "looked", "stages",
                 "staged", "setup", "batches", "padding", "units", "calibrate", "done",
                 "analysis", "execution")

    def __init__(self, policy):
        self.policy = policy
        self.chosen, self.why, self.predicted, self.groups = policy, "set by the user", {}, 0
        self.looked = True
        self.stages = None
        self.staged = 0
        self.setup = 0.0    # seconds of once-per-signature work (stage plans) in the analysis
        self.padding = self.units = None
        self.calibrate = False
        self.done = 0


def _flush(graph, nodes, backend, policy, budget, forced, reason, granularity, chunk_size):
    f = _Flush(policy)
    t0 = time.perf_counter()
    _choose(f, nodes, budget)
    t_chosen = time.perf_counter()
    f.calibrate = policy == "auto" and backend.can_wait and cost.MODEL.calibrate_now()
    nodes = _split_stages(f, nodes, backend, granularity, budget)
    _schedule(f, nodes)
    # Gathers are planned in two steps: the first launches' now, the rest once
    # those are issued, so that their kernels (asynchronous) run while the rest
    # is planned instead of after it. Both steps count as analysis.
    batches = f.batches
    split = _FIRST_PLANNED if len(batches) > 2 * _FIRST_PLANNED else len(batches)
    backend.prepare(batches[:split])
    t1 = time.perf_counter()
    # launch times feed the cost model only from calibrating flushes, which wait
    # for each launch's kernels (asynchronous frameworks return before them)
    f.calibrate = f.calibrate or (policy == "auto" and backend.can_wait and
                                  _unpriced(f.padding))
    graph.executing = True
    late = 0.0
    try:
        late = _launch(f, backend, split)
    except BaseException as e:
        _fail(nodes, batches, f.done, e)
    finally:
        graph.executing = False
        t2 = time.perf_counter()
        if f.chosen == "sequential":
            # one node per launch merges nothing: its analysis is the choice
            # itself; the per-launch bookkeeping (groups, each launch's input
            # lookup) is part of running it
            f.analysis, f.execution = t_chosen - t0, t2 - t_chosen
        else:
            f.analysis, f.execution = t1 - t0 + late, t2 - t1 - late
        STATS.add(flushes=1, forced_flushes=int(forced), auto_flushes=int(reason == "limit"),
                  pipelined_flushes=int(reason == "pipeline"),
                  launches=f.done, batched_nodes=sum(len(b) for b in batches[:f.done]),
                  analysis_seconds=f.analysis, execute_seconds=f.execution)
    if policy == "auto":
        _learn(f, graph, nodes, reason)
    STATS.set_last_flush({"policy": f.chosen, "why": f.why, "nodes": len(nodes),
                          "launches": len(batches), "analysis_seconds": f.analysis,
                          "execute_seconds": f.execution, "predicted": f.predicted,
                          "calibrated": f.calibrate, "reason": reason,
                          "chunk_size": chunk_size,
                          "padding": _report(f.padding), "granularity": f.stages})


def _choose(f, nodes, budget):
    """Phase 1: the policy ('auto': the cost model's choice within the budget)."""
    if f.policy != "auto":
        return
    f.looked = cost.MODEL.worth_looking(budget)
    if f.looked:
        f.chosen, f.why, f.predicted, f.groups = cost.MODEL.choose(nodes, budget)
        if f.chosen == "sequential" and budget and f.groups < len(nodes):
            _budget_fell_back(budget, True, nodes)
    elif budget == 0:
        f.chosen, f.why = "sequential", "analysis budget 0: one launch per node, no analysis"
    else:
        f.chosen, f.why = "sequential", "analysis budget %g is below the cost of looking " \
            "at the graph: one launch per node, no analysis" % budget
        _budget_fell_back(budget, False, nodes)


_BUDGETS_REPORTED = set()


def _budget_fell_back(budget, looked, nodes):
    """Say once per budget that it keeps 'auto' from batching a graph that has
    something to merge: what looking (or merging policies' analysis) measured,
    and the smallest budget that would batch (once the nodes' launches are
    timed, on a later flush if need be)."""
    if budget in _BUDGETS_REPORTED:
        return
    need = cost.MODEL.smallest_budget(looked, nodes)
    if need is None:
        return
    _BUDGETS_REPORTED.add(budget)
    what = ("merging policies' analysis measured %.3g of the predicted unbatched time"
            if looked else "looking at the graph measured %.3g of the predicted unbatched time")
    warnings.warn(
        "analysis_budget=%g keeps policy 'auto' from batching: %s (a graph of %d nodes), so "
        "its flushes run one launch per node, unbatched. Fix: hybridize with "
        "analysis_budget >= %.2g (or None for no cap)."
        % (budget, what % need, len(nodes), need * 1.25), BudgetWarning, stacklevel=4)


def _split_stages(f, nodes, backend, granularity, budget):
    """Phase 2: calls split into input stage + main stage where the granularity
    says so (see ``_granularity``); the nodes to schedule."""
    if granularity == "block" or f.chosen == "sequential":
        return nodes
    gran = granularity if f.policy == "auto" else \
        ("split" if granularity == "split" else "block")
    if gran == "block":
        return nodes
    n0 = len(nodes)
    groups = cost.MODEL.last_groups if f.policy == "auto" else cost.Model.depth_groups(nodes)
    nodes, f.stages, f.setup = _granularity(nodes, backend, gran, f.chosen, budget, f.calibrate,
                                            groups)
    f.staged = len(nodes) - n0
    return nodes


def _schedule(f, nodes):
    """Phase 3: batches in a valid order, padded signatures split by size where
    that pays, each batch's Group and its nodes' rows in it."""
    batches = schedule.SCHEDULERS[f.chosen](nodes)
    for batch in batches:
        if batch[0].info.pad_axes is not None:
            batches, f.padding, f.units = _split_padded(batches)
            break
    g: Group
    n: Node
    i: cython.Py_ssize_t
    off: cython.Py_ssize_t
    for batch in batches:
        g = Group(len(batch))
        off = 0
        i = 0
        for n in batch:
            n.row = i
            i += 1
            n.group = g
            if n.rows is not None:
                n.off = off
                off += n.rows
        g.rows = off
    f.batches = batches


def _launch(f, backend, split):
    """Phase 4: every batch launched in order (the later gathers planned once
    the first launches are issued); calibrating flushes wait for and time each
    launch. Returns the seconds spent planning the later gathers."""
    batches = f.batches
    late = 0.0
    clock = time.perf_counter
    for batch in batches:
        if f.done == split:
            ts = clock()
            backend.prepare(batches[split:])
            late = clock() - ts
        ts = clock()
        backend.launch(batch)
        if f.calibrate:
            backend.wait(batch)
            _timed(batch, clock() - ts, f.units[f.done] if f.units is not None else 0)
        f.done += 1
    return late


def _timed(batch, seconds, units):
    """One calibrated launch's time, added to its signature's measurements."""
    info = batch[0].info
    rows = len(batch)
    if info.pad_axes is not None:
        cost.MODEL.observe_padded(info, rows, units, seconds)
    info.launch_cost += seconds
    info.launches += 1
    info.launch_rows += rows
    info.launch_rr += rows * rows
    info.launch_cr += seconds * rows


def _fail(nodes, batches, done, e):
    """A launch raised: every node not run is marked failed (its lazy values
    raise when read) and the error is raised as an ExecutionError naming the
    batch and its call sites (jitbatch's own errors as they are)."""
    for n in nodes:
        if n.batch is None:
            n.error = e
            n.inputs = ()
            n.users = None
    STATS.add(failures=1)
    if isinstance(e, JitBatchError) and not isinstance(e, ExecutionError):
        raise e
    if not isinstance(e, Exception):
        raise e
    b = batches[done]
    raise ExecutionError(
        "merged execution of %d call(s) to %s failed: %s: %s\n  recorded at: %s\n"
        "The pending graph was discarded; parameters are untouched and the next "
        "batch runs normally." % (len(b), b[0].info.name, type(e).__name__, e,
                                  _sites(b))) from e


def _sites(batch, limit=3):
    sites = [str(n.site) for n in batch[:limit] if n.site]
    more = "" if len(batch) <= limit else " (and %d more samples)" % (len(batch) - limit)
    return "; ".join(sites) + more


def _learn(f, graph, nodes, reason):
    """Phase 5 under 'auto': the cost model, the pipelined-chunk search and the
    passthrough window learn from this flush."""
    # a flush that did not look at its graph measured no analysis; a signature's
    # stage plan is made once (its first flush), not per node: the policy that
    # flush ran was once priced 20x its cost per node, and not chosen again
    cost.MODEL.observe(f.chosen, (len(nodes) - f.staged) if f.looked else 0,
                       max(f.analysis - f.setup, 0.0),
                       len(f.batches), f.execution, f.groups, calibrated=f.calibrate,
                       staged=bool(f.staged))
    if nodes and not graph.unpiped:
        # (a graph a jitbatch.map's samples recorded runs unchunked, at their
        # reads: its times say nothing of the caller's own loop)
        PIPELINES.observe(nodes[0].mode, len(nodes) - f.staged, len(f.batches),
                          reason not in _CHUNKS, f.calibrate, warm=cost.MODEL.flushes >= 2,
                          net=graph.net)
    merged = f.groups < len(nodes)
    if reason in _CHUNKS:
        # a chunk of a graph still recording: the graph is judged as a whole
        # when it ends (a short last chunk that merged nothing must not send
        # the next minibatch past recording when the graph merged well)
        graph.chunk_merged = graph.chunk_merged or merged
        return
    if len(nodes) < 2 and not graph.chunk_merged:
        # a read right after one recorded call (per-sample code reading a value
        # once per sample, as a window of eager calls ended before it) tells
        # nothing about merging: the streak stays as it was and recording goes
        # on, where ending the streak made every window the smallest. A read
        # after every call, flush after flush, merges nothing: recording is
        # pure overhead there, so after SINGLE_READS such flushes in a row a
        # window of eager calls starts; always the smallest, without growing
        # the streak, so that batchable work after such a loop (training after
        # a per-sample evaluation) is recorded again within 64 calls
        graph.singles += 1
        if graph.singles >= SINGLE_READS and not graph.passthrough:
            graph.singles = 0
            graph.passthrough = cost.MODEL.passthrough_after(SINGLE_READS, SINGLE_READS)
        return
    graph.singles = 0
    graph.passthrough = cost.MODEL.passthrough_after(
        len(nodes), len(f.batches), nothing_to_merge=not (merged or graph.chunk_merged),
        streak=graph.quiet)
    graph.chunk_merged = False
    graph.quiet = graph.quiet + 1 if graph.passthrough else 0


_PAD_TIMED = 8   # timed launches after which an unpriced padded signature stops calibrating
#: one-node 'auto' flushes in a row (nothing recorded between reads) after which calls run eagerly
SINGLE_READS = 4


def _unpriced(padding):
    """Whether a zero-padded signature of this flush has no padding price yet
    though it ran before (its first flush pays first-call costs): such a flush
    calibrates too, until the signature has ``_PAD_TIMED`` timed launches, so
    its ready sets are not padded blindly for the 64 flushes to the next
    scheduled calibration."""
    if not padding:
        return False
    for r in padding.values():
        info = r["info"]
        if r["per_unit_s"] is None and info.pad_seen > 1 and \
                (info.pad_fit is None or info.pad_fit[0] < _PAD_TIMED):
            return True
    return False


def _split_padded(batches):
    """Split the batches of zero-padded signatures by size where the cost model
    says a launch costs more in padding than it saves (see
    schedule.split_padded). Returns the batches, for stats per padded signature
    its launches before and after, padded units and the prices used, and per
    launch its padded units (0 for launches of other signatures)."""
    out, units = [], []
    report = {}
    prices = {}
    for batch in batches:
        info = batch[0].info
        if info.pad_axes is None:
            out.append(batch)
            units.append(0)
            continue
        r = report.get(info.name)
        if r is None:
            p = prices[info.name] = cost.MODEL.pad_costs(info) or (None, None)
            r = report[info.name] = {"batches": 0, "launches": 0, "rows": 0, "units": 0,
                                     "fixed_s": p[0], "per_unit_s": p[1], "info": info}
            info.pad_seen += 1
        parts, kmax = schedule.split_padded(batch, *prices[info.name])
        for part, k in zip(parts, kmax):
            units.append(len(part) * k)
        r["units"] += sum(units[len(out):])
        r["batches"] += 1
        r["launches"] += len(parts)
        r["rows"] += len(batch)
        out.extend(parts)
    return out, report, units


def _report(padding):
    """The padding report as stats shows it (without the signature objects)."""
    if padding is None:
        return None
    return {name: {k: v for k, v in r.items() if k != "info"} for name, r in padding.items()}


def _granularity(nodes, backend, granularity, policy, budget, calibrate, groups):
    """Split the calls of block signatures with an input stage into two nodes
    each (the input stage, then the rest) where ``granularity`` is 'split', or
    where under 'auto' the cost model predicts it pays (see
    ``cost.Model.split_gain``). Only signatures whose calls sit at two or more
    depths are considered (at one depth, splitting merges nothing more); they
    are found from the flush's depth groups ``groups`` ({(depth, signature):
    [first node, count]}), so a flush that splits nothing does not visit its
    nodes. Returns the nodes (input stage nodes inserted before their calls),
    the report for stats (per considered signature, the choice and why) and
    the seconds spent getting the signatures' stage plans (made on a
    signature's first flush, kept after)."""
    per = {}
    for (d, info), (_, count) in groups.items():
        c = per.get(info)
        if c is None:
            per[info] = {d: count}
        else:
            c[d] = count
    report = {}
    plans = {}
    setup = 0.0
    clock = time.perf_counter
    for info, depths in per.items():
        if len(depths) < 2:
            continue
        t0 = clock()
        plan = backend.stages(info, nodes)
        setup += clock() - t0
        if plan is None:
            continue
        if granularity == "split":
            use, why, pred = True, "set by the user", None
        else:
            use, why, pred = cost.MODEL.split_gain(info, plan, depths, len(nodes), policy,
                                                   budget, calibrate)
        key = info.name if info.name not in report else \
            "%s (signature %d)" % (info.name, info.id)
        report[key] = {"granularity": "split" if use else "block", "why": why,
                       "nodes": sum(depths.values()), "predicted": pred}
        if use:
            plans[info] = plan
    if not plans:
        return nodes, report or None, setup
    out = []
    for n in nodes:
        plan = plans.get(n.info)
        if plan is None:
            out.append(n)
            continue
        ins = n.inputs
        a = n.graph.insert_producer(n, plan.a_info, tuple([ins[i] for i in plan.early]),
                                    n.site)
        n.info = plan.b_info
        n.inputs = tuple([ins[i] for i in plan.late]) + plan.refs(a)
        out.append(a)
        out.append(n)
    return out, report, setup
