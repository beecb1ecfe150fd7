"""Graph rewrites applied to the traced graph of a ``dynamic_batch`` block: kernel choice.

jitbatch owns the graph it launches, so it may choose, for each operator the
user wrote, the fastest MXNet kernel that computes the same function. The
kernel choices pay on many rows and cost on one: every launch runs them
(``merged_graph``); the calls no launch merges run the block's own graph,
which keeps only the correctness rewrites (``rewrite_traced``).

``fast_activations``: MXNet's standalone elementwise ``sigmoid`` and ``tanh``
operators are plain loops (on this project's CPU: ``tanh`` ~18 ns per element
forward, ``sigmoid`` ~5 ns); the ``Activation`` operator computes the same
functions with oneDNN on CPU (MKLDNN builds) and cuDNN on GPU (~0.7 ns per
element). The rewrite replaces each such node by an ``Activation`` node of the
same name and inputs; the values differ from MXNet's loops by float rounding
only (a few ulp), NaN included. ``relu`` is not rewritten: ``Activation``'s
relu (oneDNN) turns NaN into 0 where MXNet's ``relu`` keeps it, which would
hide a diverging model. ``jitbatch.config.fast_activations = False`` turns
the rewrite off.

``fast_splits``: ``split``/``SliceChannel`` along axis ``a`` (the gates of
Gluon's ``GRUCell`` and ``LSTMCell``, ``F.split(x, 3, axis=1)`` in user cells)
copies element by element when the axes after ``a`` are few or small: MXNet's
CPU kernel views its input as (before, size, after) and ``after`` is 1 for a
split along the last axis. Splitting the same memory viewed with the axis cut
in two, (before, k, size / k * after), along the new ``k`` axis with that axis
squeezed moves the same elements in contiguous runs: the outputs are the same
arrays (copies, bit for bit), forward and backward. The rewrite inserts the
``Reshape`` (a view, run in place) in front of each such split.
``jitbatch.config.fast_splits = False`` turns it off.

``exact_prelu`` (always on: a correctness rewrite): MXNet 1.9.1's
``LeakyReLU(act_type='prelu')`` gives its ``gamma`` a wrong gradient in a
hybridized graph where its output meets another operator (a quarter of the
right one over four calls; plain ``hybridize()`` alike). Each such node
becomes ``where(x > 0, x, x * gamma)`` over ``x`` viewed as (N, C, -1) and
``gamma`` as (1, C, 1), reshaped back like ``x``: the same values, bit for
bit, and the gradients of per-sample Gluon.

``copied_inputs`` (always on: a correctness rewrite): an output that is one of
the block's inputs becomes an ``identity`` of it (see the function)."""
import json

import numpy as np

from mxnet import symbol as _sym
from mxnet.gluon.block import _flatten

from .. import config as _config
from . import _mxapi

#: MXNet operator -> Activation act_type computing the same function
ACTIVATIONS = {"sigmoid": "sigmoid", "tanh": "tanh"}
#: names of MXNet's split operator in a graph (``split`` is an alias)
SPLITS = ("SliceChannel", "split")


def fast_activations(graph):
    """Every operator of :data:`ACTIVATIONS` in the parsed ``graph`` (MXNet's
    JSON) made an ``Activation`` node, in place; returns how many."""
    count = 0
    for node in graph["nodes"]:
        act = ACTIVATIONS.get(node["op"])
        if act is None:
            continue
        attrs = dict(node.get("attrs", {}))   # scope attributes (__...__) kept
        attrs["act_type"] = act
        node["op"] = "Activation"
        node["attrs"] = attrs
        count += 1
    return count


def _true(value):
    return str(value).lower() in ("1", "true")


