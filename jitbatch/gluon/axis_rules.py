"""Batch-axis rules of MXNet operators in traced graphs: a registry filled by family helpers.

A rule receives the ``Facts`` of one operator node of a traced block (parsed
attributes, per-sample input and output shapes, training mode) and the
*states* of its inputs (``CONST``, or the axis along which merged samples lie)
and returns its outputs' state, or raises ``Refuse`` saying how the operator
combines samples. ``contract.check`` propagates the states over a graph.
Adding an operator is one line in the registry at the end."""
import math

CONST = None

#: operator name -> rule(Facts of the node, input states) -> state
RULES = {}
#: operators whose rule runs even on constant inputs (their draws are per launch)
RANDOM = {"Dropout"}


class Facts(object):
    """What a rule may read about one operator node: its attributes (parsed),
    the per-sample shapes of its inputs and outputs (``ins``, ``outs``), and
    whether the signature runs in training mode and is recorded by autograd."""
    __slots__ = ("attrs", "ins", "outs", "training", "recording")

    def __init__(self, attrs, ins, outs, training, recording=False):
        self.attrs = attrs
        self.ins = ins
        self.outs = outs
        self.training = training
        self.recording = recording

    def get(self, name, default=None):
        v = self.attrs.get(name, default)
        return default if v == "None" else v


