"""Graph rewrites applied to the traced graph of a ``dynamic_batch`` block.

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
the rewrite off."""
import json

from mxnet import symbol as _sym

#: MXNet operator -> Activation act_type computing the same function
ACTIVATIONS = {"sigmoid": "sigmoid", "tanh": "tanh"}


def fast_activations(out):
    """``(symbol, count)``: ``out`` with every operator of :data:`ACTIVATIONS`
    run as ``Activation`` (``count`` of them); ``out`` itself when none is."""
    graph = json.loads(out.tojson())
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
    if not count:
        return out, 0
    return _sym.load_json(json.dumps(graph)), count


def rewrite_traced(block):
    """Apply :func:`fast_activations` to ``block``'s traced graph
    (``_cached_graph``, set by MXNet's ``_get_graph``) in place; returns how
    many operators it swapped."""
    inputs, out = block._cached_graph  # pylint: disable=protected-access
    out, count = fast_activations(out)
    if count:
        block._cached_graph = (inputs, out)  # pylint: disable=protected-access
    return count
