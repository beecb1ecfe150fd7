"""Signatures on MXNet: the layout of every key, and what a new signature holds.

Two kinds of keys, both owned here:

* the *exact call* key of a block call, built on every record and looked up in
  ``EXACT`` (a call seen before skips everything else):
  ``(block id, token, argument format, autograd mode, device, shape0, dtype0,
  shape1, dtype1, ...)`` (``exact_key``; the token, a fresh object per block
  structure that the key keeps alive, makes the id unambiguous);
  an operator call's exact key is its ``op_signature`` arguments, looked up in
  ``OP_EXACT``; in either table an entry whose signature ``TABLE`` evicted
  (``SigInfo.live`` False) counts as unknown, so that every later call finds
  one successor (kept, calls of other lengths would get another);
* *signature* keys of ``TABLE`` (what must be equal for nodes to merge),
  made once per new exact call: ``(kind, owner, token, *rest)`` for the block
  kinds (``owner`` the block's id, ``token`` its renewal token: a block
  hybridized again gets new signatures), ``(OP, handle, ...)`` for operators
  (the arity of a sum and a scalar operator's number left out: ``opkeys``).
  A block signature's launch measurements carry over to its renewal
  (``new_info``: keyed by ``stable(key)``, the key without its token).

A new block signature is found by tracing the block once (MXNet's
``_get_graph``) and MXNet's shape inference at the call's shapes and at twice
the rows (outputs must scale along axis 0), at an odd length (outputs that
keep any shared leading length make the signature *ragged*), and for
zero-padded blocks at one more along the padded axes."""
import warnings

import numpy as np
from mxnet import autograd
from mxnet.base import MXNetError
from mxnet.gluon.block import _flatten

from .. import config as _config
from ..errors import BatchingError, ContractWarning, first_line
from ..signature import SigInfo, SignatureTable
from ..stats import STATS
from .executors import BlockExec, ConstExec, CopyExec, OpExec, op_outputs, ragged_exec
from .flags import Unhybridized, pad_names
from .guards import finish_deferred
from .lazy import LazyArray, NotDifferentiableError
from .meta import check_ctx, meta
from .opkeys import RESHAPE_HANDLES
from .params import forget as forget_params, watch_params
from . import _mxapi, contract, gradients, opkeys
from .rules import rule_for, shared_rule

TABLE = SignatureTable()
EXACT = {}      # exact call key -> SigInfo (bounded by TABLE.limit)
OP_EXACT = {}   # exact operator call (op_signature's arguments) -> SigInfo (the same bound)
_MEASURED = {}  # block signature key without its token -> its latest SigInfo

#: where the arguments' (shape, dtype) pairs start in an exact call key
EXACT_ARGS = 5

# signature kinds (a key's first item)
PLAIN, RAGGED, PADDED, STAGE_IN, STAGE_MAIN, OP, CONST, COPY = (
    "block", "ragged", "padded", "input stage", "main stage", "op", "const", "copy")
BLOCK_KINDS = (PLAIN, RAGGED, PADDED, STAGE_IN, STAGE_MAIN)


def exact_key(block, fkey, mode, flat):
    """``(exact call key, device of the first array)`` of a call of ``block`` on
    the arrays ``flat`` (``fkey``: its argument format). Every context is its
    device's one ``Device``, so a call on one device (the usual case) puts in
    its number once; a call mixing devices puts in all of them."""
    key = [id(block), block._jb_token, fkey, mode, None]
    ctx = mixed = None
    for a in flat:
        if type(a) is LazyArray:
            la = a
            key.append(la._shape)
            key.append(la._dtype)
            c = la._ctx
        else:
            m = meta(a)
            key.append(m[0])
            key.append(m[1])
            c = m[2]
        if c is not ctx:
            if ctx is None:
                ctx = c
            elif mixed is None:
                mixed = [ctx]
        if mixed is not None:
            mixed.append(c)
    key[4] = ctx._jb_id if mixed is None else tuple(mixed)
    return tuple(key), ctx


def block_key(kind, block, *rest):
    """A block signature key of ``kind``."""
    return (kind, id(block), block._jb_token) + rest


