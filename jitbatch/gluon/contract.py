"""The batch-axis contract, checked: each output row of a traced block depends on its own sample's rows.

Merging concatenates the samples of a launch along axis 0 and runs the block's
graph once; that is exact only if no operator of the graph combines rows of
different samples. ``check`` proves it on the traced symbol, once per
signature, by giving every tensor a *state* and propagating it through the
graph with a rule per MXNet operator:

* ``CONST``: does not depend on the sample inputs (parameters, constants);
* an ``int`` ``a``: merged, the tensor is its samples' tensors concatenated
  along axis ``a`` (the inputs start at 0; a transpose moves it);
* a ``Mix``: some operator combines samples, or has no rule: the signature is
  unmergeable (its calls run one per sample) and the Mix says which operator
  and why.

The rules live in ``axis_rules``, a registry filled by family helpers. An
operator without a rule is a Mix: jitbatch merges only what it can prove. A
rule's result is also checked against MXNet's shape inference at the call's
shapes and at twice the rows (the per-sample axis must be the one that
doubles). The outputs must keep the samples along axis 0.

Two more contracts, on shapes alone: a ragged signature's outputs keep any
shared leading length (``rowwise_any_length``), and a zero-padded block's
outputs do not change with the padded size (``check_pad_outputs``)."""
import inspect
import json

from mxnet.util import is_np_shape

from ..errors import BatchingError, first_line
from .axis_rules import CONST, RANDOM, RULES, Facts, Refuse
from .flags import pad_names
from .rules import parse_attr


class Mix(object):
    """Why a graph cannot be merged: operator ``op`` (graph node ``node``)."""
    __slots__ = ("op", "node", "why")

    def __init__(self, op, node, why):
        self.op = op
        self.node = node
        self.why = why

    def __repr__(self):
        return "Mix(%s %s: %s)" % (self.op, self.node, self.why)


def check(out, names, shapes, training, recording=False):
    """None if merging calls of the traced symbol ``out`` (inputs ``names`` with
    per-sample ``shapes``) along axis 0 is exact, else the ``Mix`` saying which
    operator prevents it and why. ``training``, ``recording``: autograd's
    mode of the signature (BatchNorm and Dropout depend on it)."""
    graph = json.loads(out.tojson())
    nodes = graph["nodes"]
    one, two = internal_shapes(out, nodes, names, shapes)
    inputs = set(names)
    state = {}
    for j, node in enumerate(nodes):
        if node["op"] == "null":
            state[(j, 0)] = 0 if node["name"] in inputs else CONST
            continue
        ins = [state.get((i, k), CONST) for i, k, _ in node["inputs"]]
        for s in ins:
            if isinstance(s, Mix):
                return s        # the first operator that mixed is the culprit
        res = _apply(node, ins, [_shape_of(one, i, k) for i, k, _ in node["inputs"]],
                     one.get(j, []), training, recording)
        if isinstance(res, Mix):
            return res
        if res is not CONST and not _doubles(one.get(j, []), two.get(j), res):
            return Mix(node["op"], node["name"], "does not keep merged samples along axis %d "
                       "(shape inference at twice the rows)" % res)
        for k in range(max(len(one.get(j, [])), 1)):
            state[(j, k)] = res
    for h, (j, k, _) in enumerate(graph["heads"]):
        s = state.get((j, k), CONST)
        if s not in (0, CONST):
            node = nodes[j]
            return Mix(node["op"], node["name"], "leaves its samples along axis %d of output "
                       "%d; merged outputs must keep them along axis 0" % (s, h))
    return None


def _apply(node, ins, in_shapes, outs, training, recording):
    """The state of one operator node's outputs (a Mix where it combines samples)."""
    op, name = node["op"], node["name"]
    if op not in RANDOM and all(s is CONST for s in ins):
        return CONST            # computed from constants alone
    rule = RULES.get(op)
    if rule is None:
        return Mix(op, name, "has no batching rule: jitbatch cannot prove that it keeps "
                   "merged samples apart")
    attrs = {k: parse_attr(v) for k, v in node.get("attrs", {}).items()
             if not k.startswith("__")}
    try:
        return rule(Facts(attrs, in_shapes, outs, training, recording), ins)
    except Refuse as e:
        return Mix(op, name, str(e))
    except (TypeError, ValueError, IndexError, KeyError, AttributeError) as e:
        return Mix(op, name, "has attributes its batching rule does not follow (%s)" % e)


