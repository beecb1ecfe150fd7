"""Flush: choose a policy, schedule, and run batches through a backend."""
import time

try:
    import cython   # compiled: the local type annotations below are C declarations
except ImportError:  # pragma: no cover - Cython is an install requirement
    cython = None

from . import config, cost, schedule
from .graph import Group, Node, Ref, _sources
from .errors import ExecutionError, JitBatchError
from .stats import STATS


def _sites(batch, limit=3):
    sites = [str(n.site) for n in batch[:limit] if n.site]
    more = "" if len(batch) <= limit else " (and %d more samples)" % (len(batch) - limit)
    return "; ".join(sites) + more


def flush(graph, backend, policy="auto", budget=None, forced=False, reason="flush",
          granularity="auto"):
    """Run every pending node of ``graph``. ``backend.launch(batch)`` runs one batch
    of same-signature nodes and stores each node's ``batch``/``row``.
    ``granularity``: 'block' (a call is one node), 'split' (calls whose block
    has an input stage run it as a node of its own, see gluon/stages.py) or
    'auto' (the cost model decides per signature, under policy 'auto')."""
    if graph.executing or not graph.nodes:
        return
    limit = graph.limit       # the graph's chunk size, if pipelined (take resets it)
    nodes = graph.take()
    try:
        _flush(graph, nodes, backend, policy, budget, forced, reason, granularity,
               limit if limit < config.max_pending else None)
    finally:
        graph.done()
    chunk = reason in _CHUNKS
    graph.retire(nodes, release=forced or chunk, ends_graph=not chunk)


#: flush reasons that cut a graph whose recording goes on (pipelined chunks, max_pending)
_CHUNKS = ("pipeline", "limit")


_FIRST_PLANNED = 2   # launches whose gathers are planned before the first launch


def _flush(graph, nodes, backend, policy, budget, forced, reason, granularity, chunk_size):
    t0 = time.perf_counter()
    chosen, why, predicted, groups = (policy, "set by the user", {}, 0)
    looked = True
    if policy == "auto":
        looked = cost.MODEL.worth_looking(budget)
        if looked:
            chosen, why, predicted, groups = cost.MODEL.choose(nodes, budget)
        elif budget == 0:
            chosen, why = "sequential", "analysis budget 0: one launch per node, no analysis"
        else:
            chosen, why = "sequential", "analysis budget %g is below the cost of looking at " \
                "the graph: one launch per node, no analysis" % budget
    t_chosen = time.perf_counter()
    wait = getattr(backend, "wait", None)
    calibrate = policy == "auto" and wait is not None and cost.MODEL.calibrate_now()
    stages = None
    staged = 0
    if granularity != "block" and chosen != "sequential" and \
            getattr(backend, "stages", None) is not None:
        n0 = len(nodes)
        gran = granularity if policy == "auto" else \
            ("split" if granularity == "split" else "block")
        if gran != "block":
            nodes, stages = _granularity(
                nodes, backend.stages, gran, chosen, budget, calibrate,
                cost.MODEL.last_groups if policy == "auto" else cost.Model.depth_groups(nodes))
        staged = len(nodes) - n0
    batches = schedule.SCHEDULERS[chosen](nodes)
    padding = units = None
    for batch in batches:
        if batch[0].info.pad_axes is not None:
            batches, padding, units = _split_padded(batches)
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
    # Gathers are planned in two steps: the first launches' now, the rest once
    # those are issued, so that their kernels (asynchronous) run while the rest
    # is planned instead of after it. Both steps count as analysis.
    prepare = getattr(backend, "prepare", None)
    split = _FIRST_PLANNED if len(batches) > 2 * _FIRST_PLANNED else len(batches)
    if prepare is not None:
        prepare(batches[:split])
    t1 = time.perf_counter()
    late = 0.0      # seconds planning the later launches (inside the launch loop)
    # launch times feed the cost model only from calibrating flushes, which wait
    # for each launch's kernels (asynchronous frameworks return before them)
    calibrate = calibrate or (policy == "auto" and wait is not None and _unpriced(padding))
    graph.executing = True
    done = 0
    try:
        clock = time.perf_counter
        for batch in batches:
            if done == split and prepare is not None:
                ts = clock()
                prepare(batches[split:])
                late = clock() - ts
            ts = clock()
            backend.launch(batch)
            if calibrate:
                wait(batch)
                dt = clock() - ts
                info = batch[0].info
                rows = len(batch)
                if info.pad_axes is not None:
                    cost.MODEL.observe_padded(info, rows, units[done], dt)
                info.launch_cost += dt
                info.launches += 1
                info.launch_rows += rows
                info.launch_rr += rows * rows
                info.launch_cr += dt * rows
            done += 1
    except BaseException as e:
        for n in nodes:
            if n.batch is None:
                n.error = e
                n.inputs = ()
                n.users = None
        STATS.add(failures=1)
        if isinstance(e, JitBatchError) and not isinstance(e, ExecutionError):
            raise
        if not isinstance(e, Exception):
            raise
        b = batches[done]
        raise ExecutionError(
            "merged execution of %d call(s) to %s failed: %s: %s\n  recorded at: %s\n"
            "The pending graph was discarded; parameters are untouched and the next "
            "batch runs normally." % (len(b), b[0].info.name, type(e).__name__, e,
                                      _sites(b))) from e
    finally:
        graph.executing = False
        t2 = time.perf_counter()
        if chosen == "sequential":
            # one node per launch merges nothing: its analysis is the choice
            # itself; the per-launch bookkeeping (groups, each launch's input
            # lookup) is part of running it
            analysis, execution = t_chosen - t0, t2 - t_chosen
        else:
            analysis, execution = t1 - t0 + late, t2 - t1 - late
        STATS.add(flushes=1, forced_flushes=int(forced), auto_flushes=int(reason == "limit"),
                  pipelined_flushes=int(reason == "pipeline"),
                  launches=done, batched_nodes=sum(len(b) for b in batches[:done]),
                  analysis_seconds=analysis, execute_seconds=execution)
    if policy == "auto":
        # a flush that did not look at its graph measured no analysis
        cost.MODEL.observe(chosen, (len(nodes) - staged) if looked else 0, analysis,
                           len(batches), execution,
                           groups, calibrated=calibrate, staged=bool(staged))
        if nodes:
            cost.MODEL.observe_pipeline(nodes[0].mode, len(nodes) - staged, len(batches),
                                        reason not in _CHUNKS, calibrate)
        graph.passthrough = cost.MODEL.passthrough_after(
            len(nodes), len(batches), nothing_to_merge=(groups == len(nodes)),
            streak=graph.quiet)
        graph.quiet = graph.quiet + 1 if graph.passthrough else 0
    STATS.set_last_flush({"policy": chosen, "why": why, "nodes": len(nodes),
                          "launches": len(batches), "analysis_seconds": analysis,
                          "execute_seconds": execution, "predicted": predicted,
                          "calibrated": calibrate, "reason": reason,
                          "chunk_size": chunk_size,
                          "padding": _report(padding), "granularity": stages})