def derived_key(kind, parent, *rest):
    """The key of a signature of ``kind`` made from block signature ``parent``
    (an input or main stage): the same owner and token, so it is renewed and
    measured like its parent."""
    return (kind, parent[1], parent[2]) + rest


def stable(key):
    """A block signature key without its renewal token: the block's number
    (``Token.block``) in place of its ``id()`` and token."""
    return (key[0], key[2].block) + key[3:]


def pad_size(exact, pads):
    """A call's size along its zero-padded axes ``pads`` ((input, axis) pairs;
    the largest, if several), from the input shapes in its exact key."""
    k = 0
    for i, axis in pads:
        s = exact[EXACT_ARGS + 2 * i][axis]
        if s > k:
            k = s
    return k


def new_info(sid, key, ex, out_meta, batchable, name):
    """The SigInfo of a new signature; a block's takes over the launch
    measurements of the signature it renews (the same call, re-hybridized)."""
    STATS.add(signatures=1)
    info = SigInfo(sid, key, ex, out_meta, batchable, name)
    info.stops = getattr(ex, "cut", None) or None   # (set only where recorded)
    if key[0] in BLOCK_KINDS:
        s = stable(key)
        old = _MEASURED.get(s)
        if old is not None:
            info.inherit(old)
        elif len(_MEASURED) >= TABLE.limit:
            _MEASURED.clear()
        _MEASURED[s] = info
    return info


def forget():
    """Drop every signature (``uninstall``; block instances keep inert tokens)."""
    forget_params()
    TABLE.clear()
    EXACT.clear()
    OP_EXACT.clear()
    _MEASURED.clear()


# -- arrays made from Python data ----------------------------------------------------------
def const_signature(row, dtype, ctx):
    """The signature of arrays created from Python data with rows of shape
    ``row`` (ragged: any number of rows merge)."""
    key = (CONST, row, dtype, ctx)
    info = TABLE.get(key)
    if info is None:
        out_meta = (((None,) + row, dtype),)
        ex = ConstExec(ctx, dtype, out_meta)
        info = TABLE.add(key, lambda sid: new_info(sid, key, ex, out_meta, True, "nd.array"))
    return info


def copy_signature(m, dst, mode):
    """The signature of a lazy array of meta ``m`` copied to Device ``dst``."""
    key = (COPY, m, dst, mode)
    info = TABLE.get(key)
    if info is None:
        ex = CopyExec((m[0], m[1]), m[2], dst, gradients.launch_mode(mode, True))
        info = TABLE.add(key, lambda sid: new_info(sid, key, ex, ((m[0], m[1]),), True,
                                                   "copyto"))
    return info


# -- operators ------------------------------------------------------------------------
#: handles of operators whose output shapes depend on their inputs' values
#: (``contrib.boolean_mask``): not recorded, their calls run on computed
#: arguments (the shapes a signature would fix came from zeros)
VALUE_SHAPED = set()


def op_signature(handle, keys, vals, metas, mode, output_is_list, shared=()):
    """The signature of an operator call on arguments of ``metas``; None for
    an operator whose output shapes depend on values (added to VALUE_SHAPED),
    or a custom one whose shapes its ``infer_shape`` does not give.
    ``shared``: ``(position, id)`` of its weight arguments that are parameters.
    A call seen before is one lookup in ``OP_EXACT``: making its signature key
    (``opkeys``: what is left out, ragged lengths) costs twice that."""
    exact = (handle, tuple(keys), tuple(vals), tuple(metas), mode, output_is_list, shared)
    try:
        info = OP_EXACT.get(exact)
    except TypeError:       # an unhashable attribute value: keyed by its text
        exact = (handle, exact[1], tuple([str(v) for v in vals])) + exact[3:]
        info = OP_EXACT.get(exact)
    if info is None or not info.live:     # (one TABLE evicted: found again)
        info = _op_signature(handle, keys, vals, metas, mode, output_is_list, shared)
        if info is not None:
            _remember(OP_EXACT, exact, info)
    return info


