"""Outputs a traced graph cannot hold: namedtuples and None among a flagged block's outputs.

MXNet's tracing flattens what ``hybrid_forward`` returns into one group of
symbols: a namedtuple comes back as a list (plain ``hybridize()`` too) and a
None fails the trace (``symbol.Group``). Per-sample Gluon, unhybridized,
returns them as written, and user code reads ``posterior.mu``. So the trace
of a flagged block hands MXNet the arrays alone (``traced``) and keeps the
structure (a *template*), and each call's outputs are rebuilt into it
(``rebuild``). Blocks without such outputs keep no template and pay nothing."""

LEAF = 0       # an array (a symbol when traced)
NONE = -1      # a None


def _is_namedtuple(value):
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def clean(value):
    """``(arrays, template)``: ``value`` with its Nones dropped and its
    namedtuples made tuples, and the template that rebuilds it (None where
    nothing needs rebuilding)."""
    special = [False]

    def walk(v):
        if v is None:
            special[0] = True
            return None, NONE
        if isinstance(v, (list, tuple)):
            named = _is_namedtuple(v)
            if named:
                special[0] = True
            parts = [walk(x) for x in v]
            kept = [p for p, t in parts if t != NONE]
            ctor = type(v) if named or type(v) in (list, tuple) else list
            return (tuple(kept) if isinstance(v, tuple) else kept), (ctor, [t for _, t in parts])
        return v, LEAF
    arrays, template = walk(value)
    return arrays, (template if special[0] else None)


def rebuild(template, value):
    """``value`` (Gluon's regrouped outputs: lists of arrays, Nones dropped)
    in the structure ``template`` records. A value that already has it (the
    block ran unhybridized, or on symbols) is returned as it is."""
    if template == LEAF or template == NONE:
        return value
    ctor, kids = template
    if not isinstance(value, list):
        return value
    holes = kids.count(NONE)
    if holes and len(value) == len(kids):
        # as written (an unhybridized run returned its own list): the Nones are in it
        parts = [None if k == NONE else rebuild(k, v) for k, v in zip(kids, value)]
    else:
        it = iter(value)
        parts = [None if k == NONE else rebuild(k, next(it)) for k in kids]
    if ctor is list:
        return parts
    if ctor is tuple:
        return tuple(parts)
    return ctor(*parts)


def traced(block, trace):
    """Run ``trace()`` (MXNet's tracing of ``block``) with its
    ``hybrid_forward`` giving MXNet the arrays alone; the template of what it
    returned (None: nothing to rebuild)."""
    seen = [None]
    forward = block.hybrid_forward

    def arrays_only(*args, **kwargs):
        out, seen[0] = clean(forward(*args, **kwargs))
        return out
    block.__dict__["hybrid_forward"] = arrays_only
    try:
        trace()
    finally:
        del block.__dict__["hybrid_forward"]
    return seen[0]
