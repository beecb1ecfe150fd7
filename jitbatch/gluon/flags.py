"""The user's settings on blocks: the ``hybridize`` flags and ``zero_pad`` declarations.

Flags are validated when ``hybridize`` is called (``FlagError`` at once) and kept
per block as a ``BatchConfig`` (``block._jb_cfg``; None: not flagged)."""
import difflib
import inspect
import itertools
import numbers

from mxnet.gluon.block import HybridBlock

from ..errors import FlagError
from ..schedule import POLICIES

#: the keyword arguments of ``hybridize`` that are jitbatch's
FLAG_KEYS = ("dynamic_batch", "policy", "analysis_budget", "granularity")
GRANULARITIES = ("auto", "block", "split")
#: numbers for networks and blocks, never reused (``id()`` of a freed object is)
_SERIALS = itertools.count(1)


class BatchConfig(object):
    """The dynamic-batching flags of one block (set tree-wide by ``hybridize``)."""
    __slots__ = ("policy", "budget", "granularity", "serial")

    def __init__(self, policy, budget, granularity="auto"):
        self.policy = policy
        self.budget = budget
        self.granularity = granularity
        self.serial = next(_SERIALS)   # names the network (``pipeline.Pipelines``)

    def __repr__(self):
        return "BatchConfig(policy=%r, analysis_budget=%r, granularity=%r)" % (
            self.policy, self.budget, self.granularity)


class Unhybridized(Exception):
    """Raised by the tracing of a flagged block that a traced graph cannot run
    as per sample: its ``hybrid_forward`` asked ``autograd.is_training()`` or
    ``is_recording()`` (the graph would keep its first call's answer, as
    plain ``hybridize()`` does), or it makes sparse storage (a launch hands
    out dense rows). The block is left unhybridized (``block``) and the call
    runs as per sample, its operators recorded one by one."""

    def __init__(self, block):
        Exception.__init__(self, block.name)
        self.block = block


class Token(object):
    """What a block's signatures are recorded under (``block._jb_token``,
    held by their keys): a new token when its structure or declarations change
    makes them stale. ``block`` numbers the block for the process's life, so
    measurements carry over from its old tokens and never from a freed block
    whose ``id()`` a new one got."""
    __slots__ = ("block",)

    def __init__(self, block):
        self.block = block


def renew_token(block):
    """Give ``block`` a new :class:`Token` (the same block number)."""
    old = block._jb_token
    block._jb_token = Token(next(_SERIALS) if old is None else old.block)


def misspelt_flag(block, kwargs, known):
    """FlagError for a keyword of ``hybridize`` that is none of MXNet's
    (``known``) and nearly one of jitbatch's flags (MXNet would take it for a
    CachedOp flag and ignore it: the block would run unbatched, silently)."""
    for key in kwargs:
        if key not in known and key not in FLAG_KEYS:
            near = difflib.get_close_matches(key, FLAG_KEYS, n=1, cutoff=0.75)
            if near:
                raise FlagError("hybridize(%s=%r) on %s: unknown flag (MXNet would ignore it "
                                "and the block would run unbatched). Fix: %s=%r."
                                % (key, kwargs[key], block.name, near[0], kwargs[key]))


def parse_flags(block, kwargs):
    """The ``BatchConfig`` of jitbatch's flags in ``kwargs`` (popped), or None
    for ``dynamic_batch=False``; FlagError naming the bad value."""
    if "dynamic_batch" not in kwargs and kwargs:
        raise FlagError("hybridize(%s) on %s: %s only with dynamic_batch=True (without "
                        "it the block is hybridized plainly and runs unbatched). Fix: "
                        "hybridize(dynamic_batch=True, %s)."
                        % (", ".join("%s=%r" % kv for kv in kwargs.items()), block.name,
                           " and ".join(kwargs), ", ".join("%s=%r" % kv for kv in kwargs.items())))
    db = kwargs.pop("dynamic_batch", False)
    policy = kwargs.pop("policy", "auto")
    budget = kwargs.pop("analysis_budget", None)
    gran = kwargs.pop("granularity", "auto")
    if not isinstance(db, bool):
        raise FlagError("hybridize(dynamic_batch=%r) on %s: expected True or False"
                        % (db, block.name))
    if policy not in POLICIES:
        raise FlagError("hybridize(policy=%r) on %s: unknown policy; expected one of %s"
                        % (policy, block.name, ", ".join(repr(p) for p in POLICIES)))
    if budget is not None:
        if isinstance(budget, bool) or not isinstance(budget, numbers.Real) or not budget >= 0:
            raise FlagError("hybridize(analysis_budget=%r) on %s: expected a number >= 0 "
                            "(a fraction of the flush's predicted execution time) or None"
                            % (budget, block.name))
    if gran not in GRANULARITIES:
        raise FlagError("hybridize(granularity=%r) on %s: expected one of %s ('block': a "
                        "call is one node; 'split': a recursive block's input stage runs "
                        "as one launch across depths; 'auto': the cost model decides)"
                        % (gran, block.name, ", ".join(repr(g) for g in GRANULARITIES)))
    return BatchConfig(policy, None if budget is None else float(budget), gran) if db else None


def zero_pad(block, **axes):
    """Declare that zero entries along an axis of some of ``block``'s inputs add
    nothing to its outputs or to any gradient (e.g. absent children in a
    child-sum cell), so calls whose inputs differ only in that axis's size may
    run as one launch, each zero-padded to the largest size in it.

    ``axes`` maps an input's name in ``hybrid_forward`` to the axis (>= 1; axis
    0 is the batch axis). ``jitbatch.zero_pad(block)`` removes the declaration.
    jitbatch cannot check the claim; a wrong one gives wrong results (test the
    block batched against plain Gluon, as tests/test_differential.py does).
    The claim covers the backward pass in floating point: a padded row that is
    NaN anywhere (0/0 in a norm, a softmax of a row masked with -inf) makes
    the gradients NaN even where the result masks it out (0 * NaN)."""
    if not isinstance(block, HybridBlock):
        raise FlagError("zero_pad(%r): expected a HybridBlock instance, got %s"
                        % (block, type(block).__name__))
    params = list(inspect.signature(block.hybrid_forward).parameters.values())
    data = []
    for p in params[1:]:          # params[0] is F
        if p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD or p.name in block._reg_params:  # pylint: disable=protected-access
            break
        data.append(p.name)
    pos = {}
    for name, axis in sorted(axes.items()):
        if name not in data:
            raise FlagError("zero_pad(%s, %s=...): %s.hybrid_forward has no input named %r; "
                            "its inputs are %s" % (block.name, name, type(block).__name__,
                                                   name, ", ".join(data) or "(none)"))
        if isinstance(axis, bool) or not isinstance(axis, int) or axis < 1:
            raise FlagError("zero_pad(%s, %s=%r): expected an axis >= 1 (axis 0 is the "
                            "batch axis, along which samples of any length merge already)"
                            % (block.name, name, axis))
        pos[data.index(name)] = axis
    block._jb_pad = pos or None
    block._jb_pad_names = dict(axes) or None
    renew_token(block)    # signatures recorded under the old declaration
    return block


def pad_names(block):
    """``block``'s zero_pad declaration as written (for messages)."""
    return ", ".join("%s=%d" % kv for kv in sorted((block._jb_pad_names or {}).items()))