def _op_signature(handle, keys, vals, metas, mode, output_is_list, shared):
    """``op_signature`` of a call not seen before."""
    if handle in RESHAPE_HANDLES and metas:
        vals = opkeys.reshape_rows(handle, keys, vals, metas[0][0])
    vkey = tuple(vals)
    try:
        hash(vkey)
    except TypeError:
        vkey = tuple(str(v) for v in vals)
    loose, vkey, kmetas, lift = opkeys.left_out(handle, keys, vals, vkey, metas)
    lead = None if shared else opkeys.ragged_lead(kmetas, loose)
    if lead is not None:     # a row-wise operator's calls merge whatever their lengths
        rkey = (OP, handle, tuple(keys), vkey, opkeys.unled(kmetas, lead), mode, output_is_list,
                RAGGED)
        info = TABLE.get(rkey)
        if info is not None and info is not _NOT_RAGGED:
            return info
    # every argument's context is in the key (as for blocks), so a call mixing
    # contexts never reuses a signature whose first call passed the check
    key = (OP, handle, tuple(keys), vkey, tuple(kmetas), mode, output_is_list, loose, shared)
    info = TABLE.get(key)
    if info is None:
        shapes = tuple((m[0], m[1]) for m in metas)
        name = _mxapi.op_name(handle)
        ctx = check_ctx(metas, "operator %s" % name)
        opkeys.check_reshape(name, keys, vals, shapes)
        wrong = gradients.WRONG_GRADIENT.get(name)
        if wrong is not None and mode[0]:
            raise NotDifferentiableError("operator %s, recorded by autograd: MXNet 1.9.1's "
                                         "gradient of it is wrong: %s." % (name, wrong))
        out_meta, by_value = op_outputs(handle, name, shapes, list(keys), list(vals), ctx)
        if out_meta is None:
            if by_value:
                VALUE_SHAPED.add(handle)
            return None
        svals = [str(v) for v in vals]
        at = tuple([k for k, _ in shared])      # passed once, as they are (gather.prepare)
        ins, outs = [m[0] for m in shapes], [m[0] for m in out_meta]
        rule = shared_rule(name, list(keys), svals, ins, outs, at) if at else \
            rule_for(name, list(keys), svals, ins, outs)
        if opkeys.empty(out_meta):
            # an empty output (NumPy shape semantics; an empty argument runs at
            # once, record.record_op): MXNet's reshape reads a 0 as "keep this
            # axis", so no rule can view it; one launch per call
            rule = lift = None
        attrs = dict(zip(keys, svals))
        cut = tuple([k for k in range(len(metas)) if not gradients.passes(name, k, attrs)])
        ex = OpExec(handle, name, rule, keys, svals, shapes, out_meta, ctx,
                    gradients.launch_mode(mode, len(cut) < len(metas)), opkeys.is_sum(loose),
                    lift)
        if mode[0] and cut:
            ex.cut = cut
        ex.shared = at if rule is not None else ()
        # (a lifted scalar operator merges by its broadcasting twin, rule or not:
        # MXNet's _maximum_scalar is _npi_maximum_scalar by name, which has none)
        info = TABLE.add(key, lambda sid: new_info(sid, key, ex, out_meta,
                                                   rule is not None or lift is not None, name))
    if lead is not None and TABLE.get(rkey) is None:
        # its operator maps rows to rows, or reduces each sample's rows: ragged
        made = ragged_exec(info.op, lead, info.out_meta) if info.batchable else None
        if made is not None:
            return TABLE.add(rkey, lambda sid: new_info(sid, rkey, made[0], made[1], True,
                                                        info.name))
        TABLE.add(rkey, lambda sid: _NOT_RAGGED)
    return info


# -- blocks -------------------------------------------------------------------------------
_NOT_RAGGED = object()   # TABLE's entry for a ragged key whose block (operator) is not ragged


