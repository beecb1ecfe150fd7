"""Input stages: a block signature split in two launches' worth of graph.

A recursive cell (the Tree-LSTM's) reads two kinds of inputs: some come from
earlier calls of the same block (the children's states: *late*), the others do
not (the word vector: *early*). The part of the block's graph that depends on
early inputs only (the Tree-LSTM cell's two input projections) can run for
every call of the flush in ONE launch, across all depths, before the levels;
each level's launch then runs only the rest. Whether that pays (one more
launch and one more gathered input per level, against larger and fewer input
projections and their backward) is the cost model's call: the flush's
*granularity*, ``'block'`` (a call is one node) or ``'split'``.

This module finds the split once per block signature (on MXNet's symbol JSON:
no user code runs again) and builds the two stages as ``SymbolBlock``s that
share the block's parameters, so gradients reach the same arrays. A stage
plan is kept on the signature's executor; ``False`` there means no split
exists (every input late, nothing computed from early inputs alone, an output
that is early itself, a ragged or zero-padded early input, or a stage that
does not batch along axis 0)."""
import json

import numpy as np
from mxnet import autograd
from mxnet import ndarray as nd
from mxnet import symbol as _sym
from mxnet.base import MXNetError
from mxnet.gluon import SymbolBlock

from ..graph import _sources
from . import _mxapi
from .executors import BlockExec
from .lazy import new_lazy
from .rewrite import merged_graph
from .signatures import STAGE_IN, STAGE_MAIN, TABLE, derived_key, new_info

__all__ = ["StagePlan", "plan_for", "partition"]


class StagePlan(object):
    """How the nodes of one block signature run in two stages.

    ``early``: positions of the node's inputs the input stage reads;
    ``late``: positions the main stage still reads (early inputs the rest of the
    graph also uses directly appear here too); ``a_info``/``b_info``: the two
    stages' signatures; ``a_meta``: per input-stage output its per-sample
    (shape, dtype); ``ctx``: the signature's context."""
    __slots__ = ("early", "late", "a_info", "b_info", "a_meta", "ctx")

    def __init__(self, early, late, a_info, b_info, a_meta, ctx):
        self.early = early
        self.late = late
        self.a_info = a_info
        self.b_info = b_info
        self.a_meta = a_meta
        self.ctx = ctx

    def refs(self, anode):
        """Lazy values of the input stage node ``anode``'s outputs."""
        ctx = self.ctx
        rows = anode.rows
        if rows is None:
            return tuple([new_lazy(anode, k, m[0], m[1], ctx)
                          for k, m in enumerate(self.a_meta)])
        return tuple([new_lazy(anode, k, (rows,) + m[0][1:], m[1], ctx)
                      for k, m in enumerate(self.a_meta)])


def _late_positions(info, nodes):
    """Input positions that read, in this flush, a pending call of the same block."""
    block = info.op.block
    late = set()
    for n in nodes:
        for i, x in enumerate(n.inputs):
            if i in late or not hasattr(x, "_node"):
                continue
            for p in _sources(x):
                if p.batch is None and getattr(p.info.op, "block", None) is block:
                    late.add(i)
                    break
    return late