def _shape_of(table, i, k):
    outs = table.get(i)
    return tuple(outs[k]) if outs and k < len(outs) and outs[k] is not None else ()


def _doubles(outs, outs2, axis):
    """Whether every output of a node doubles along ``axis`` at twice the rows,
    its other axes unchanged (unknown shapes pass: the heads are checked by the
    caller's inference)."""
    if outs2 is None:
        return True
    for s1, s2 in zip(outs, outs2):
        if not s1 or not s2 or 0 in s1 or 0 in s2:
            continue
        if axis >= len(s1) or \
                tuple(s2) != tuple(s1[:axis]) + (2 * s1[axis],) + tuple(s1[axis + 1:]):
            return False
    return True


def internal_shapes(out, nodes, names, shapes):
    """Per node index, the shapes of its visible outputs at the call's
    per-sample shapes and at twice the rows (MXNet's shape inference on the
    symbol's internals)."""
    internals = out.get_internals()
    listed = internals.list_outputs()
    result = []
    for scale in (1, 2):
        # (only the inputs the graph uses: a name MXNet does not know left every
        # shape unknown, and a block ignoring an input was refused for a reshape)
        given = used_inputs(out, names, [(scale * s[0],) + tuple(s[1:]) for s in shapes])
        try:
            _, got, _ = internals.infer_shape_partial(**given)
        except Exception:  # pylint: disable=broad-except
            got = [None] * len(listed)
        result.append(got)
    by_name = {}
    for pos, label in enumerate(listed):
        by_name[label] = pos
    one, two = {}, {}
    for j, node in enumerate(nodes):
        nm = node["name"]
        if node["op"] == "null":
            pos = [by_name.get(nm)]
        else:
            pos = []
            if nm + "_output" in by_name:
                pos.append(by_name[nm + "_output"])
            k = 0
            while nm + "_output%d" % k in by_name:
                pos.append(by_name[nm + "_output%d" % k])
                k += 1
        one[j] = [tuple(result[0][p]) if p is not None and result[0][p] is not None else ()
                  for p in pos]
        two[j] = [tuple(result[1][p]) if p is not None and result[1][p] is not None else ()
                  for p in pos]
    return one, two


#: elementwise operators of two arrays (what NDArray's ``+ - * /`` become in a
#: traced graph) -> (the Python operator, the broadcasting operator to write)
ELEMWISE = {"_plus": ("+", "broadcast_add"), "elemwise_add": ("+", "broadcast_add"),
            "_add": ("+", "broadcast_add"), "_minus": ("-", "broadcast_sub"),
            "elemwise_sub": ("-", "broadcast_sub"), "_sub": ("-", "broadcast_sub"),
            "_mul": ("*", "broadcast_mul"), "elemwise_mul": ("*", "broadcast_mul"),
            "_div": ("/", "broadcast_div"), "elemwise_div": ("/", "broadcast_div")}


def unbroadcast_op(out, message):
    """(node name, Python operator, broadcasting operator) where MXNet's shape
    inference of traced graph ``out`` failed at an elementwise operator of two
    arrays (``Error in operator NAME:``), else None."""
    at = message.find("Error in operator ")
    if at < 0:
        return None
    name = message[at + len("Error in operator "):].split(":", 1)[0].strip()
    for node in json.loads(out.tojson())["nodes"]:
        if node["name"] == name and node["op"] in ELEMWISE:
            return (name,) + ELEMWISE[node["op"]]
    return None


#: operators holding a subgraph, through which MXNet infers no shapes
CONTROL_FLOW = ("_cond", "_while_loop", "_foreach")


