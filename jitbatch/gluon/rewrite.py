"""Graph rewrites applied to the traced graph of a ``dynamic_batch`` block.

jitbatch owns the graph it launches, so it may choose, for each operator the
user wrote, the fastest MXNet kernel that computes the same function.

``fast_activations``: MXNet's standalone elementwise ``sigmoid``, ``tanh`` and
``relu`` operators are plain loops (on this project's CPU: ``tanh`` ~18 ns per
element forward, ``sigmoid`` ~5 ns); the ``Activation`` operator computes the
same functions with oneDNN on CPU (MKLDNN builds) and cuDNN on GPU (~0.7 ns per
element). The rewrite replaces each such node by an ``Activation`` node of the
same name and inputs; the values differ from MXNet's loops by float rounding
only (a few ulp). ``jitbatch.config.fast_activations = False`` turns it off."""
import json

from mxnet import symbol as _sym

#: MXNet operator -> Activation act_type computing the same function
ACTIVATIONS = {"sigmoid": "sigmoid", "tanh": "tanh", "relu": "relu"}


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