def block_signature(block, allargs, flat, fmt, fkey, mode, exact):
    """The signature of a call of ``block`` not seen before (``exact``: its exact
    call key, ``flat`` its arrays, ``allargs`` its arguments as given)."""
    mc = [meta(a) for a in flat]
    check_ctx(mc, "block %s" % block.name)      # a call mixing devices is never stored
    shape0 = exact[EXACT_ARGS]
    lead = shape0[0] if shape0 else None
    pad = block._jb_pad
    skey = rkey = info = None
    if pad is not None:
        skey = _padded_key(block, pad, fmt, mc, mode, fkey)
    else:
        skey = (PLAIN,) + exact
        if lead is not None and all(m[0] and m[0][0] == lead for m in mc):
            rkey = block_key(RAGGED, block, fkey, tuple([(m[0][1:], m[1]) for m in mc]),
                             mc[0][2], mode)
            info = TABLE.get(rkey)
            if info is _NOT_RAGGED:
                info = rkey = None
    if info is None:
        info = TABLE.get(skey)
        if info is None:
            info = _trace(block, allargs, flat, fmt, mc, mode, skey, rkey, pad)
    _remember(EXACT, exact, info)
    return info


def _remember(table, exact, info):
    """Keep ``info`` as exact call ``exact``'s in ``table`` (``EXACT`` or
    ``OP_EXACT``), emptied first when it holds ``TABLE.limit`` calls."""
    if len(table) >= TABLE.limit:
        table.clear()
    table[exact] = info


def _padded_key(block, pad, fmt, mc, mode, fkey):
    """The signature key of a call to a block with zero-padded inputs: their
    sizes along the padded axes are left out of it."""
    if type(fkey) is not int:
        raise BatchingError(
            "block %s: zero_pad(%s) needs the block's inputs passed as separate arrays, "
            "but it was called with nested lists (%s). Fix: stack each list into one "
            "array (e.g. nd.stack(*children, axis=1))." % (block.name, pad_names(block), fmt))
    pmc = list(mc)
    for i, axis in pad.items():
        if i >= len(mc):
            raise BatchingError("block %s: zero_pad(%s) names input %d, but the call passed "
                                "%d arrays" % (block.name, pad_names(block), i, len(mc)))
        shape = mc[i][0]
        if len(shape) <= axis:
            raise BatchingError(
                "block %s: zero_pad(%s) pads input %d along axis %d, but it has shape %s "
                "(%d axes). Fix: pass it with the padded axis (e.g. shape (1, K, H)) or "
                "change the declared axis." % (block.name, pad_names(block), i, axis,
                                                shape, len(shape)))
        pmc[i] = (shape[:axis] + (None,) + shape[axis + 1:], mc[i][1], mc[i][2])
    return block_key(PADDED, block, fkey, tuple(pmc), mode)