def control_flow(out):
    """The ``Mix`` of the first control-flow operator of a traced symbol
    ``out``, or None."""
    for node in json.loads(out.tojson())["nodes"]:
        if node["op"] in CONTROL_FLOW:
            return Mix(node["op"], node["name"],
                       "runs a subgraph whose predicate or loop is one per launch "
                       "(merged samples would share it)")
    return None


def crossed_rows(name, shapes, k, a, b, out=None, names=None):
    """The error for an output ``k`` that at twice the rows grows along another
    axis too (``a`` -> ``b``), naming the first operator of graph ``out`` (on
    inputs ``names``) whose output does: samples that meet along another axis,
    as a broadcast of ``(1,)`` against ``(1, 1)`` (merged, ``(N,)`` against
    ``(N, 1)`` make ``(N, N)``; the arguments of all-ones shape of more than
    one axis are named, the usual culprits) or ``take`` of a per-sample index
    vector along axis 1; None for other growth."""
    if len(b) != len(a) or b[0] != 2 * a[0] or \
            not any(y == 2 * x for x, y in zip(a[1:], b[1:])):
        return None
    node = None if out is None else first_operator(out, names, shapes, lambda one, two: any(
        len(x) == len(y) and len(x) > 1 and y[0] == 2 * x[0] and
        any(q == 2 * p for p, q in zip(x[1:], y[1:])) for x, y in zip(one, two)))
    where = "" if node is None else \
        " Its operator %s (graph node %s) is the first to do so." % (node["op"], node["name"])
    ones = [i for i, s in enumerate(shapes) if len(s) > 1 and all(d == 1 for d in s)]
    culprit = (" (here argument%s %s, of shape %s)" % (
        "s" if len(ones) > 1 else "", ", ".join(map(str, ones)),
        ", ".join(str(shapes[i]) for i in ones))) if ones else ""
    # arguments whose leading axis is not one row: a (T, D) memory scored
    # against a (1, D) query by dot
    lead = [i for i, s in enumerate(shapes) if s and s[0] != 1]
    memory = ("; for an array whose rows are not samples (here argument%s %s, of shape %s: "
              "a (T, D) memory a (1, D) query is scored against with dot), a per-sample "
              "leading axis of 1 on it, (1, T, D), and F.batch_dot" % (
                  "s" if len(lead) > 1 else "", ", ".join(map(str, lead)),
                  ", ".join(str(shapes[i]) for i in lead))) \
        if lead else ""
    return ("block %s cannot be batched along axis 0: for inputs %s its output %d has shape "
            "%s, but for twice the rows it has %s: it grows along another axis too, so an "
            "operator combines arrays whose samples lie along different axes, and every "
            "sample would meet every other (a broadcast of a (1,) array against a (1, 1) one "
            "is (1, 1) per "
            "sample; merged, (N,) against (N, 1) is (N, N); take of a per-sample index "
            "vector along axis 1 picks every sample's columns from every row).%s Fix: give "
            "the arrays the block combines the same number of axes%s, e.g. reshape a (1, 1) "
            "argument to (1,) (a loss's sample_weight to the loss's shape); for columns "
            "taken by a per-sample index vector, F.pick with one index per row%s; or "
            "hybridize this block without dynamic_batch."
            % (name, shapes, k, a, b, where, culprit, memory))


