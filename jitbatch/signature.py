"""Structural signatures, interned to small ints, with bounded per-signature metadata."""
from collections import OrderedDict


class SigInfo(object):
    """What every node of one signature shares: computed once, when first seen.

    ``op`` is the backend's executor for the signature; ``out_meta`` a tuple of
    ``(shape, dtype)`` per output (per-sample shapes); ``out_rows`` per output
    its rows per sample (None: ragged, each node has its own) and the shape of
    one row; ``batchable`` False means nodes run one launch each (no batching
    rule). ``pad_axes`` is None, or for a signature whose calls differ in a
    zero-paddable size (``jitbatch.zero_pad``) its padded ``(input, axis)``
    pairs: each node's size (the largest along them) is taken when it is
    recorded (``Node.pad``), a launch pads every node to its largest, and
    ``pad_fit`` sums what the cost model needs to price that padding
    (``cost.Model.pad_costs``)."""
    __slots__ = ("id", "key", "op", "out_meta", "out_rows", "batchable", "name", "launch_cost",
                 "launch_rows", "launches", "launch_rr", "launch_cr", "pad_axes", "pad_fit",
                 "pad_seen", "stops", "live")

    def __init__(self, sid, key, op, out_meta, batchable, name):
        self.id = sid
        self.key = key
        self.op = op
        self.out_meta = out_meta
        self.out_rows = tuple((m[0][0] if m[0] else 1, tuple(m[0][1:])) for m in out_meta)
        self.batchable = batchable
        self.name = name
        self.launch_cost = 0.0   # measured seconds, summed
        self.launch_rows = 0     # nodes run through those launches
        self.launches = 0
        self.launch_rr = 0       # sum of rows^2 and of seconds*rows: a least-squares
        self.launch_cr = 0.0     # line of launch time against rows (cost.Model)
        self.pad_axes = None
        self.pad_fit = None
        self.pad_seen = 0        # flushes this padded signature ran in
        # the inputs whose gradient its recorded calls' launches stop (a launch
        # run unrecorded, inputs detached): None where none (Graph.stops)
        self.stops = None
        # False once the table evicted it: lookups that kept it (the exact-call
        # tables) treat it as unknown, so all new calls get one successor
        self.live = True

    def inherit(self, old):
        """Take over ``old``'s launch measurements (the same call re-traced, e.g.
        after ``hybridize()`` again: new signature, same costs)."""
        self.launch_cost = old.launch_cost
        self.launch_rows = old.launch_rows
        self.launches = old.launches
        self.launch_rr = old.launch_rr
        self.launch_cr = old.launch_cr
        self.pad_fit = list(old.pad_fit) if old.pad_fit is not None else None
        self.pad_seen = old.pad_seen


class SignatureTable(object):
    """Interns signature tuples to SigInfo, least-recently-created evicted past
    ``limit`` (a long run with ever-new shapes must not grow without bound)."""

    def __init__(self, limit=4096):
        self.limit = limit
        self._table = OrderedDict()
        self._next = 0
        self.evictions = 0

    def get(self, key):
        return self._table.get(key)

    def add(self, key, make):
        """Create the SigInfo of ``key`` with ``make(sid)``, insert and return it."""
        sid = self._next
        self._next += 1
        info = make(sid)
        self._table[key] = info
        while len(self._table) > self.limit:
            _, old = self._table.popitem(last=False)
            if isinstance(old, SigInfo):
                old.live = False
            self.evictions += 1
        return info

    def __len__(self):
        return len(self._table)

    def clear(self):
        self._table.clear()
