"""The batch-axis contract, checked: does each output row of a traced block depend
on its own sample's rows only?

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

Rules are registered per operator name by family helpers, as in ``rules``. An
operator without a rule is a Mix: jitbatch merges only what it can prove. A
rule's result is also checked against MXNet's shape inference at the call's
shapes and at twice the rows (the per-sample axis must be the one that
doubles). The outputs must keep the samples along axis 0."""
import json

from .rules import parse_attr

CONST = None

#: operator name -> rule(Facts of the node, input states) -> state
RULES = {}
#: operators whose rule runs even on constant inputs (their draws are per launch)
_RANDOM = {"Dropout"}


class Mix(object):
    """Why a graph cannot be merged: operator ``op`` (graph node ``node``)."""
    __slots__ = ("op", "node", "why")

    def __init__(self, op, node, why):
        self.op = op
        self.node = node
        self.why = why

    def __repr__(self):
        return "Mix(%s %s: %s)" % (self.op, self.node, self.why)


class Facts(object):
    """What a rule may read about one operator node: its attributes (parsed),
    the per-sample shapes of its inputs and outputs (``ins``, ``outs``), and
    whether the signature runs in training mode."""
    __slots__ = ("attrs", "ins", "outs", "training")

    def __init__(self, attrs, ins, outs, training):
        self.attrs = attrs
        self.ins = ins
        self.outs = outs
        self.training = training

    def get(self, name, default=None):
        v = self.attrs.get(name, default)
        return default if v == "None" else v


class _Refuse(Exception):
    """Raised by a rule: the operator combines samples (the message says how)."""


def _norm(axis, rank):
    axis = int(axis)
    return axis + rank if axis < 0 else axis


def _axes(value, rank):
    if value is None or value == ():
        return None
    seq = value if isinstance(value, (tuple, list)) else (value,)
    return tuple(_norm(a, rank) for a in seq)


def _data(states):
    """The non-constant input states (all ints: a Mix never reaches a rule)."""
    return [s for s in states if s is not CONST]


# -- families ----------------------------------------------------------------------------
def elementwise(names):
    """Operators that pair equally placed elements (NumPy broadcasting, shapes
    aligned to the right): every data input must keep its samples on the same
    output axis."""
    def rule(f, states):
        rank = len(f.outs[0])
        axes = set()
        for st, shape in zip(states, f.ins):
            if st is not CONST:
                axes.add(st + rank - len(shape))
        if len(axes) != 1:
            raise _Refuse("pairs elements of tensors whose samples lie along different axes")
        return axes.pop()
    for name in names.split():
        RULES[name] = rule


def reduction(names, attr="axis"):
    """Reductions over ``attr`` (every axis when absent): refused where the
    per-sample axis is reduced."""
    def rule(f, states):
        a = _data(states)[0]
        rank = len(f.ins[0])
        axes = _axes(f.get(attr), rank)
        if axes is None:
            axes = tuple(range(rank))
        if f.get("exclude"):
            axes = tuple(i for i in range(rank) if i not in axes)
        if a in axes:
            raise _Refuse("reduces over axis %d, the axis along which merged samples lie"
                          % a)
        return a if f.get("keepdims") else a - sum(1 for i in axes if i < a)
    for name in names.split():
        RULES[name] = rule


def along(name, attr, default, keeps_rank=True):
    """An operator acting along one axis ``attr`` (``default`` when absent;
    None: the flattened array): refused along the per-sample axis."""
    def rule(f, states):
        a = _data(states)[0]
        axis = f.get(attr, default)
        if axis is None:
            raise _Refuse("acts on the flattened array, across merged samples")
        axis = _norm(axis, len(f.ins[0]))
        if axis == a:
            raise _Refuse("acts along axis %d, the axis along which merged samples lie" % a)
        return a if keeps_rank or axis > a else a - 1
    RULES[name] = rule


def batch_first(names):
    """Operators that treat axis 0 as independent instances (convolutions,
    pooling, instance normalisations): the data input's samples must lie
    along axis 0, every other input must be constant (weights)."""
    def rule(f, states):
        if states[0] != 0 or _data(states[1:]):
            raise _Refuse("needs the samples along axis 0 of its data and constant weights")
        return 0
    for name in names.split():
        RULES[name] = rule


