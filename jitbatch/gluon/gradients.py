"""Which launches pass no gradient back to their inputs, so they need not be recorded.

MXNet 1.9.1 crashes the process in ``backward()`` (a segmentation fault in
``Imperative::Backward``) when rows gathered with ``concat`` reach an operator
that passes them no gradient through another operator, e.g.
``BlockGrad(concat(a, b) * 2)``, ``take(concat(a, b), i) > 0``, or a hybridized
block whose outputs are all ``BlockGrad``-ed. Per-sample code never
concatenates its samples; merged launches gather with ``concat`` all the time.
A launch that passes no gradient to any of its inputs or parameters computes
the same values when autograd does not record it (its outputs carry no
gradient either way), and then nothing of it, its gathers included, reaches
the backward pass: its executor runs it unrecorded (``launch_mode``).

An operator's inputs pass gradient unless the operator is listed here (a whole
operator, or some of its inputs): the list only ever makes a launch unrecorded
that passes no gradient, never one that does."""
import json

#: operators that pass no gradient to any input
NO_GRADIENT = frozenset("""
BlockGrad stop_gradient argmax argmin argsort
_equal _not_equal _greater _greater_equal _lesser _lesser_equal
_equal_scalar _not_equal_scalar _greater_scalar _greater_equal_scalar _lesser_scalar
_lesser_equal_scalar _logical_and _logical_or _logical_xor logical_not
_logical_and_scalar _logical_or_scalar _logical_xor_scalar
broadcast_equal broadcast_not_equal broadcast_greater broadcast_greater_equal
broadcast_lesser broadcast_lesser_equal broadcast_logical_and broadcast_logical_or
broadcast_logical_xor
sign round rint ceil floor trunc fix one_hot shape_array size_array zeros_like ones_like
_random_uniform_like _random_normal_like _random_gamma_like _random_exponential_like
_random_poisson_like _random_negative_binomial_like _random_generalized_negative_binomial_like
""".split())

#: operators that pass no gradient to the inputs at these positions
NO_GRADIENT_INPUTS = {
    "Embedding": (0,), "take": (1,), "pick": (1,), "where": (0,), "gather_nd": (1,),
    "SequenceMask": (1,), "SequenceLast": (1,), "SequenceReverse": (1,),
    "_contrib_arange_like": (0,), "broadcast_like": (1,), "reshape_like": (1,),
    "slice_like": (1,),
}


#: operators that pass no gradient where an attribute has one of these values
NO_GRADIENT_WHERE = {"topk": ("ret_typ", ("indices", "mask"))}


#: operators whose MXNet 1.9.1 gradient is wrong -> the fix for the user: they
#: are refused where autograd records them (per sample MXNet's backward fails
#: on them, or merged gives silently wrong numbers)
_TO_TENSOR = ("its backward copies the output gradient back as it is, without the transpose "
              "and the 1/255 (plain Gluon fails in backward(); merged rows gave gradients "
              "255x too large). Fix: write it as nd.transpose(x, (0, 3, 1, 2)) / 255 (or "
              "(2, 0, 1) for one image), or call it outside autograd.record()")
WRONG_GRADIENT = {name: _TO_TENSOR for name in ("_image_to_tensor", "_npx__image_to_tensor")}


def passes(op, k, attrs=None):
    """Whether operator ``op`` (attributes ``attrs``, as strings) can pass
    gradient to its input ``k``."""
    if op in NO_GRADIENT or k in NO_GRADIENT_INPUTS.get(op, ()):
        return False
    where = NO_GRADIENT_WHERE.get(op)
    if where is not None and attrs:
        return str(attrs.get(where[0], "")).strip("'\"") not in where[1]
    return True


def reached_variables(out):
    """The variables of the traced symbol ``out`` (data inputs and parameters
    alike, by name) on which some output depends differentiably: an empty set
    where it passes no gradient at all; the data inputs left out get none
    (a recorded launch detaches them: MXNet 1.9.1 crashes on the zeros where
    they are rows gathered from other launches)."""
    graph = json.loads(out.tojson())
    reach = []      # per node: the variables its outputs depend on differentiably
    for node in graph["nodes"]:
        op = node["op"]
        if op == "null":
            reach.append(frozenset((node["name"],)))
            continue
        attrs = node.get("attrs", {})
        got = set()
        for k, (i, _, _) in enumerate(node["inputs"]):
            if passes(op, k, attrs):
                got |= reach[i]
        reach.append(got)
    heads = set()
    for j, _, _ in graph["heads"]:
        heads |= reach[j]
    return heads


def launch_mode(mode, passes_gradient):
    """The autograd mode a signature's launches run in: its own, or, where
    it records but passes no gradient to its inputs and parameters, not
    recording (same training mode)."""
    if mode[0] and not passes_gradient:
        return (False, mode[1])
    return mode
