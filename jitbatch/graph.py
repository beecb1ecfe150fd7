"""The lazy graph: nodes recorded per sample, one pending graph per thread."""
import threading
import time

try:
    import cython   # compiled: the local type annotations below are C declarations
except ImportError:  # running from source without Cython installed
    from . import _nocython as cython

from . import config, gcdefer
from .stats import STATS

from .errors import StaleValueError


class Ref(object):
    """Mixin marking a lazy value. Subclasses define the slots ``_node`` (the
    producing Node) and ``_k`` (its output index); everything else about the value
    (views, shape) is the backend's business."""
    __slots__ = ()


class Node(object):
    """One recorded per-sample call.

    ``inputs`` holds the call's tensor arguments as given (lazy Refs or concrete
    arrays), ``depth`` is 1 + the deepest pending producer, ``site`` a cheap call
    site for error messages (``pad``: see ``SigInfo.pad_axes``; ``lifted``: the
    value of an attribute its signature leaves out, e.g. the scalar of ``x /
    n``). After execution ``batch`` holds the launch's outputs (flat batched
    arrays) and ``row`` this node's position in them."""
    __slots__ = ("info", "inputs", "depth", "site", "mode", "batch", "row",
                 "error", "graph", "seq", "group", "plan", "rows", "off", "users", "wait", "height",
                 "pad", "lifted", "severed")

    def __init__(self, info, inputs, depth, site, mode, graph, seq, rows=None):
        self.info = info
        self.inputs = inputs
        self.depth = depth
        self.site = site
        self.mode = mode
        self.batch = None
        self.row = -1
        self.error = None
        self.graph = graph
        self.seq = seq
        self.group = None   # the Group of its batch, once scheduled
        self.plan = None    # backend's input plan of its batch (first node only)
        self.rows = rows    # leading length of a ragged signature's node, else None
        self.off = 0        # first row of a ragged node in its batch's outputs
        self.users = None   # pending nodes that read this one (one entry per read)
        self.wait = 0       # reads of pending producers (scheduling counts them down)
        self.height = 1     # longest path to a sink (computed by the agenda)
        self.pad = 0        # a zero-padded signature's node: its size along the padded axes
        self.lifted = None  # its value of the attribute its signature leaves out, if any
        self.severed = False  # left out of a backward that freed its launch's record

    def __repr__(self):
        state = "done" if self.batch is not None else ("failed" if self.error else "pending")
        return "<Node #%d %s depth=%d %s>" % (self.seq, self.info.name, self.depth, state)


class Composite(object):
    """The producer of a lazy value made only of other values' rows (a stack of
    per-sample rows, a concatenation along axis 0): no node, no launch of its
    own. Consumers depend on, and gather from, its ``parts`` (read on its own,
    its value is their rows concatenated). ``batch`` is never None: it is not
    pending itself. ``nodes``: the pending nodes behind its parts when it was
    made (through nested composites; consumers link to those still pending)."""
    __slots__ = ("parts", "mode", "depth", "nodes")
    batch = ()
    error = None
    users = None

    def __init__(self, parts, mode):
        self.parts = parts
        self.mode = mode
        d = 0
        nodes = []
        for x in parts:
            if isinstance(x, Ref):
                p = x._node
                if type(p) is Node:
                    pn: Node = p
                    if pn.batch is None:
                        nodes.append(p)
                        if pn.depth > d:
                            d = pn.depth
                elif type(p) is Composite:
                    pc: Composite = p
                    nodes.extend(pc.nodes)
                    if pc.depth > d:
                        d = pc.depth
        self.depth = d
        self.nodes = nodes

    @property
    def failed(self):
        for x in self.parts:
            if isinstance(x, Ref):
                p = x._node
                err = p.failed if type(p) is Composite else p.error
                if err is not None:
                    return err
        return None


def _sources(x):
    """The producers one lazy input reads: its node, or the nodes behind a composite."""
    p = x._node
    if type(p) is Composite:
        ps = []
        _producers(x, ps)
        return ps
    return (p,) if type(p) is Node else ()