def random_sources(names):
    """Operators that draw random numbers of a fixed shape: a merged launch
    would give every sample the same draw."""
    def rule(f, states):
        raise _Refuse("draws random numbers once per launch: every merged sample would "
                      "share the draw")
    for name in names.split():
        RULES[name] = rule
        _RANDOM.add(name)


def random_like(names):
    """Operators that draw one random number per element of their input: per
    sample where the input is, shared where it is not."""
    def rule(f, states):
        if not _data(states):
            raise _Refuse("draws random numbers for a sample-independent input: merged "
                          "samples would share the draw")
        return states[0]
    for name in names.split():
        RULES[name] = rule
        _RANDOM.add(name)


def constant_sources(names):
    """Deterministic operators without inputs (or of constant inputs only)."""
    for name in names.split():
        RULES[name] = lambda f, states: CONST


def _register(name):
    def deco(fn):
        RULES[name] = fn
        return fn
    return deco


# -- operators with rules of their own ----------------------------------------------------
@_register("FullyConnected")
def _fully_connected(f, states):
    a = states[0]
    if _data(states[1:]):
        raise _Refuse("its weights depend on the samples")
    if f.get("flatten", True) in (True, "True", 1):
        if a != 0:
            raise _Refuse("flattens every axis but 0, where the samples do not lie")
        return 0
    if a == len(f.ins[0]) - 1:
        raise _Refuse("contracts the last axis, along which merged samples lie")
    return a


@_register("Embedding")
def _embedding(f, states):
    if states[1] is not CONST:
        raise _Refuse("its weight depends on the samples")
    return states[0]


@_register("take")
def _take(f, states):
    arr, idx = states[0], states[1]
    rank = len(f.ins[0])
    axis = _norm(f.get("axis", 0), rank)
    if arr is CONST:
        return axis + idx
    if idx is not CONST:
        raise _Refuse("indexes sample-dependent data with sample-dependent indices, "
                      "whose positions refer to one sample's rows")
    if arr == axis:
        raise _Refuse("takes rows along axis %d, the axis along which merged samples lie"
                      % axis)
    return arr if arr < axis else arr + len(f.ins[1]) - 1


@_register("pick")
def _pick(f, states):
    a = states[0]
    rank = len(f.ins[0])
    axis = f.get("axis", -1)
    if axis is None:
        raise _Refuse("picks from the flattened array")
    axis = _norm(axis, rank)
    if a is CONST or axis == a:
        raise _Refuse("picks along the axis along which merged samples lie")
    return a if f.get("keepdims") or axis > a else a - 1


@_register("batch_dot")
def _batch_dot(f, states):
    if any(s != 0 for s in _data(states)):
        raise _Refuse("needs the samples along axis 0, its batch axis")
    return 0


@_register("dot")
def _dot(f, states):
    lhs, rhs = states
    rl, rr = len(f.ins[0]), len(f.ins[1])
    ta, tb = f.get("transpose_a"), f.get("transpose_b")
    if (ta and rl != 2) or (tb and rr != 2) or (lhs is not CONST and rhs is not CONST):
        raise _Refuse("contracts sample-dependent tensors in a way jitbatch cannot follow")
    if lhs is not CONST:
        if lhs == (0 if ta else rl - 1):
            raise _Refuse("contracts the axis along which merged samples lie")
        return (1 - lhs) if ta else lhs
    if rhs == (rr - 1 if tb else 0):
        raise _Refuse("contracts the axis along which merged samples lie")
    return rl - 1 + ((1 - rhs) if tb else rhs - 1)


@_register("Reshape")
def _reshape(f, states):
    # row-major order keeps each sample's rows contiguous only where the samples
    # lie along axis 0 and stay there, and nothing else changes size with them
    if states[0] != 0 or not f.outs[0]:
        raise _Refuse("reshapes across the axis along which merged samples lie")
    return 0


RULES["reshape"] = _reshape
RULES["reshape_like"] = _reshape


@_register("Flatten")
def _flatten(f, states):
    if states[0] != 0:
        raise _Refuse("flattens the axis along which merged samples lie")
    return 0


RULES["flatten"] = _flatten


@_register("expand_dims")
def _expand_dims(f, states):
    a = states[0]
    d = _norm(f.get("axis"), len(f.ins[0]) + 1)
    return a + 1 if d <= a else a