def partition(out, names, early):
    """Split the symbol ``out`` (input names ``names`` in order, of which
    ``early`` is a set)
    into an input stage and a main stage. Returns ``(a_sym, a_inputs, b_sym,
    b_inputs)`` (b_inputs: original input names, then the input stage's outputs
    as new variables ``_jb_stage<k>``), or None where nothing splits off."""
    js = json.loads(out.tojson())
    nodes = js["nodes"]
    inputs = set(names)
    dep = []    # 0: no data input, 1: early inputs only, 2: a late input
    for nd in nodes:
        if nd["op"] == "null":
            nm = nd["name"]
            dep.append(0 if nm not in inputs else (1 if nm in early else 2))
        else:
            d = 0
            for j, _, _ in nd["inputs"]:
                if dep[j] > d:
                    d = dep[j]
            dep.append(d)
    frontier = []       # (node, output) computed by the input stage, read by the rest
    seen = {}
    for nd, d in zip(nodes, dep):
        if nd["op"] == "null" or d != 2:
            continue
        for j, k, _ in nd["inputs"]:
            if dep[j] == 1 and nodes[j]["op"] != "null" and (j, k) not in seen:
                seen[(j, k)] = len(frontier)
                frontier.append((j, k))
    if not frontier:
        return None
    for j, _, _ in js["heads"]:
        if dep[j] == 1:
            return None     # an output computed from early inputs alone: keep one stage
    f = len(frontier)
    b_nodes = [{"op": "null", "name": "_jb_stage%d" % i, "inputs": []} for i in range(f)]
    for nd, d in zip(nodes, dep):
        nd = dict(nd)
        if nd["op"] != "null" and d == 2:
            nd["inputs"] = [[seen[(j, k)], 0, 0] if (j, k) in seen else [j + f, k, v]
                            for j, k, v in nd["inputs"]]
        else:
            nd["inputs"] = [[j + f, k, v] for j, k, v in nd["inputs"]]
        b_nodes.append(nd)
    b_js = {"nodes": b_nodes, "heads": [[j + f, k, v] for j, k, v in js["heads"]],
            "arg_nodes": [i for i, nd in enumerate(b_nodes) if nd["op"] == "null"],
            "attrs": js.get("attrs", {})}
    a_js = {"nodes": nodes, "heads": [[j, k, 0] for j, k in frontier],
            "arg_nodes": js["arg_nodes"], "attrs": js.get("attrs", {})}
    b_sym = _sym.load_json(json.dumps(b_js))
    a_sym = _sym.load_json(json.dumps(a_js))
    a_args = set(a_sym.list_arguments())
    b_args = set(b_sym.list_arguments())
    a_inputs = [nm for nm in names if nm in a_args]
    b_inputs = [nm for nm in names if nm in b_args] + ["_jb_stage%d" % i for i in range(f)]
    return a_sym, a_inputs, b_sym, b_inputs


def _stage_block(sym, inputs, metas, block):
    # inputs typed: SymbolBlock infers its parameters' types from them
    sb = SymbolBlock(sym, [_sym.var(nm, dtype=_mxapi.dtype_name(m[1])) for nm, m in zip(inputs, metas)],
                     params=block.collect_params())
    sb._flags = list(block._flags)  # pylint: disable=protected-access
    return sb


def _differentiable(sa, sb, a_in, b_in, ctx, mode):
    """Whether MXNet runs the backward of the two stages chained, tried once on
    zeros (gradients for the trial's inputs only: no parameter's gradient is
    written). MXNet 1.9 fails the backward of some graphs that read another
    recorded operator's output (``relu(FullyConnected(x)) + s``, ``s`` an input
    stage's output: "storage_type_num_unknown_nodes", apache/mxnet#14228),
    which the whole block's graph never does; such a block keeps one stage."""
    def zeros(meta):
        # any size where the signature has none: a ragged leading length, a
        # zero-padded axis
        shape = tuple((3 if k == 0 else 1) if d is None else d for k, d in enumerate(meta[0]))
        z = _mxapi.trial(shape, ctx, meta[1])
        z.attach_grad()
        return z
    a_args = [zeros(m) for m in a_in]
    b_args = [zeros(m) for m in b_in]
    try:
        with ctx, autograd.record(train_mode=mode[1]):
            a_out = sa(*a_args)
            a_out = list(a_out) if isinstance(a_out, (list, tuple)) else [a_out]
            b_out = sb(*(b_args + a_out))
            b_out = list(b_out) if isinstance(b_out, (list, tuple)) else [b_out]
            head = nd.add_n(*[o.sum() for o in b_out]) if len(b_out) > 1 else b_out[0].sum()
        for g in autograd.grad(head, a_args + b_args):
            g.wait_to_read()     # MXNet raises a kernel's error at the next wait
        return True
    except MXNetError:
        return False


def plan_for(info, nodes):
    """The stage plan of block signature ``info`` (in a flush of ``nodes``),
    found on its first flush and kept on its executor; None if it has none
    (or ``info`` is an operator's)."""
    ex = info.op
    plan = ex.stages
    if plan is None:
        mine = [n for n in nodes if n.info is info]
        plan = ex.stages = _make_plan(info, mine) or False
    return plan or None