def _producers(x, out):
    """Pending producer nodes behind a composite input (through nested composites)."""
    c: Composite = x._node
    p: Node
    for p in c.nodes:
        if p.batch is None:
            out.append(p)


class Group(object):
    """One scheduled batch: its size, and its outputs once launched."""
    __slots__ = ("size", "outs", "rows")

    def __init__(self, size):
        self.size = size
        self.outs = None
        self.rows = 0       # total leading rows of a ragged batch


class Graph(object):
    """The pending nodes of one thread, in record order."""

    def __init__(self):
        self.nodes = []
        self.thread = recorder()
        self.seq = 0
        self.executing = False
        self.backend = None    # what runs it (execute.Backend), set by its first record
        self.policy = None
        self.budget = None
        self.granularity = None
        self.passthrough = 0   # calls to run eagerly ('auto' found nothing to merge)
        self.quiet = 0         # 'auto' flushes in a row that found nothing to merge
        self.singles = 0       # 'auto' flushes of one node in a row (a read after every call)
        self.chunk_merged = False   # a pipelined chunk of the current graph merged
        self.scope = 0         # unflagged blocks running on lazy arguments (hook._forward)
        self.limit = config.max_pending   # pending nodes at which the graph runs itself
        self.autograd = None   # the backend's: the thread's autograd state as last read,
        self.autograd_gen = -1  # valid while the backend's setter count is this
        self.reads = {}        # id -> what pending nodes read: concrete arrays (a write to
                               # one runs the graph first, see writes.before_write), blocks
        self.spans = None      # the memory of what reads holds, made at a write (record)
        self.aliased = []      # weak references to lazy arrays that read others' memory
                               # when computed (composites, reshape/detach views): an
                               # in-place write to what they read computes them first
        self.aliased_cap = 1024  # len(aliased) at which dead references are dropped
        self.retired = []      # node lists of finished flushes (see retire)
        self.kept = []         # node lists of the current graph, inputs freed
        self.kept_before = []  # ... of the graph before it
        self.sharing = None    # the jitbatch.map whose samples record here (its read hook)
        self.unpiped = False   # recorded (partly) by a map's samples: pipeline learns nothing from it
        self.net = None        # the number of the network whose block began it (pipeline key)
        # a recorded call stopped a lazy input's gradient (SigInfo.stops): a
        # backward walks for it (history.stopped_params); STOPS_SEEN after a
        # backward, dropped when the next recording begins
        self.stops = 0

    def add(self, info, inputs, site, mode, rows=None):
        if not self.nodes:
            if self.stops == STOPS_SEEN:
                self.stops = 0
            if config.defer_gc and _local.graph is self:
                gcdefer.defer(self)
        if info.stops is not None and self.stops != STOPS_RECORDED and mode[0] and \
                _stops_lazy(info.stops, inputs):
            self.stops = STOPS_RECORDED
        n: Node = Node(info, inputs, 1, site, mode, self, self.seq, rows)
        p: Node
        c: Composite
        wait: cython.Py_ssize_t = 0
        d = 0
        try:
            for x in inputs:
                if isinstance(x, Ref):
                    q = x._node
                    if type(q) is Node:
                        p = q
                        if self._link(n, p):
                            wait += 1
                            if p.depth > d:
                                d = p.depth
                    elif type(q) is Composite:     # else: not pending (a detached value)
                        c = q
                        for p in c.nodes:
                            if self._link(n, p):
                                wait += 1
                                if p.depth > d:
                                    d = p.depth
        except StaleValueError:
            self._unlink(n, inputs)
            if not self.nodes:
                gcdefer.restore(self)
            raise
        n.wait = wait
        n.depth = d + 1
        self.seq += 1
        self.nodes.append(n)
        return n

    def _link(self, n, p):
        """Node ``n`` reads ``p``: if ``p`` is pending in this graph, ``n`` becomes
        one of its users (True)."""
        pn: Node = p
        if pn.batch is None and pn.error is not None:
            # dropped with a call that raised (``discard_since``): it never runs
            raise StaleValueError(
                "an input of this call (%s, recorded at %s) belongs to a call that raised "
                "while recording (%s: %s), whose calls were dropped, nested calls that "
                "returned included. Fix: record it again (do not keep values made inside "
                "a call that may raise, e.g. in a memo, before the call returns)."
                % (pn.info.name, pn.site or "?", type(pn.error).__name__, pn.error)) \
                from pn.error
        if pn.batch is None and pn.graph is self:
            users = pn.users
            if users is None:
                pn.users = [n]
            else:
                users.append(n)
            return True
        if pn.batch is None and pn.error is None:
            pn.graph.check_thread()     # pending in another thread's graph: refused
        return False

    def _unlink(self, n, inputs):
        """Undo the links a refused record of node ``n`` made to its producers."""
        for x in inputs:
            if isinstance(x, Ref):
                for p in _sources(x):
                    if p.graph is self and p.users:
                        p.users = [u for u in p.users if u is not n] or None

    def insert_producer(self, n, info, inputs, site):
        """A new pending node of ``info`` reading ``inputs`` that pending node
        ``n`` will read (an input stage split off a call at flush time: the
        caller then points ``n`` at its outputs). Its depth sits between its
        producers' and ``n``'s, so all such nodes whose inputs share a depth
        form one group."""
        a: Node = Node(info, inputs, 1, site, n.mode, self, n.seq, n.rows)
        p: Node
        d = 0
        w = 0
        for x in inputs:
            if isinstance(x, Ref):
                for p in _sources(x):
                    if self._link(a, p):
                        w += 1
                        if p.depth > d:
                            d = p.depth
        a.depth = d + 0.5
        a.wait = w
        a.users = [n]
        n.wait += 1
        return a

    def take(self):
        """Remove and return the pending nodes (the flush owns them from here)."""
        nodes, self.nodes = self.nodes, []
        self.reads = {}
        self.spans = None
        self.limit = config.max_pending   # the next graph's first record sets its own
        return nodes

    def done(self):
        """The flush is over: the GC's older generations need not wait for this graph."""
        gcdefer.restore(self)

    def retire(self, nodes, release, ends_graph=True):
        """Keep a flush's executed ``nodes`` with their inputs until a release:
        at once where ``release`` (a read forced the flush and now waits for
        its kernels, or the flush was a chunk of a graph still recording,
        whose objects are freed best while they are fresh), else at the next
        read, or when more than ``RETIRED_FLUSHES`` flushes or
        ``config.max_pending`` nodes are kept (bounded memory). ``ends_graph``:
        nothing recorded since belongs to this graph (see ``release``)."""
        if nodes:
            self.retired.append(nodes)
        if release:
            self.release(ends_graph)
        elif len(self.retired) > RETIRED_FLUSHES or \
                sum(map(len, self.retired)) > config.max_pending:
            self.release(True)

    def release(self, ends_graph=True):
        """Free the inputs of the retired nodes (lazy arrays, composites, the
        links between nodes) and hold the node lists: those of a graph are
        dropped when the next graph ends, by which time the user has dropped
        the outputs, so that the nodes are freed there, not while the next
        minibatch records. Call it where the thread is about to wait for
        kernels: freeing a graph is ~10% of a Tree-LSTM inference batch, which
        in front of the next launches (or when the next batch's recording
        drops the last output) delays the kernels, and during the wait costs
        nothing."""
        t0 = time.perf_counter()
        lists = self.retired
        n: Node
        for lst in lists:
            for n in lst:
                n.inputs = ()
                n.users = None
        self.kept.extend(lists)
        self.retired = []
        if ends_graph:
            self.kept_before = self.kept   # the lists this drops are freed here too
            self.kept = []
        STATS.add(release_seconds=time.perf_counter() - t0)

    def discard_since(self, mark, error):
        """Drop the nodes recorded after the first ``mark`` ones (a user call that
        raised while recording): they are marked failed with ``error`` and
        unlinked from their producers, so the next flush runs only the rest."""
        dropped = self.nodes[mark:]
        if not dropped:
            return 0
        del self.nodes[mark:]
        gone = set(map(id, dropped))
        for n in dropped:
            n.error = error
            for x in n.inputs:
                if isinstance(x, Ref):
                    for p in _sources(x):
                        if p.batch is None and p.users and id(p) not in gone:
                            p.users = [u for u in p.users if id(u) not in gone] or None
            n.inputs = ()
            n.users = None
        if not self.nodes:
            gcdefer.restore(self)
        return len(dropped)

    def check_thread(self):
        if recorder() != self.thread:
            raise StaleValueError(
                "a lazy array recorded in thread %d was used in thread %d: jitbatch graphs "
                "are per thread. Fix: read the value (e.g. .asnumpy()) or call "
                "jitbatch.flush() in the recording thread before handing it over."
                % (self.thread, threading.get_ident()))