@_register("squeeze")
def _squeeze(f, states):
    a = states[0]
    shape = f.ins[0]
    axes = _axes(f.get("axis"), len(shape))
    if axes is None:
        axes = tuple(i for i, n in enumerate(shape) if n == 1)
    if a in axes:
        raise _Refuse("squeezes the axis along which merged samples lie")
    return a - sum(1 for i in axes if i < a)


@_register("transpose")
def _transpose(f, states):
    rank = len(f.ins[0])
    axes = _axes(f.get("axes"), rank) or tuple(reversed(range(rank)))
    return axes.index(states[0])


@_register("SwapAxis")
def _swap(f, states):
    a = states[0]
    rank = len(f.ins[0])
    d1, d2 = _norm(f.get("dim1", 0), rank), _norm(f.get("dim2", 0), rank)
    return d2 if a == d1 else d1 if a == d2 else a


RULES["swapaxes"] = _swap


def _concat(f, states):
    axes = set(_data(states))
    if len(axes) != 1:
        raise _Refuse("joins tensors whose samples lie along different axes")
    a = axes.pop()
    if _norm(f.get("dim", 1), len(f.ins[0])) == a:
        raise _Refuse("concatenates along axis %d, the axis along which merged samples lie"
                      % a)
    return a


RULES["Concat"] = RULES["concat"] = _concat


@_register("stack")
def _stack(f, states):
    axes = set(_data(states))
    if len(axes) != 1:
        raise _Refuse("stacks tensors whose samples lie along different axes")
    a = axes.pop()
    return a + 1 if _norm(f.get("axis", 0), len(f.ins[0]) + 1) <= a else a


@_register("SliceChannel")
def _split(f, states):
    a = states[0]
    d = _norm(f.get("axis", 1), len(f.ins[0]))
    if d == a:
        raise _Refuse("splits along axis %d, the axis along which merged samples lie" % a)
    return a - 1 if f.get("squeeze_axis") and d < a else a


RULES["split"] = _split


@_register("slice_axis")
def _slice_axis(f, states):
    a = states[0]
    if _norm(f.get("axis"), len(f.ins[0])) == a:
        raise _Refuse("slices along the axis along which merged samples lie")
    return a


@_register("slice")
def _slice(f, states):
    a = states[0]

    def at(name):
        v = f.get(name, ())
        v = tuple(v) if isinstance(v, (tuple, list)) else (v,)
        return v[a] if a < len(v) else None
    if at("begin") not in (None, 0) or at("end") is not None or at("step") not in (None, 1):
        raise _Refuse("slices along the axis along which merged samples lie")
    return a


@_register("tile")
def _tile(f, states):
    a = states[0]
    reps = f.get("reps", ())
    reps = tuple(reps) if isinstance(reps, (tuple, list)) else (reps,)
    rank = max(len(f.ins[0]), len(reps))
    out = a + rank - len(f.ins[0])
    full = (1,) * (rank - len(reps)) + reps
    if full[out] != 1:
        raise _Refuse("repeats the whole array along the axis along which merged samples lie")
    return out


@_register("repeat")
def _repeat(f, states):
    if f.get("axis") is None:
        raise _Refuse("repeats the flattened array")
    return states[0]


@_register("pad")
def _pad(f, states):
    a = states[0]
    width = f.get("pad_width", ())
    if tuple(width[2 * a:2 * a + 2]) not in ((), (0, 0)):
        raise _Refuse("pads along the axis along which merged samples lie")
    return a


@_register("broadcast_to")
def _broadcast_to(f, states):
    return states[0] + len(f.outs[0]) - len(f.ins[0])


@_register("broadcast_axis")
def _broadcast_axis(f, states):
    a = states[0]
    if a in (_axes(f.get("axis"), len(f.ins[0])) or ()):
        raise _Refuse("broadcasts along the axis along which merged samples lie")
    return a


RULES["broadcast_axes"] = _broadcast_axis


@_register("broadcast_like")
def _broadcast_like(f, states):
    lhs, rhs = states
    rank = len(f.outs[0])
    if lhs is CONST:
        return rhs
    out = lhs + rank - len(f.ins[0])
    if rhs is not CONST and rhs != out:
        raise _Refuse("broadcasts across the axis along which merged samples lie")
    return out