def _trace(block, args, flat, fmt, mc, mode, key, rkey, pad=None):
    """Trace ``block`` and make the signature of a call on ``mc`` (per argument
    (shape, dtype, device)): plain under ``key``, ragged under ``rkey`` where
    its outputs keep any leading length, zero-padded where ``pad`` declares."""
    ctx = check_ctx(mc, "block %s" % block.name)
    try:
        inputs, out = block._get_graph(*args)  # pylint: disable=protected-access
    except (Unhybridized, TypeError):
        raise        # a TypeError is the user's (plain Gluon raises it too)
    except Exception as e:
        raise BatchingError("block %s could not be traced for dynamic batching: %s: %s"
                            % (block.name, type(e).__name__, e)) from e
    watch_params(block)
    for p in block.collect_params().values():   # plain Gluon's errors, at the call
        if p._data is None:  # pylint: disable=protected-access
            continue
        if p._stype != "default":  # pylint: disable=protected-access
            p.data(ctx)      # "use row_sparse_data()"
        else:
            p._check_and_get(p._data, ctx)  # pylint: disable=protected-access
    if block._in_format != fmt:  # pylint: disable=protected-access
        raise BatchingError(contract.structure_changed(  # pylint: disable=protected-access
            block.name, block._in_format, fmt, block.hybrid_forward))
    names = [s.name for s in inputs]
    shapes = [m[0] for m in mc]
    dtypes = [m[1] for m in mc]
    for i, s in enumerate(shapes):
        if len(s) == 0:
            raise BatchingError("block %s: argument %d has shape (); batching concatenates "
                                "along axis 0. Fix: give it a leading axis." % (block.name, i))
    kinds = sorted(set(np.dtype(d).name for d in dtypes))
    if len(kinds) > 1 and not _types_infer(block, out, names, dtypes):
        # (where MXNet infers the graph's types it takes them as they are: an
        # integer length beside float features, softmax's use_length)
        # the advice casts toward a floating dtype: integer ids cast to float stay
        # exact, features cast to an integer dtype would be truncated
        names_ = [np.dtype(d).name for d in dtypes]
        target = next((i for i, d in enumerate(dtypes)
                       if np.issubdtype(np.dtype(d), np.floating)), 0)
        odd = next(i for i, n in enumerate(names_) if n != names_[target])
        ids = not np.issubdtype(np.dtype(dtypes[odd]), np.floating) and \
            np.issubdtype(np.dtype(dtypes[target]), np.floating)
        raise BatchingError(
            "block %s: argument %d is %s but argument %d is %s; a call's arrays must share "
            "one dtype. Fix: cast argument %d with .astype('%s')%s."
            % (block.name, odd, names_[odd], target, names_[target], odd, names_[target],
               " (integer ids stay exact in float32 up to 2**24, and Embedding and take "
               "read float ids; where an operator wants integers, cast inside "
               "hybrid_forward: F.cast(x, 'int32'))" if ids else ""))
    finish_deferred(block, args, out)
    doubled = None     # why shapes cannot be inferred at twice the rows (None: they can)
    try:
        _, o1, _ = out.infer_shape_partial(**contract.used_inputs(out, names, shapes))
        _, ot, _ = out.infer_type(**_param_dtypes(block, out,
                                                  contract.used_inputs(out, names, dtypes)))
        try:
            _, o2, _ = out.infer_shape_partial(**contract.used_inputs(
                out, names, [(2 * s[0],) + tuple(s[1:]) for s in shapes]))
        except Exception as e:  # pylint: disable=broad-except
            if '"op": "RNN"' in out.tojson():
                raise
            # an operator pairs the sample with an array of fixed rows (a
            # constant or parameter of shape (K, ...)): one sample at a time
            # is what the block computes
            doubled, o2 = contract.doubling_mix(out, e, names, shapes), o1
    except Exception as e:
        if '"op": "RNN"' in out.tojson():
            raise BatchingError(
                "block %s holds a fused RNN layer (gluon.rnn.RNN/LSTM/GRU) and called with "
                "inputs %s its shapes cannot be inferred at twice the rows: the layer's batch "
                "axis is 1 in its states ((layers, N, H), as begin_state makes them) and in "
                "time-major (TNC) data, while jitbatch merges samples along axis 0. Fix: call "
                "the layer itself per sample with no explicit states (in layout NTC on (1, T, C), "
                "in TNC on (T, 1, C): jitbatch makes zero states for the merged rows), or loop "
                "its cell (gluon.rnn.GRUCell, LSTMCell) per step, or hybridize this block "
                "without dynamic_batch. (MXNet: %s)" % (block.name, shapes, first_line(e)))
        params = list(block.collect_params().values())
        pdt = {np.dtype(p.dtype).name for p in params}
        if len(pdt) == 1 and np.issubdtype(np.dtype(dtypes[0]), np.floating) and \
                np.dtype(dtypes[0]).name not in pdt:
            want = pdt.pop()
            raise InputShapeError(
                "block %s: argument 0 is %s but the block's parameters are %s, so MXNet "
                "cannot infer its outputs (%s). Fix: cast the input with .astype('%s'), or "
                "the block with .cast('%s')."
                % (block.name, np.dtype(dtypes[0]).name, want, first_line(e), want,
                   np.dtype(dtypes[0]).name)) from e
        head = "block %s: output shapes cannot be inferred from inputs %s (%s): %s." % (
            block.name, shapes, ", ".join(np.dtype(d).name for d in dtypes), first_line(e))
        broadcast = contract.unbroadcast_op(out, str(e))
        if broadcast is not None:
            raise BatchingError(
                "%s Its operator %s combines arrays of different shapes: NDArray's %s "
                "broadcasts them per sample, a traced graph does not (plain hybridize() "
                "fails the same way). Fix: F.%s in the block's hybrid_forward, or this "
                "block unhybridized (.hybridize(active=False) on it)." % ((head,) + broadcast)) \
                from e
        raise InputShapeError(
            "%s Fix: give the block inputs of the shapes and dtype its parameters were "
            "made for (its parameters: %s); or, where plain per-sample Gluon accepts these "
            "inputs, the block's code does what its traced graph cannot: run it "
            "unhybridized (.hybridize(active=False) on it)."
            % (head, ", ".join("%s %s %s" % (p.name, p.shape, np.dtype(p.dtype).name)
                               for p in params) or "none")) from e
    if doubled is None and any(contract.unknown_shape(a) for a in o1):
        flow = contract.control_flow(out)
        if flow is not None and mode[0] and flow.op in ("_cond", "_while_loop"):
            raise BatchingError(
                "block %s holds %s (graph node %s), recorded by autograd: MXNet 1.9.1's "
                "hybridized graphs give wrong gradients through it (garbage where a branch "
                "or iteration did not run; plain hybridize() too), so jitbatch does not run "
                "it. Fix: compute both branches and pick with F.where (a loop: unroll it to "
                "its fixed count), or call this block unhybridized (hybridize(active=False)) "
                "in training." % (block.name, flow.op, flow.node))
        if flow is not None:
            # MXNet infers no shapes through a subgraph; they do not depend on
            # the values (cond's branches and a loop's outputs have fixed
            # shapes), so one run on zeros gives them; the loop or predicate is
            # one per launch, so the calls run per sample
            o1 = o2 = _shapes_by_running(block, args, mode)
            doubled = flow
    for k, (a, b) in enumerate(zip(o1, o2)):
        if doubled is not None:
            break
        if contract.unknown_shape(a) or not b:
            raise BatchingError(
                "block %s: the shape of output %d cannot be inferred from input shapes %s%s. "
                "An output whose shape depends on the values (contrib.boolean_mask) cannot "
                "be merged. Fix: call such operators outside the flagged block, on its "
                "outputs, or hybridize this block without dynamic_batch."
                % (block.name, k, shapes, contract.unknown_shape_op(out, names, shapes)))
        if tuple(b) == tuple(a):
            doubled = contract.shared_output(out, k, a, names)   # one sample at a time
            if doubled is not None:
                break
        if b[0] != 2 * a[0] or tuple(b[1:]) != tuple(a[1:]):
            crossed = contract.crossed_rows(block.name, shapes, k, a, b, out, names)
            if crossed is not None:
                raise BatchingError(crossed)
            raise BatchingError(
                "block %s cannot be batched along axis 0: for inputs %s its output %d has "
                "shape %s, but for twice the rows it has %s (expected %s). Dynamic "
                "batching concatenates samples along axis 0, so every output row must "
                "depend only on its own sample. Fix: keep a per-sample leading axis (e.g. "
                "shape (1, K, H) instead of (K, H)) or hybridize this block without "
                "dynamic_batch." % (block.name, shapes, k, a, b,
                                    (2 * a[0],) + tuple(a[1:])))
    out_meta = tuple((tuple(a), _mxapi.dtype_key(t)) for a, t in zip(o1, ot))
    in_meta = tuple(zip(shapes, dtypes))
    mix = doubled or contract.sparse_added(block, mode) or \
        contract.check(out, names, shapes, mode[1], mode[0])
    reached = gradients.reached_variables(out) if mode[0] else None
    # recorded: the inputs no output depends on differentiably (all where none does)
    cut = tuple([k for k, name in enumerate(names) if name not in reached]) if mode[0] else ()
    used = set(out.list_inputs())
    unused = tuple([k for k, name in enumerate(names) if name not in used])
    mode = gradients.launch_mode(mode, not mode[0] or bool(reached))
    if mix is not None:
        # exact only one sample at a time: each call runs as its own launch
        if pad is not None:
            contract.check_pad_outputs(block, out, names, shapes, o1, pad)
        why = _unmergeable(block, mix)
        if rkey is not None:
            TABLE.add(rkey, lambda sid: _NOT_RAGGED)
        ex = BlockExec(block, fmt, in_meta, out_meta, ctx, mode, merges=False)
        ex.why = why    # config.strict set later raises it (record_block)
        ex.cut, ex.unused = cut, unused
        return TABLE.add(key, lambda sid: new_info(sid, key, ex, out_meta, False, block.name))
    if pad is not None:
        contract.check_pad_outputs(block, out, names, shapes, o1, pad)
        in_meta = tuple((s[:pad[i]] + (None,) + s[pad[i] + 1:] if i in pad else s, d)
                        for i, (s, d) in enumerate(in_meta))
    elif rkey is not None and contract.rowwise_any_length(out, names, shapes, o1):
        # ragged: samples of any leading length merge; sizes live on the nodes
        out_meta = tuple(((None,) + tuple(a[1:]), t) for a, t in out_meta)
        ex = BlockExec(block, fmt, tuple(((None,) + tuple(s[1:]), d)
                                         for s, d in zip(shapes, dtypes)), out_meta, ctx, mode)
        ex.cut, ex.unused = cut, unused
        return TABLE.add(rkey, lambda sid: new_info(sid, rkey, ex, out_meta, True, block.name))
    if rkey is not None:
        TABLE.add(rkey, lambda sid: _NOT_RAGGED)
    ex = BlockExec(block, fmt, in_meta, out_meta, ctx, mode, pad and dict(pad))
    ex.cut, ex.unused = cut, unused
    info = TABLE.add(key, lambda sid: new_info(sid, key, ex, out_meta, True, block.name))
    if pad is not None:
        info.pad_axes = tuple(sorted(pad.items()))
    return info