def structure_changed(name, first, now, forward=None):
    """The error for a call of block ``name`` whose arguments' structure
    (Gluon's format: 0 an array, -1 None, a list a nested list) differs from
    its first call's: an argument that was None and is an array now (an
    optional mask), one left out of one of the calls (an optional argument,
    unless ``forward``, its ``hybrid_forward``, takes ``*args``), or a varying
    number of arrays."""
    def slots(fmt, path):
        if isinstance(fmt, list):
            for i, f in enumerate(fmt):
                yield from slots(f, path + (i,))
        else:
            yield path, fmt
    was, got = dict(slots(first, ())), dict(slots(now, ()))
    for path in sorted(set(was) & set(got)):
        if {was[path], got[path]} == {0, -1}:
            where = "argument %s" % ".".join(map(str, path))
            return ("block %s: %s was %s in its first call and is %s now (argument "
                    "structures %s, then %s: 0 an array, -1 None); a hybridized block keeps "
                    "one structure (plain hybridize() refuses alike). Fix: pass an array in "
                    "every call (an all-ones mask for a mask that is None), or hybridize "
                    "this block without dynamic_batch." % (
                        name, where, "None" if was[path] == -1 else "an array",
                        "an array" if got[path] == 0 else "None", first, now))
    varargs = forward is None or _takes_varargs(forward)
    for path in sorted(set(was) ^ set(got)):
        if not varargs and len(path) == 1 and was.get(path, got.get(path)) == 0:
            # an optional argument left out of one call (hr=None by default)
            return ("block %s: argument %d was %s in its first call and is %s now (argument "
                    "structures %s, then %s: 0 an array, -1 None); a hybridized block keeps "
                    "one structure (plain hybridize() refuses alike). Fix: pass an array in "
                    "every call (a zero state for a missing child), or hybridize this block "
                    "without dynamic_batch." % (
                        name, path[0], "left out" if path not in was else "an array",
                        "an array" if path in got else "left out", first, now))
    return ("block %s was first called with argument structure %s and now with %s (0 an "
            "array, -1 None, a list a nested list); a hybridized block keeps one structure. "
            "Fix: pass a varying number of arrays as one stacked array (e.g. "
            "nd.stack(*children, axis=1)), or hybridize this block without dynamic_batch."
            % (name, first, now))