def _insert_before(graph, change):
    """Walk the parsed ``graph``'s nodes in order, calling ``change(node, add)``
    on each (its inputs already renumbered): it may put new nodes in front of
    it with ``add(op, name, inputs, attrs)``, which returns the new node's
    entry for an ``inputs`` list, change the node in place and return True.
    Every reference is renumbered; returns how many nodes it changed."""
    out, where = [], {}     # the new node list; old node id -> new node id

    def add(op, name, inputs, attrs=None):
        out.append({"op": op, "name": name, "attrs": attrs or {}, "inputs": inputs})
        return [len(out) - 1, 0, 0]
    count = 0
    for i, node in enumerate(graph["nodes"]):
        node["inputs"] = [[where[e[0]]] + list(e[1:]) for e in node["inputs"]]
        if change(node, add):
            count += 1
        where[i] = len(out)
        out.append(node)
    if count:
        graph["nodes"] = out
        graph["arg_nodes"] = [where[i] for i in graph["arg_nodes"]]
        graph["heads"] = [[where[h[0]]] + list(h[1:]) for h in graph["heads"]]
        graph.pop("node_row_ptr", None)   # derived: MXNet recomputes it
    return count


def _split_in_groups(node, add):
    attrs = node.get("attrs") or {}
    if node["op"] not in SPLITS or len(node["inputs"]) != 1 or \
            _true(attrs.get("squeeze_axis", "0")) or \
            int(attrs.get("axis", 1)) < 1 or int(attrs["num_outputs"]) <= 1:
        return False
    axis, parts = int(attrs.get("axis", 1)), int(attrs["num_outputs"])
    # -4 cuts the axis in (parts, rest); 0 and -2 keep the other axes
    node["inputs"] = [add("Reshape", node["name"] + "_jbgroups", [node["inputs"][0]],
                          {"shape": str((0,) * axis + (-4, parts, -1, -2))})]
    node["attrs"] = dict(attrs, squeeze_axis="True")
    return True


def fast_splits(graph):
    """A ``Reshape`` inserted in front of every split along an axis >= 1 of the
    parsed ``graph``, in place, the split made to squeeze (see the module
    docstring); returns how many. Node ids change: every reference is
    renumbered."""
    return _insert_before(graph, _split_in_groups)


def _prelu_as_where(node, add):
    attrs = node.get("attrs") or {}
    if node["op"] != "LeakyReLU" or attrs.get("act_type") != "prelu" or \
            len(node["inputs"]) != 2:
        return False
    x, gamma = node["inputs"]
    name = node["name"]
    x3 = add("Reshape", name + "_jbx", [x], {"shape": "(0, 0, -1)"})
    g3 = add("Reshape", name + "_jbgamma", [gamma], {"shape": "(1, -1, 1)"})
    pos = add("_greater_scalar", name + "_jbpos", [x3], {"scalar": "0"})
    neg = add("broadcast_mul", name + "_jbneg", [x3, g3])
    y3 = add("where", name + "_jbwhere", [pos, x3, neg])
    node["op"] = "reshape_like"
    node["attrs"] = {k: v for k, v in attrs.items() if k.startswith("__")}
    node["inputs"] = [y3, x]
    return True


def exact_prelu(graph):
    """Every ``LeakyReLU(act_type='prelu')`` of the parsed ``graph`` made the
    elementwise operators of the module docstring, in place; returns how many.
    Node ids change: every reference is renumbered."""
    return _insert_before(graph, _prelu_as_where)


def copied_inputs(graph):
    """Every output of the parsed ``graph`` that is one of its inputs (a block
    returning its argument: ``contrib.nn.Identity``, an empty
    ``HybridSequential``, ``DropoutCell(0)``) made an ``identity`` node of it,
    in place; returns how many. MXNet's CachedOp hands such an output back with
    no link in autograd's graph: every gradient before the block was lost."""
    nodes, count = graph["nodes"], 0
    for head in graph["heads"]:
        if nodes[head[0]]["op"] != "null":
            continue
        nodes.append({"op": "_copy", "name": "%s_jbcopy%d" % (nodes[head[0]]["name"], count),
                      "attrs": {}, "inputs": [[head[0], head[1], 0]]})
        head[0], head[1] = len(nodes) - 1, 0
        count += 1
    if count:
        graph.pop("node_row_ptr", None)   # derived: MXNet recomputes it
    return count


def rewrite(out, fast=True):
    """``(symbol, counts)``: ``out`` with the rewrites ``config`` turns on
    applied (``fast=False``: the correctness rewrites only); ``counts`` maps
    each rewrite's name to how many operators it changed; ``out`` itself where
    nothing changed."""
    graph = json.loads(out.tojson())
    counts = {}
    if fast and _config.fast_activations:
        counts["fast_activations"] = fast_activations(graph)
    if fast and _config.fast_splits:
        counts["fast_splits"] = fast_splits(graph)
    counts["exact_prelu"] = exact_prelu(graph)
    counts["copied_inputs"] = copied_inputs(graph)
    if not any(counts.values()):
        return out, counts
    return _sym.load_json(json.dumps(graph)), counts