_PAD_TIMED = 8   # timed launches after which an unpriced padded signature stops calibrating


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


def _granularity(nodes, stager, granularity, policy, budget, calibrate, groups):
    """Split the calls of block signatures with an input stage into two nodes
    each (the input stage, then the rest) where ``granularity`` is 'split', or
    where under 'auto' the cost model predicts it pays (see
    ``cost.Model.split_gain``). Only signatures whose calls sit at two or more
    depths are considered (at one depth, splitting merges nothing more); they
    are found from the flush's depth groups ``groups`` ({(depth, signature):
    [first node, count]}), so a flush that splits nothing does not visit its
    nodes. Returns the nodes (input stage nodes inserted before their calls)
    and the report for stats: per considered signature, the choice and why."""
    per = {}
    for (d, info), (_, count) in groups.items():
        if info.op.stages is False:
            continue
        c = per.get(info)
        if c is None:
            per[info] = {d: count}
        else:
            c[d] = count
    report = {}
    plans = {}
    for info, depths in per.items():
        if len(depths) < 2:
            continue
        plan = stager(info, nodes)
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
        return nodes, report or None
    out = []
    for n in nodes:
        plan = plans.get(n.info)
        if plan is None:
            out.append(n)
            continue
        ins = n.inputs
        early = tuple([ins[i] for i in plan.early])
        graph = n.graph
        a = Node(plan.a_info, early, 1, n.site, n.mode, graph, n.seq, n.rows)
        d = 0
        w = 0
        for x in early:
            if isinstance(x, Ref):
                for p in _sources(x):
                    if p.batch is None and p.graph is graph:
                        w += 1
                        p.users.append(a)
                        if p.depth > d:
                            d = p.depth
        # between its producers and its call: all input stages of a signature
        # whose early inputs share a depth form one group
        a.depth = d + 0.5
        a.wait = w
        a.users = [n]
        n.wait += 1
        n.info = plan.b_info
        n.inputs = tuple([ins[i] for i in plan.late]) + plan.refs(a)
        out.append(a)
        out.append(n)
    return out, report