def _takes_varargs(fn):
    """Whether ``fn`` takes ``*args`` (a varying number of arrays)."""
    try:
        return any(p.kind is inspect.Parameter.VAR_POSITIONAL
                   for p in inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return True


def makes_sparse(out):
    """Why traced graph ``out`` cannot run merged because it makes sparse
    storage (``cast_storage`` to row_sparse or csr: a launch hands out dense
    rows), or None."""
    text = out.tojson()
    if '"cast_storage"' not in text:
        return None
    for node in json.loads(text)["nodes"]:
        if node["op"] == "cast_storage" and \
                node.get("attrs", {}).get("stype", "default") != "default":
            return "its graph makes sparse storage (cast_storage to %s), and a launch " \
                   "hands out dense rows" % node["attrs"]["stype"]
    return None


def writes_state(out):
    """Why traced graph ``out`` cannot run deferred because a custom operator
    in it writes an auxiliary state as it runs (a running mean: its calls
    must run in program order, each at its call), or None."""
    aux = out.list_auxiliary_states()
    text = out.tojson()
    if not aux or '"Custom"' not in text:
        return None
    nodes = json.loads(text)["nodes"]
    names = set(aux)
    for node in nodes:
        if node["op"] == "Custom" and \
                any(nodes[i[0]]["op"] == "null" and nodes[i[0]]["name"] in names
                    for i in node["inputs"]):
            return "its custom operator %s (op_type %r) writes an auxiliary state as it " \
                   "runs, so its calls must run in program order, each at its call" \
                   % (node["name"], node.get("attrs", {}).get("op_type"))
    return None


def sparse_added(block, mode):
    """The ``Mix`` of a recorded block with a row_sparse gradient accumulated
    (``grad_req='add'``): MXNet's sparse embedding gradient refuses to add,
    and per sample each call's backward is its own; None otherwise."""
    if not mode[0]:
        return None
    for p in block.collect_params().values():
        if p.grad_req == "add" and p._grad_stype != "default":  # pylint: disable=protected-access
            return Mix("Embedding", p.name, "has a row_sparse gradient accumulated "
                                "(grad_req='add'), which MXNet's merged backward refuses")
    return None


def unknown_shape(shape):
    """Whether MXNet's shape inference left ``shape`` or a dimension of it
    unknown: -1 under NumPy shape semantics (``np_shape``), where 0 is a size
    (an empty set's rows), 0 otherwise."""
    if not shape:
        return True
    return -1 in shape if is_np_shape() else 0 in shape


def unknown_shape_op(out, names, shapes):
    """`` (operator X, graph node N, gives no shape)`` for the first operator of
    ``out`` whose output shape MXNet cannot infer from ``shapes``, or ''."""
    node = first_operator(out, names, shapes,
                          lambda one, _: any(unknown_shape(s) for s in one))
    return "" if node is None else \
        " (its operator %s, graph node %s, gives no shape)" % (node["op"], node["name"])


def first_operator(out, names, shapes, test):
    """The first operator node of graph ``out`` (on inputs ``names`` of
    ``shapes``) whose outputs' shapes at the call's rows and at twice the rows
    pass ``test(one, two)`` (a node of unknown shapes: ``[()]`` and ``[]``), or None."""
    nodes = json.loads(out.tojson())["nodes"]
    one, two = internal_shapes(out, nodes, names, shapes)
    for j, node in enumerate(nodes):
        if node["op"] != "null" and test(one.get(j, [()]), two.get(j, [])):
            return node
    return None


def used_inputs(out, names, values):
    """``{input name: value}`` for the inputs the traced symbol ``out`` uses: an
    input its graph does not use is not among its arguments (MXNet warns of it
    and runs the block), and MXNet's inference refuses a name it does not know."""
    used = set(out.list_arguments())
    return {nm: v for nm, v in zip(names, values) if nm in used}


def doubling_mix(out, error, names, shapes):
    """The ``Mix`` of a traced symbol ``out`` (on inputs ``names`` of
    ``shapes``) whose shapes MXNet could infer at a call's shapes but not at
    twice the rows (``error``): the operator MXNet names, if any, and the
    call's arguments it reads that it cannot take with twice the rows (a
    weight passed in, per sample)."""
    first = str(error).strip().splitlines()
    text = next((line for line in first if "Error in operator" in line), first[-1] if first
                else type(error).__name__)
    node = op = "?"
    args = fixed = []
    if "Error in operator " in text:
        node = text.split("Error in operator ", 1)[1].split(":", 1)[0].strip()
        graph = json.loads(out.tojson())["nodes"]
        me = next((n for n in graph if n["name"] == node), None)
        if me is not None:
            op = me["op"]
            # an input of the operator that reads no argument of the call (a
            # constant, a parameter) has the same rows whatever the call's: it
            # is the culprit, and every argument read beside it only looks like one
            fixed = [graph[i[0]]["name"] for i in me["inputs"]
                     if not _reads(graph, i[0]) & set(names)]
            if not fixed:
                read = _reads(graph, *[i[0] for i in me["inputs"]])
                args = [i for i, nm in enumerate(names) if nm in read and
                        not _infers(out, names, [(2 * s[0],) + tuple(s[1:]) if j == i else s
                                                 for j, s in enumerate(shapes)])]
    given = "" if not args else \
        "; here %s of the call (shape %s), which it cannot take with twice the rows: not " \
        "the sample's rows but, e.g., a weight made per sample, which merges only as a " \
        "batch of its own: a leading axis of 1 on it and F.batch_dot for the product" % (
            " and ".join("argument %d" % i for i in args),
            ", ".join(str(shapes[i]) for i in args))
    if fixed:
        given = "; here its input%s %s, which read%s no argument of the call (a constant or " \
            "a parameter: the same rows for one sample and for many; the elementwise " \
            "operators want equal shapes, F.broadcast_add / F.broadcast_mul repeat it over " \
            "the rows)" % ("s" if len(fixed) > 1 else "", " and ".join(fixed),
                          "" if len(fixed) > 1 else "s")
    return Mix(op, node, "cannot take twice the rows: it pairs each sample with an "
                        "array of fixed rows, a constant such as F.zeros((1, H)) or a "
                        "parameter of shape (K, ...)%s (MXNet: %s; to merge, give such an "
                        "array the sample's rows: F.zeros_like(x), F.broadcast_like, or "
                        "a per-sample axis of 1 before K)" % (given, text.strip()))


def _reads(graph, *starts):
    """The names of the variables (arguments, parameters) that the nodes
    ``starts`` of ``graph`` (a symbol's JSON nodes) read, through any operators."""
    read, todo = set(), list(starts)
    while todo:
        n = graph[todo.pop()]
        if n["op"] == "null":
            read.add(n["name"])
        else:
            todo.extend(i[0] for i in n["inputs"])
    return read


def shared_output(out, k, shape, names):
    """The ``Mix`` of output ``k`` of the traced symbol ``out`` (on inputs
    ``names``) whose shape (``shape``) is the same for one sample and for twice
    the rows, where it reads none of the call's arguments: it depends on no
    sample (a function of the parameters, a log-determinant of a weight), so
    merged calls would share one value where each call returns its own. None
    where it reads an argument."""
    graph = json.loads(out.tojson())
    head = graph["heads"][k][0]
    if _reads(graph["nodes"], head) & set(names):
        return None
    node = graph["nodes"][head]
    return Mix(node["op"], node["name"],
               "gives output %d, of shape %s for one sample and for twice the rows alike: "
               "it reads no sample's rows (parameters or constants alone), so it has no row "
               "per sample to merge. To merge the calls, give it the sample's rows "
               "(F.broadcast_like(v, x) for an input x of shape (1, ...), or "
               "F.broadcast_mul(F.ones_like(F.slice_axis(x, axis=1, begin=0, end=1)), v)), "
               "or compute it once outside the block" % (k, tuple(shape)))


def _infers(out, names, shapes):
    """Whether MXNet infers the shapes of ``out`` on inputs of ``shapes``."""
    try:
        out.infer_shape_partial(**used_inputs(out, names, shapes))
    except Exception:  # pylint: disable=broad-except
        return False
    return True


# -- the contracts of ragged and zero-padded signatures -------------------------------
def check_pad_outputs(block, out, names, shapes, o1, pad):
    """Outputs of a zero-padded block must not change shape with the padded size."""
    grown = [tuple(s[:pad[i]]) + (s[pad[i]] + 1,) + tuple(s[pad[i] + 1:]) if i in pad else s
             for i, s in enumerate(shapes)]
    try:
        _, o3, _ = out.infer_shape_partial(**used_inputs(out, names, grown))
    except Exception as e:
        raise BatchingError(
            "block %s: zero_pad(%s) declared, but the block cannot take inputs of shapes %s "
            "(one more along the padded axes): %s. Fix: declare only axes whose size the "
            "block takes as it comes (a sum or a masked softmax over them, e.g. children or "
            "keys), or drop the declaration: jitbatch.zero_pad(block) with no axes."
            % (block.name, pad_names(block), grown, first_line(e))) from e
    for k, (a, b) in enumerate(zip(o1, o3)):
        if tuple(a) != tuple(b):
            raise BatchingError(
                "block %s: zero_pad(%s) declared, but its output %d has shape %s for inputs "
                "%s and %s when the padded axes grow by one (%s); padding must not change "
                "the outputs' shapes. Fix: reduce over the padded axis inside the block "
                "(e.g. a sum over children), or drop the declaration with "
                "jitbatch.zero_pad(block)." % (block.name, pad_names(block), k, tuple(a),
                                               shapes, tuple(b), grown))


def rowwise_any_length(out, names, shapes, o1):
    """True if every output keeps the inputs' shared leading length L, checked by
    shape inference at L, at a length no multiple of it and at 1 (where
    ``squeeze()`` without an axis drops the leading axis too)."""
    length = shapes[0][0]
    if any(a[0] != length for a in o1):
        return False
    for other in (2 * length + 1, 1):
        if other == length:
            continue
        try:
            _, o3, _ = out.infer_shape_partial(**used_inputs(
                out, names, [(other,) + tuple(s[1:]) for s in shapes]))
        except Exception:  # pylint: disable=broad-except
            return False
        if not all(b and b[0] == other and tuple(b[1:]) == tuple(a[1:])
                   for a, b in zip(o1, o3)):
            return False
    return True
