"""Graph rewrites applied to the traced graph of a ``dynamic_batch`` block: kernel choice.

jitbatch owns the graph it launches, so it may choose, for each operator the
user wrote, the fastest MXNet kernel that computes the same function.

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

from mxnet import symbol as _sym

from .. import config as _config

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


def rewrite(out):
    """``(symbol, counts)``: ``out`` with the rewrites ``config`` turns on
    applied; ``counts`` maps each rewrite's name to how many operators it
    changed; ``out`` itself where nothing changed."""
    graph = json.loads(out.tojson())
    counts = {}
    if _config.fast_activations:
        counts["fast_activations"] = fast_activations(graph)
    if _config.fast_splits:
        counts["fast_splits"] = fast_splits(graph)
    counts["exact_prelu"] = exact_prelu(graph)
    counts["copied_inputs"] = copied_inputs(graph)
    if not any(counts.values()):
        return out, counts
    return _sym.load_json(json.dumps(graph)), counts


def rewrite_traced(block):
    """Apply :func:`rewrite` to ``block``'s traced graph (``_cached_graph``,
    set by MXNet's ``_get_graph``) in place; returns the counts."""
    inputs, out = block._cached_graph  # pylint: disable=protected-access
    new, counts = rewrite(out)
    if any(counts.values()):
        if type(out) is not type(new):     # traced under npx.set_np(): keep it an np symbol
            new = new.as_np_ndarray()
        block._cached_graph = (inputs, new)  # pylint: disable=protected-access
    return counts