@_register("one_hot")
def _one_hot(f, states):
    return states[0]


@_register("arange_like")
def _arange_like(f, states):
    axis = f.get("axis")
    a = states[0]
    if axis is None or _norm(axis, len(f.ins[0])) == a:
        raise _Refuse("numbers the positions along the axis along which merged samples lie")
    return a


@_register("LayerNorm")
def _layer_norm(f, states):
    a = states[0]
    if _data(states[1:]):
        raise _Refuse("its scale depends on the samples")
    if _norm(f.get("axis", -1), len(f.ins[0])) == a:
        raise _Refuse("normalises along the axis along which merged samples lie")
    return a


@_register("BatchNorm")
def _batch_norm(f, states):
    a = states[0]
    if _data(states[1:]):
        raise _Refuse("its scale depends on the samples")
    if f.training and not f.get("use_global_stats"):
        raise _Refuse("in training mode normalises over the rows of every merged sample "
                      "and updates its running statistics once per launch")
    if _norm(f.get("axis", 1), len(f.ins[0])) == a:
        raise _Refuse("normalises per channel along the axis along which merged samples lie")
    return a


@_register("Dropout")
def _dropout(f, states):
    a = states[0]
    if not f.training and f.get("mode", "training") != "always":
        return a                      # the identity
    if a is CONST:
        raise _Refuse("draws one mask per launch for a sample-independent input: merged "
                      "samples would share it")
    if a in (_axes(f.get("axes"), len(f.ins[0])) or ()):
        raise _Refuse("shares its mask along axis %d (axes=%s), along which merged samples "
                      "lie: they would share it" % (a, f.get("axes")))
    return a


@_register("RNN")
def _rnn(f, states):
    # a fused RNN layer runs its recurrence along axis 0 (TNC): the samples
    # must lie along axis 1 of its data and its states
    if states[0] != 1 or any(s != 1 for s in _data(states[1:]) if s is not CONST):
        raise _Refuse("runs a recurrence along axis 0 (its time axis): merged samples "
                      "must lie along axis 1 (layout TNC)")
    return 1


def _sequence_op(drops):
    def rule(f, states):
        t = _norm(f.get("axis", 0), len(f.ins[0]))
        b = 1 if t == 0 else 0
        a = states[0]
        if not f.get("use_sequence_length"):
            if drops:
                raise _Refuse("takes the last step along the axis along which merged "
                              "samples lie")
            return a
        if a != b:
            raise _Refuse("runs along the axis along which merged samples lie")
        return b - 1 if drops and t < b else b
    return rule


RULES["SequenceMask"] = _sequence_op(False)
RULES["SequenceReverse"] = _sequence_op(False)
RULES["SequenceLast"] = _sequence_op(True)


def _loop(f, states):
    raise _Refuse("runs a loop or subgraph over its inputs (foreach scans along axis 0, "
                  "across merged samples)")


RULES["_foreach"] = RULES["_while_loop"] = RULES["_cond"] = _loop

# -- the registry ---------------------------------------------------------------------------
elementwise("""
Activation LeakyReLU sigmoid tanh relu softsign exp expm1 log log1p log2 log10 sqrt rsqrt cbrt
rcbrt square abs negative reciprocal sign floor ceil round rint fix trunc sin cos tan arcsin
arccos arctan sinh cosh arcsinh arccosh arctanh erf erfinv gamma gammaln degrees radians clip
Cast cast amp_cast amp_multicast zeros_like ones_like _copy identity BlockGrad stop_gradient
make_loss MakeLoss elemwise_add elemwise_sub elemwise_mul elemwise_div _plus _minus _mul _div
_Plus _Minus _Mul _Div _grad_add _maximum _minimum _power _hypot _mod maximum minimum
_plus_scalar _minus_scalar _rminus_scalar _mul_scalar _div_scalar _rdiv_scalar _power_scalar
_rpower_scalar _maximum_scalar _minimum_scalar _hypot_scalar _mod_scalar _rmod_scalar
_equal_scalar _not_equal_scalar _greater_scalar _greater_equal_scalar _lesser_scalar
_lesser_equal_scalar _logical_and_scalar _logical_or_scalar _logical_xor_scalar logical_not
add_n ElementWiseSum _equal _not_equal _greater _greater_equal _lesser _lesser_equal
smooth_l1 hard_sigmoid softrelu log_sigmoid mish where _contrib_div_sqrt_dim
broadcast_add broadcast_sub broadcast_mul broadcast_div broadcast_plus broadcast_minus
broadcast_maximum broadcast_minimum broadcast_power broadcast_hypot broadcast_mod
broadcast_equal broadcast_not_equal broadcast_greater broadcast_greater_equal
broadcast_lesser broadcast_lesser_equal broadcast_logical_and broadcast_logical_or
broadcast_logical_xor _random_uniform_like _random_normal_like
""")
reduction("sum mean max min prod nansum nanprod norm sum_axis max_axis min_axis argmax argmin")
reduction("moments", attr="axes")
for _name, _attr, _default in (("softmax", "axis", -1), ("log_softmax", "axis", -1),
                               ("softmin", "axis", -1), ("sort", "axis", -1),
                               ("argsort", "axis", -1), ("topk", "axis", -1),
                               ("cumsum", "axis", None), ("reverse", "axis", None),
                               ("flip", "axis", None)):
    along(_name, _attr, _default)