def _make_plan(info, nodes):
    ex = info.op
    ragged = bool(info.out_meta) and info.out_meta[0][0][0] is None
    late = _late_positions(info, nodes)
    n_in = len(ex.in_meta)
    early = [i for i in range(n_in) if i not in late]
    if not late or not early:
        return None
    pad = ex.pad or {}
    if any(i in pad for i in early):
        return None
    block = ex.block
    cached = getattr(block, "_cached_graph", None)
    if not cached:
        return None
    inputs, out = cached[0], merged_graph(block)
    names = [s.name for s in inputs]
    if len(names) != n_in:
        return None
    early_names = set(names[i] for i in early)
    try:
        parts = partition(out, names, early_names)
    except Exception:  # pylint: disable=broad-except
        return None     # a graph this partitioner cannot rewrite: keep one stage
    if parts is None:
        return None
    a_sym, a_inputs, b_sym, b_inputs = parts
    pos = {nm: i for i, nm in enumerate(names)}
    a_pos = [pos[nm] for nm in a_inputs]
    b_pos = [pos[nm] for nm in b_inputs if nm in pos]
    shapes = {nm: ex.in_meta[pos[nm]][0] for nm in a_inputs}
    if ragged:     # any leading length: infer at 3 rows (and 6 below)
        shapes = {nm: (3,) + tuple(s[1:]) for nm, s in shapes.items()}
    try:
        _, o1, _ = a_sym.infer_shape_partial(**shapes)
        _, o2, _ = a_sym.infer_shape_partial(
            **{nm: (2 * s[0],) + tuple(s[1:]) for nm, s in shapes.items()})
        _, ot, _ = a_sym.infer_type(**{nm: ex.in_meta[pos[nm]][1] for nm in a_inputs})
    except Exception:  # pylint: disable=broad-except
        return None
    for a, b in zip(o1, o2):
        if not a or 0 in a or not b or b[0] != 2 * a[0] or tuple(b[1:]) != tuple(a[1:]):
            return None     # the input stage does not batch along axis 0
    a_meta = tuple(((None,) + tuple(s[1:]) if ragged else tuple(s), _mxapi.dtype_key(t))
                   for s, t in zip(o1, ot))
    if ragged and any(s[0] != 3 for s in o1):
        return None     # a ragged input stage must keep the call's rows
    a_in = tuple(ex.in_meta[i] for i in a_pos)
    b_in = tuple(ex.in_meta[i] for i in b_pos) + tuple((m[0], m[1]) for m in a_meta)
    sa = _stage_block(a_sym, a_inputs, a_in, block)
    sb = _stage_block(b_sym, b_inputs, b_in, block)
    if ex.mode[0] and not _differentiable(sa, sb, a_in, b_in[:len(b_pos)], ex.ctx, ex.mode):
        return None
    b_pad = {b_pos.index(i): axis for i, axis in pad.items() if i in b_pos} or None
    # the stages' blocks live as long as their signatures (nothing else holds them)
    a_ex = BlockExec(sa, [0] * len(a_in), a_in, a_meta, ex.ctx, ex.mode, weak=False)
    b_ex = BlockExec(sb, [0] * len(b_in), b_in, info.out_meta, ex.ctx, ex.mode, b_pad,
                     weak=False)
    a_ex.stages = b_ex.stages = False
    # keys derived from the block's (measurements carry over when the block is
    # hybridized again: signatures.new_info); the input stage's key holds only
    # what it reads (and the device), so calls of the block that differ in
    # late inputs (e.g. their child count) share its launch
    k = info.key
    a_key = derived_key(STAGE_IN, k, tuple(a_pos), a_in, ex.mode, ragged, ex.ctx)
    b_key = derived_key(STAGE_MAIN, k, k[0], *k[3:])
    a_info = TABLE.get(a_key) or TABLE.add(
        a_key, lambda sid: new_info(sid, a_key, a_ex, a_meta, True, info.name + "[input stage]"))
    b_info = TABLE.add(b_key, lambda sid: new_info(sid, b_key, b_ex, info.out_meta, True,
                                                   info.name + "[main stage]"))
    if b_pad:
        # a call keeps its node (and the size it was recorded with) as the main stage
        b_info.pad_axes = tuple(sorted(b_pad.items()))
    return StagePlan(tuple(a_pos), tuple(b_pos), a_info, b_info, a_meta, ex.ctx)