class Refuse(Exception):
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
            raise Refuse("pairs elements of tensors whose samples lie along different axes")
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
            raise Refuse("reduces over axis %d, the axis along which merged samples lie"
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
            raise Refuse("acts on the flattened array, across merged samples")
        axis = _norm(axis, len(f.ins[0]))
        if axis == a:
            raise Refuse("acts along axis %d, the axis along which merged samples lie" % a)
        return a if keeps_rank or axis > a else a - 1
    RULES[name] = rule


def batch_first(names):
    """Operators that treat axis 0 as independent instances (convolutions,
    pooling, instance normalisations): the data input's samples must lie
    along axis 0, every other input must be constant (weights)."""
    def rule(f, states):
        if states[0] != 0 or _data(states[1:]):
            raise Refuse("needs the samples along axis 0 of its data and constant weights")
        return 0
    for name in names.split():
        RULES[name] = rule


def random_sources(names):
    """Operators that draw random numbers of a fixed shape: a merged launch
    would give every sample the same draw."""
    def rule(f, states):
        raise Refuse("draws random numbers once per launch: every merged sample would "
                      "share the draw")
    for name in names.split():
        RULES[name] = rule
        RANDOM.add(name)


def random_like(names, per_row=False):
    """Operators that draw independently per element of their inputs
    (``normal_like(x)``, ``sample_normal(mu, sigma)``; ``per_row``: per row of
    the last axis, ``sample_multinomial(probs)``): per sample where every
    input is, along one axis; shared where one is not."""
    def rule(f, states):
        if any(s is CONST for s in states) or len(set(states)) != 1:
            raise Refuse("draws random numbers for inputs that are not all per sample along "
                          "one axis: merged samples would share or mix the draws")
        a = states[0]
        if per_row and a == len(f.ins[0]) - 1:
            raise Refuse("draws along the axis along which merged samples lie")
        return a
    for name in names.split():
        RULES[name] = rule
        RANDOM.add(name)


def constant_sources(names):
    """Deterministic operators without inputs (or of constant inputs only)."""
    for name in names.split():
        RULES[name] = lambda f, states: CONST


def _register(*names):
    def deco(fn):
        for name in names:
            RULES[name] = fn
        return fn
    return deco


# -- operators with rules of their own ----------------------------------------------------
@_register("FullyConnected")
def _fully_connected(f, states):
    a = states[0]
    if _data(states[1:]):
        raise Refuse("its weights depend on the samples")
    if f.get("flatten", True) in (True, "True", 1):
        if a != 0:
            raise Refuse("flattens every axis but 0, where the samples do not lie")
        return 0
    if a == len(f.ins[0]) - 1:
        raise Refuse("contracts the last axis, along which merged samples lie")
    return a


@_register("Embedding")
def _embedding(f, states):
    if states[1] is not CONST:
        raise Refuse("its weight depends on the samples")
    return states[0]


@_register("take")
def _take(f, states):
    arr, idx = states[0], states[1]
    rank = len(f.ins[0])
    axis = _norm(f.get("axis", 0), rank)
    if arr is CONST:
        return axis + idx
    if idx is not CONST:
        raise Refuse("indexes sample-dependent data with sample-dependent indices, "
                      "whose positions refer to one sample's rows")
    if arr == axis:
        raise Refuse("takes rows along axis %d, the axis along which merged samples lie"
                      % axis)
    return arr if arr < axis else arr + len(f.ins[1]) - 1


@_register("pick")
def _pick(f, states):
    a = states[0]
    rank = len(f.ins[0])
    axis = f.get("axis", -1)
    if axis is None:
        raise Refuse("picks from the flattened array")
    axis = _norm(axis, rank)
    if a is CONST or axis == a:
        raise Refuse("picks along the axis along which merged samples lie")
    return a if f.get("keepdims") or axis > a else a - 1


@_register("batch_dot")
def _batch_dot(f, states):
    if any(s != 0 for s in _data(states)):
        raise Refuse("needs the samples along axis 0, its batch axis")
    return 0


@_register("dot")
def _dot(f, states):
    lhs, rhs = states
    rl, rr = len(f.ins[0]), len(f.ins[1])
    ta, tb = f.get("transpose_a"), f.get("transpose_b")
    if (ta and rl != 2) or (tb and rr != 2) or (lhs is not CONST and rhs is not CONST):
        raise Refuse("contracts sample-dependent tensors in a way jitbatch cannot follow")
    if lhs is not CONST:
        if lhs == (0 if ta else rl - 1):
            raise Refuse("contracts the axis along which merged samples lie")
        return (1 - lhs) if ta else lhs
    if rhs == (rr - 1 if tb else 0):
        raise Refuse("contracts the axis along which merged samples lie")
    # the output's axes: lhs's but its last, then rhs's but its first (transposed:
    # but its last), so rhs axis r lands at rl - 1 + r - 1 (transposed: rl - 1)
    return rl - 1 + (-rhs if tb else rhs - 1)


@_register("Reshape")
def _reshape(f, states):
    # row-major order keeps each sample's elements together within each index of
    # the axes before the samples': they stay apart where those axes keep their
    # product (the caller checks that the next axis is the one that doubles)
    a = states[0]
    lead, at = math.prod(f.ins[0][:a]) if a is not CONST else -1, 1
    for k, n in enumerate(f.outs[0]):
        if at == lead:
            return k
        at *= n
    raise Refuse("reshapes across the axis along which merged samples lie")


RULES["reshape"] = _reshape
RULES["reshape_like"] = _reshape


@_register("Flatten")
def _flatten(f, states):
    if states[0] != 0:
        raise Refuse("flattens the axis along which merged samples lie")
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
        raise Refuse("squeezes the axis along which merged samples lie")
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
        raise Refuse("joins tensors whose samples lie along different axes")
    a = axes.pop()
    if _norm(f.get("dim", 1), len(f.ins[0])) == a:
        raise Refuse("concatenates along axis %d, the axis along which merged samples lie"
                      % a)
    return a


RULES["Concat"] = RULES["concat"] = _concat


@_register("stack")
def _stack(f, states):
    axes = set(_data(states))
    if len(axes) != 1:
        raise Refuse("stacks tensors whose samples lie along different axes")
    a = axes.pop()
    return a + 1 if _norm(f.get("axis", 0), len(f.ins[0]) + 1) <= a else a


@_register("SliceChannel")
def _split(f, states):
    a = states[0]
    d = _norm(f.get("axis", 1), len(f.ins[0]))
    if d == a:
        raise Refuse("splits along axis %d, the axis along which merged samples lie" % a)
    return a - 1 if f.get("squeeze_axis") and d < a else a


RULES["split"] = _split


@_register("slice_axis")
def _slice_axis(f, states):
    a = states[0]
    if _norm(f.get("axis"), len(f.ins[0])) == a:
        raise Refuse("slices along the axis along which merged samples lie")
    return a


@_register("slice")
def _slice(f, states):
    a = states[0]

    def at(name):
        v = f.get(name, ())
        v = tuple(v) if isinstance(v, (tuple, list)) else (v,)
        return v[a] if a < len(v) else None
    if at("begin") not in (None, 0) or at("end") is not None or at("step") not in (None, 1):
        raise Refuse("slices along the axis along which merged samples lie")
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
        raise Refuse("repeats the whole array along the axis along which merged samples lie")
    return out


@_register("repeat")
def _repeat(f, states):
    if f.get("axis") is None:
        raise Refuse("repeats the flattened array")
    return states[0]


@_register("pad")
def _pad(f, states):
    a = states[0]
    width = f.get("pad_width", ())
    if tuple(width[2 * a:2 * a + 2]) not in ((), (0, 0)):
        raise Refuse("pads along the axis along which merged samples lie")
    return a


@_register("broadcast_to")
def _broadcast_to(f, states):
    return states[0] + len(f.outs[0]) - len(f.ins[0])


@_register("broadcast_axis")
def _broadcast_axis(f, states):
    a = states[0]
    if a in (_axes(f.get("axis"), len(f.ins[0])) or ()):
        raise Refuse("broadcasts along the axis along which merged samples lie")
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
        raise Refuse("broadcasts across the axis along which merged samples lie")
    return out


@_register("one_hot")
def _one_hot(f, states):
    return states[0]


def _arange_like(f, states):
    # with an axis: the positions 0..n-1 along it, a 1-D range that no sample's
    # values change (the same for every sample unless n is the merged axis);
    # without one: every element numbered, across merged samples
    axis = f.get("axis")
    a = states[0]
    if axis is None or _norm(axis, len(f.ins[0])) == a:
        raise Refuse("numbers the positions along the axis along which merged samples lie")
    return CONST


RULES["arange_like"] = RULES["_contrib_arange_like"] = _arange_like


@_register("LayerNorm")
def _layer_norm(f, states):
    a = states[0]
    if _data(states[1:]):
        raise Refuse("its scale depends on the samples")
    if _norm(f.get("axis", -1), len(f.ins[0])) == a:
        raise Refuse("normalises along the axis along which merged samples lie")
    return a


@_register("BatchNorm")
def _batch_norm(f, states):
    a = states[0]
    if _data(states[1:]):
        raise Refuse("its scale depends on the samples")
    if f.training and not f.get("use_global_stats"):
        raise Refuse("in training mode normalises over the rows of every merged sample "
                      "and updates its running statistics once per launch (run one per "
                      "sample, its outputs and gradients are exact; MXNet updates the "
                      "running statistics during backward, for the calls its graph reaches "
                      "and in the order it gives, so after a step they can differ from "
                      "per-sample Gluon's)")
    if f.recording and not f.get("use_global_stats"):
        raise Refuse("is recorded by autograd: its backward in training mode (backward()'s "
                      "default, whatever the recording's mode) normalises over the rows of "
                      "every merged sample (use_global_stats=True keeps it to the running "
                      "statistics, and its calls merge)")
    if _norm(f.get("axis", 1), len(f.ins[0])) == a:
        raise Refuse("normalises per channel along the axis along which merged samples lie")
    return a


@_register("MakeLoss", "make_loss")
def _make_loss(f, states):
    # the identity forward; its gradient is divided by the launch's rows
    # ('batch') or its count of valid entries ('valid'), which merging changes
    if f.get("normalization", "null") != "null":
        raise Refuse("divides its gradient by the rows of its launch (normalization=%r): "
                      "merged, by every merged sample's" % f.get("normalization"))
    if f.recording:
        # its backward passes ones whatever the head gradient: a merged sample
        # whose loss the backward never reaches (left out of it, or a launch's
        # filler) would add its gradient
        raise Refuse("is recorded by autograd and its backward passes ones whatever the "
                      "head gradient: merged, a sample left out of the loss (or a filler "
                      "of the launch) would add its gradient")
    return states[0]


@_register("CTCLoss", "ctc_loss", "_contrib_CTCLoss", "_contrib_ctc_loss")
def _ctc_loss(f, states):
    # data (T, N, C): samples along axis 1; labels (N, L) and lengths (N,)
    # along axis 0; one loss per sample (N,), each from its own rows alone
    if states[0] != 1 or any(s != 0 for s in states[1:]):
        raise Refuse("needs its data's samples along axis 1 (time-major) and its labels' "
                      "and lengths' along axis 0")
    return 0


@_register("Dropout")
def _dropout(f, states):
    a = states[0]
    if not f.training and f.get("mode", "training") != "always":
        return a                      # the identity
    if a is CONST:
        raise Refuse("draws one mask per launch for a sample-independent input: merged "
                      "samples would share it")
    if a in (_axes(f.get("axes"), len(f.ins[0])) or ()):
        raise Refuse("shares its mask along axis %d (axes=%s), along which merged samples "
                      "lie: they would share it" % (a, f.get("axes")))
    return a


@_register("RNN")
def _rnn(f, states):
    # a fused RNN layer runs its recurrence along axis 0 (TNC): the samples
    # must lie along axis 1 of its data and its states
    if states[0] != 1 or any(s != 1 for s in _data(states[1:]) if s is not CONST):
        raise Refuse("runs a recurrence along axis 0 (its time axis): merged samples "
                      "must lie along axis 1 (layout TNC)")
    return 1


def _sequence_op(kind):
    def rule(f, states):
        t = _norm(f.get("axis", 0), len(f.ins[0]))
        b = 1 if t == 0 else 0
        a = states[0]
        if not f.get("use_sequence_length"):
            # without lengths: SequenceMask masks nothing, the others act along
            # the time axis t of every sequence
            if kind == "mask":
                return a
            if a == t or kind == "last":
                raise Refuse("%s along axis %d (its time axis), the axis along which merged "
                              "samples lie" % ("reverses" if kind == "reverse" else
                                               "takes the last step", t))
            return a
        if a != b:
            raise Refuse("runs along the axis along which merged samples lie")
        return b - 1 if kind == "last" and t < b else b
    return rule


RULES["SequenceMask"] = _sequence_op("mask")
RULES["SequenceReverse"] = _sequence_op("reverse")
RULES["SequenceLast"] = _sequence_op("last")


def _loop(f, states):
    raise Refuse("runs a loop or subgraph over its inputs (foreach scans along axis 0, "
                  "across merged samples)")


RULES["_foreach"] = RULES["_while_loop"] = RULES["_cond"] = _loop

# -- the registry ---------------------------------------------------------------------------
elementwise("""
Activation LeakyReLU sigmoid tanh relu softsign exp expm1 log log1p log2 log10 sqrt rsqrt cbrt
rcbrt square abs negative reciprocal sign floor ceil round rint fix trunc sin cos tan arcsin
arccos arctan sinh cosh arcsinh arccosh arctanh erf erfinv gamma gammaln degrees radians clip
Cast cast amp_cast amp_multicast zeros_like ones_like _copy identity BlockGrad stop_gradient
elemwise_add elemwise_sub elemwise_mul elemwise_div _plus _minus _mul _div
_Plus _Minus _Mul _Div _grad_add _maximum _minimum _power _hypot _mod maximum minimum
_plus_scalar _minus_scalar _rminus_scalar _mul_scalar _div_scalar _rdiv_scalar _power_scalar
_rpower_scalar _maximum_scalar _minimum_scalar _hypot_scalar _mod_scalar _rmod_scalar
_equal_scalar _not_equal_scalar _greater_scalar _greater_equal_scalar _lesser_scalar
_lesser_equal_scalar _logical_and_scalar _logical_or_scalar _logical_xor_scalar logical_not
add_n ElementWiseSum _equal _not_equal _greater _greater_equal _lesser _lesser_equal
smooth_l1 hard_sigmoid softrelu log_sigmoid mish where
broadcast_add broadcast_sub broadcast_mul broadcast_div broadcast_plus broadcast_minus
broadcast_maximum broadcast_minimum broadcast_power broadcast_hypot broadcast_mod
broadcast_equal broadcast_not_equal broadcast_greater broadcast_greater_equal
broadcast_lesser broadcast_lesser_equal broadcast_logical_and broadcast_logical_or
broadcast_logical_xor
""")
reduction("sum mean max min prod nansum nanprod norm sum_axis max_axis min_axis argmax argmin")
reduction("moments", attr="axes")
for _name, _attr, _default in (("softmax", "axis", -1), ("log_softmax", "axis", -1),
                               ("softmin", "axis", -1), ("sort", "axis", -1),
                               ("argsort", "axis", -1), ("topk", "axis", -1),
                               ("cumsum", "axis", None), ("_np_cumsum", "axis", None),
                               ("reverse", "axis", None),
                               ("flip", "axis", None),
                               # divides by the square root of the last axis's size
                               ("_contrib_div_sqrt_dim", "axis", -1)):
    along(_name, _attr, _default)
batch_first("Convolution Deconvolution Pooling UpSampling InstanceNorm L2Normalization LRN "
            "SoftmaxActivation GroupNorm Pad pad _contrib_BilinearResize2D depth_to_space "
            "space_to_depth")
random_sources("""
_random_uniform _random_normal _random_gamma _random_exponential _random_poisson
_random_negative_binomial _random_generalized_negative_binomial _random_randint _shuffle
_sample_unique_zipfian
""")
random_like("""
_random_uniform_like _random_normal_like _random_gamma_like _random_exponential_like
_random_poisson_like _random_negative_binomial_like _random_generalized_negative_binomial_like
_sample_uniform _sample_normal _sample_gamma _sample_exponential _sample_poisson
_sample_negative_binomial _sample_generalized_negative_binomial
""")
random_like("_sample_multinomial", per_row=True)
constant_sources("_zeros _ones _full _arange _eye _linspace _zeros_without_dtype")
