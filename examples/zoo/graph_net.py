"""Graph network: message passing over a small random graph, one graph per sample.

Per sample (``n`` nodes, 5-20, connected, undirected): one ``nd.array`` of the
node types, one embedding lookup (the initial node states, rows of it), then
ROUNDS rounds of: every node's message (a Dense block on its state), every
node's incoming messages summed with ``nd.add_n`` over its neighbours, and its
state updated by a ``GRUCell`` (input: the summed messages). The graph is read
out as the mean of its node states (``nd.add_n`` of all of them / n) through
an MLP into CLASSES logits.

Hand-batched reference: all nodes of the minibatch's graphs as rows of one
matrix; per round one message call on all of them, the neighbour sums as a
``take`` of an ``(N, max degree)`` neighbour index (missing neighbours read a
zero row) summed by a product with a ones vector, one ``GRUCell`` call; the
read-out sums each graph's rows the same way."""
import numpy as np
from mxnet import gluon, nd
from mxnet.gluon import nn

from .common import cross_entropy, gather_sum, index_array, labels_of, seeded

__all__ = ["GraphNet", "GraphSample", "build", "generate", "forward", "loss", "HandBatched",
           "ROUNDS", "CLASSES"]

ROUNDS = 3
CLASSES = 4


class GraphNet(gluon.Block):
    def __init__(self, types, hidden, **kwargs):
        super(GraphNet, self).__init__(**kwargs)
        with self.name_scope():
            self.embed = nn.Embedding(types, hidden)
            self.message = nn.Dense(hidden, in_units=hidden, activation="relu")
            self.update = gluon.rnn.GRUCell(hidden, input_size=hidden)
            self.readout = nn.HybridSequential()
            self.readout.add(nn.Dense(hidden, in_units=hidden, activation="relu"),
                             nn.Dense(CLASSES, in_units=hidden))

    def forward(self, types, neighbours):  # pylint: disable=arguments-differ
        emb = self.embed(nd.array(types))                    # (n, H)
        states = [emb[v:v + 1] for v in range(len(types))]
        for _ in range(ROUNDS):
            messages = [self.message(h) for h in states]
            new = []
            for v, h in enumerate(states):
                incoming = nd.add_n(*[messages[u] for u in neighbours[v]])
                out, _ = self.update(incoming, [h])
                new.append(out)
            states = new
        return self.readout(nd.add_n(*states) / len(states))


class GraphSample(object):
    """Node types and adjacency lists (Python lists) and the class, as an int and
    as a (1,) NDArray."""
    __slots__ = ("types", "neighbours", "label", "target")

    def __init__(self, types, neighbours, label):
        self.types = types
        self.neighbours = neighbours
        self.label = label
        self.target = nd.array([label])


def generate(rng, n, types=16, min_nodes=5, max_nodes=20, extra_edges=0.3):
    """``n`` connected graphs: a random tree plus ``extra_edges`` * nodes more
    edges; the class counts the edges between nodes of equal type parity (mod
    CLASSES)."""
    out = []
    for _ in range(n):
        size = int(rng.integers(min_nodes, max_nodes + 1))
        kinds = [int(t) for t in rng.integers(0, types, size)]
        edges = {(int(rng.integers(0, v)), v) for v in range(1, size)}
        for _ in range(int(extra_edges * size)):
            a, b = sorted(int(x) for x in rng.choice(size, 2, replace=False))
            edges.add((a, b))
        nbrs = [[] for _ in range(size)]
        for a, b in sorted(edges):
            nbrs[a].append(b)
            nbrs[b].append(a)
        label = sum(1 for a, b in edges if kinds[a] % 2 == kinds[b] % 2) % CLASSES
        out.append(GraphSample(kinds, nbrs, label))
    return out


def build(seed=0, types=16, hidden=96):
    return seeded(GraphNet(types, hidden), seed)


def forward(net, sample):
    return net(sample.types, sample.neighbours)


def loss(net, sample, out):  # pylint: disable=unused-argument
    return cross_entropy(out, sample.target)


class HandBatched(object):
    """All graphs' nodes as rows of one matrix (module docstring)."""

    def __init__(self, net):
        self.net = net

    @staticmethod
    def plan(samples):
        """Node types of all graphs, each node's neighbours' rows padded to the
        largest degree with row N (a zero row), each graph's node rows padded
        to the largest graph with row N, and each graph's node count."""
        starts = np.cumsum([0] + [len(s.types) for s in samples])
        total = int(starts[-1])
        degree = max(len(nb) for s in samples for nb in s.neighbours)
        nbr = np.full((total, degree), total, dtype=np.int64)
        largest = max(len(s.types) for s in samples)
        members = np.full((len(samples), largest), total, dtype=np.int64)
        for g, s in enumerate(samples):
            for v, nb in enumerate(s.neighbours):
                nbr[starts[g] + v, :len(nb)] = [starts[g] + u for u in nb]
            members[g, :len(s.types)] = np.arange(starts[g], starts[g + 1])
        types = [t for s in samples for t in s.types]
        return types, nbr, members, [len(s.types) for s in samples]

    def forward(self, samples):
        net = self.net
        types, nbr, members, sizes = self.plan(samples)
        states = net.embed(nd.array(types))                  # (N, H)
        ctx = states.context
        zero = nd.zeros((1, states.shape[1]), ctx=ctx)
        nbr = index_array(nbr, ctx)
        for _ in range(ROUNDS):
            messages = nd.concat(net.message(states), zero, dim=0)
            states, _ = net.update(gather_sum(messages, nbr), [states])
        pooled = gather_sum(nd.concat(states, zero, dim=0), index_array(members, ctx))
        return net.readout(pooled / nd.array(sizes, ctx=ctx).reshape((-1, 1)))

    def loss(self, samples, outs):
        return cross_entropy(outs, labels_of(samples, outs.context))