#: the rewrites that choose kernels (the others make a graph exact)
KERNEL_CHOICE = ("fast_activations", "fast_splits")


def rewrite_traced(block, plain_ok=True):
    """Rewrite ``block``'s traced graph (``_cached_graph``, set by MXNet's
    ``_get_graph``) and return the counts of every rewrite. Merged launches run
    it with every rewrite (:func:`merged_graph`). Where ``plain_ok`` and the
    kernel choices changed something, the block keeps it with the correctness
    rewrites only, for the calls no launch merges (run eagerly where 'auto'
    found nothing to merge, or per sample by contract): there the kernel
    choices cost more than they save, and that graph is plain
    ``hybridize()``'s computation. Otherwise the block's own graph is the
    merged one."""
    inputs, out = block._cached_graph  # pylint: disable=protected-access
    fast, counts = rewrite(out)
    plain = None
    if plain_ok and any(counts.get(k) for k in KERNEL_CHOICE):
        plain, _ = rewrite(out, fast=False)
        if type(out) is not type(plain):    # traced under npx.set_np(): keep np symbols
            plain = plain.as_np_ndarray()
    if type(out) is not type(fast):
        fast = fast.as_np_ndarray()
    if plain is None:
        block.__dict__["_jb_fast"] = None
        own = fast
    else:
        block.__dict__["_jb_fast"] = fast
        own = plain
    block.__dict__.pop("_jb_fast_op", None)
    if own is not out:
        block._cached_graph = (inputs, own)  # pylint: disable=protected-access
    return counts


def float32_only(block, args):
    """Whether ``block``'s parameters and the arrays it is traced on (nested
    lists) are all float32. On other types its own graph stays the merged one:
    MXNet 1.9.1's CPU kernels fail on some float16 graphs of standalone
    operators ("unknown type for MKLDNN", plain ``hybridize()`` too) that the
    kernel choices avoid."""
    arrays, _ = _flatten(list(args), "input")     # as MXNet's tracing flattened them
    for a in arrays:
        if a is not None and np.dtype(a.dtype) != np.float32:
            return False
    for p in block.collect_params().values():
        if np.dtype(p.dtype) != np.float32:
            return False
    return True


def merged_graph(block):
    """The graph every launch of ``block`` runs: its traced graph with every
    rewrite (the kernel choices too), whatever the launch's size, so that a
    sample's values do not depend on what it merged with."""
    fast = block._jb_fast  # pylint: disable=protected-access
    return block._cached_graph[1] if fast is None else fast  # pylint: disable=protected-access


def merged_op(block):
    """A dynamic CachedOp of ``block``'s merged graph where it differs from the
    block's own (``_jb_fast``): for recording launches, and for inference
    launches of a shape without a static one (``executors``). Made beside the
    block's own CachedOp (which the calls no launch merges run) and remade
    with it."""
    base = block._cached_op  # pylint: disable=protected-access
    held = block.__dict__.get("_jb_fast_op")
    if held is None or held[0] is not base:
        held = block.__dict__["_jb_fast_op"] = (base, graph_op(block, merged_graph(block)))
    return held[1]


def graph_op(block, graph, static=False):
    """A CachedOp of ``graph`` (one of ``block``'s graphs: the same inputs)
    called as the block's own is, on ``block._cached_op_args``, with the
    block's flags, or (``static``) with MXNet's static memory and shapes."""
    args = block._cached_op_args  # pylint: disable=protected-access
    flags = [("data_indices", [k for k, (is_arg, _) in enumerate(args) if is_arg]),
             ("param_indices", [k for k, (is_arg, _) in enumerate(args) if not is_arg])]
    if static:
        flags += [("static_alloc", True), ("static_shape", True)] + \
            [f for f in block._flags if f[0] not in ("static_alloc", "static_shape")]  # pylint: disable=protected-access
    else:
        flags += list(block._flags)  # pylint: disable=protected-access
    return _mxapi.CachedOp(graph, flags)