batch_first("Convolution Deconvolution Pooling UpSampling InstanceNorm L2Normalization LRN "
            "SoftmaxActivation GroupNorm")
random_sources("""
_random_uniform _random_normal _random_gamma _random_exponential _random_poisson
_random_negative_binomial _random_generalized_negative_binomial _random_randint
_sample_uniform _sample_normal _sample_gamma _sample_exponential _sample_poisson
_sample_negative_binomial _sample_generalized_negative_binomial _sample_multinomial _shuffle
_sample_unique_zipfian
""")
constant_sources("_zeros _ones _full _arange _eye _linspace _zeros_without_dtype")


# -- the check -------------------------------------------------------------------------------
def check(out, names, shapes, training):
    """None if merging calls of the traced symbol ``out`` (inputs ``names`` with
    per-sample ``shapes``) along axis 0 is exact, else the ``Mix`` saying which
    operator prevents it and why. ``training``: autograd's training mode of
    the signature (BatchNorm and Dropout depend on it)."""
    graph = json.loads(out.tojson())
    nodes = graph["nodes"]
    one, two = _internal_shapes(out, nodes, names, shapes)
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
                     one.get(j, []), training)
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


def _apply(node, ins, in_shapes, outs, training):
    """The state of one operator node's outputs (a Mix where it combines samples)."""
    op, name = node["op"], node["name"]
    if op not in _RANDOM and all(s is CONST for s in ins):
        return CONST            # computed from constants alone
    rule = RULES.get(op)
    if rule is None:
        return Mix(op, name, "has no batching rule: jitbatch cannot prove that it keeps "
                   "merged samples apart")
    attrs = {k: parse_attr(v) for k, v in node.get("attrs", {}).items()
             if not k.startswith("__")}
    try:
        return rule(Facts(attrs, in_shapes, outs, training), ins)
    except _Refuse as e:
        return Mix(op, name, str(e))
    except (TypeError, ValueError, IndexError, KeyError, AttributeError) as e:
        return Mix(op, name, "has attributes its batching rule does not follow (%s)" % e)


def _shape_of(table, i, k):
    outs = table.get(i)
    return tuple(outs[k]) if outs and k < len(outs) and outs[k] is not None else ()


def _doubles(outs, outs2, axis):
    """Whether every output of a node doubles along ``axis`` at twice the rows
    (unknown shapes pass: the heads are checked by the caller's inference)."""
    if outs2 is None:
        return True
    for s1, s2 in zip(outs, outs2):
        if not s1 or not s2 or 0 in s1 or 0 in s2:
            continue
        if axis >= len(s1) or s2[axis] != 2 * s1[axis]:
            return False
    return True


def _internal_shapes(out, nodes, names, shapes):
    """Per node index, the shapes of its visible outputs at the call's
    per-sample shapes and at twice the rows (MXNet's shape inference on the
    symbol's internals)."""
    internals = out.get_internals()
    listed = internals.list_outputs()
    result = []
    for scale in (1, 2):
        given = {n: (scale * s[0],) + tuple(s[1:]) for n, s in zip(names, shapes)}
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