#: flushes whose nodes are kept at most without a read releasing them (see Graph.retire)
RETIRED_FLUSHES = 16


class _Local(threading.local):
    """This thread's graph and the thread it records for (defaults as class
    attributes: a missing thread-local attribute is an exception raised and
    caught inside ``getattr``, ~0.3 us, on every lookup in a new thread)."""
    graph = None
    owner = None


_local = _Local()


def reached_from(heads, severed):
    """``(ids, reads)``: the ids of the pending nodes that the pending nodes
    ``heads`` read, directly or through others (``heads`` included), what a
    backward from them reaches of the graph; and, where ``severed`` (some
    node was marked by ``sever``), the ``(reader, node)`` pairs of those that
    read a marked node."""
    seen = set()
    reads = []
    todo = list(heads)
    n: Node
    p: Node
    c: Composite
    while todo:
        n = todo.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        for x in n.inputs:
            if isinstance(x, Ref):
                q = x._node
                if type(q) is Node:
                    p = q
                    if p.batch is None:
                        todo.append(p)
                    elif severed and p.severed:
                        reads.append((n, p))
                elif type(q) is Composite:
                    c = q
                    for p in c.nodes:
                        if p.batch is None:
                            todo.append(p)
                        elif severed and p.severed:
                            reads.append((n, p))
    return seen, reads