_WARNED = set()   # (block name, operator node) already warned about


def _param_dtypes(block, out, known):
    """``known`` (input name -> dtype) with the dtypes of the block's parameters
    as they hold them: a parameter's symbol keeps the dtype it was made with,
    which ``block.cast`` does not change."""
    args = set(out.list_arguments())
    for p in block.collect_params().values():
        if p.name in args and p.name not in known and p._data is not None:  # pylint: disable=protected-access
            known[p.name] = p._data[0].dtype  # pylint: disable=protected-access
    return known


class InputShapeError(BatchingError, MXNetError):
    """A block called with inputs its graph cannot take (shapes, dtypes): an
    ``MXNetError`` too, as per sample MXNet raises one there (a loop that skips
    malformed samples with ``except MXNetError`` goes on)."""


def _shapes_by_running(block, args, mode):
    """Output shapes of ``block`` called on zeros shaped as ``args`` (nested
    lists of arrays), autograd paused, in the call's train mode."""
    def zeros(a):
        if isinstance(a, (list, tuple)):
            return [zeros(b) for b in a]
        if a is None:
            return None
        return _mxapi.trial(tuple(a.shape), a.context, a.dtype)
    with autograd.pause(train_mode=mode[1]):
        res = block._call_cached_op(*[zeros(a) for a in args])  # pylint: disable=protected-access
    outs, _ = _flatten(res, "output")
    for o in outs:
        o.wait_to_read()
    return [o.shape for o in outs]