#: Graph.stops: a call stopping a gradient recorded since the last backward;
#: one recorded before it (later backwards of that recording may still reach it)
STOPS_RECORDED, STOPS_SEEN = 1, 2


def _stops_lazy(positions, inputs):
    """Whether some input at ``positions`` is a lazy array computed by a call
    (a value it may stop the gradient of; a concrete one, or one its
    executor made from data (``source``): a loss's labels, token ids, has
    none to stop)."""
    p: Node
    for k in positions:
        if k < len(inputs) and isinstance(inputs[k], Ref):
            q = inputs[k]._node
            if type(q) is Composite:
                return True
            if type(q) is Node:
                p = q
                if not getattr(p.info.op, "source", False):
                    return True
    return False


def only_sinks(nodes, heads):
    """Whether every node of ``nodes`` that no other reads is one of ``heads``
    (ids): then a backward from them reaches all of ``nodes``."""
    n: Node
    for n in nodes:
        if n.users is None and id(n) not in heads:
            return False
    return True


def sever(nodes, reached):
    """A backward from nodes whose ids are ``reached`` freed the record of
    every launch it reached: mark the other nodes of those launches."""
    n: Node
    hit = set()
    marked = 0
    for n in nodes:
        if id(n) in reached and n.group is not None:
            hit.add(id(n.group))
    for n in nodes:
        if id(n) not in reached and n.group is not None and id(n.group) in hit:
            n.severed = True
            marked += 1
    return marked


def current_graph():
    g = _local.graph
    if g is None:
        g = _local.graph = Graph()
    return g


def recorder():
    """The thread whose graph this thread records into: itself, or the thread
    whose ``jitbatch.map`` runs a sample here (see :func:`share`)."""
    owner = _local.owner
    return threading.get_ident() if owner is None else owner


def share(graph, owner):
    """Make this thread record into ``graph``, the graph of thread ``owner``
    (None: back to a graph of its own, made at its next record)."""
    _local.graph = graph
    _local.owner = owner