def _types_infer(block, out, names, dtypes):
    """Whether MXNet infers the output types of graph ``out`` on inputs of
    ``dtypes`` (of several kinds) and the block's parameters."""
    try:
        out.infer_type(**_param_dtypes(block, out, contract.used_inputs(out, names, dtypes)))
    except Exception:  # pylint: disable=broad-except
        return False
    return True


def _unmergeable(block, mix):
    """Say once per block and operator that ``block``'s calls run per sample
    (``mix``: why), or raise under ``config.strict``; returns the error's text
    (``config.strict`` set later raises it)."""
    what = ("block %s cannot merge its calls: its operator %s (graph node %s) %s."
            % (block.name, mix.op, mix.node, mix.why))
    fix = ("Fix: keep each sample's rows apart inside the block (per-sample data with a "
           "leading axis of 1, reductions and random draws over the other axes), or hybridize "
           "this block without dynamic_batch")
    error = ("%s jitbatch.config.strict is set, so this is an error (without it the calls "
             "would run unmerged, each on its own). %s." % (what, fix))
    if _config.strict:
        raise BatchingError(error)
    if (block.name, mix.node) not in _WARNED:
        _WARNED.add((block.name, mix.node))
        warnings.warn("%s Its calls run one per sample: exact, not batched. %s; "
                      "jitbatch.config.strict = True makes this an error." % (what, fix),
                      ContractWarning, stacklevel=2)
    return error
