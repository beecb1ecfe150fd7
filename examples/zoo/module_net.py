"""Neural module network: per sample, a program of modules over an image's regions.

A sample is an "image" (REGIONS region vectors, ``(1, REGIONS, D)``, from the
data pipeline), a program (a tree of modules, each with a word except ``and``)
and an answer class. Modules (HybridBlocks) map attention maps over the regions
``(1, REGIONS)``:

* ``find[w]``: attention from the regions' match with the word;
* ``relate[w](a)``: a new attention from ``a`` and the word;
* ``and(a, b)``: the elementwise minimum;
* ``describe[w](a)`` (the root): the regions averaged under ``a``, with the
  word, to CLASSES logits.

Per sample: one ``nd.array`` of the program's words, one embedding lookup (a
module's word is a row of it), then a recursion over the program calling one
module per node.

Hand-batched reference: the modules of all programs grouped by (height in its
program, module type): one call per group, attention maps kept as rows of one
growing buffer and gathered with ``take``; one embedding lookup for all
words, the images stacked once and gathered per call."""
import numpy as np
from mxnet import gluon, nd
from mxnet.gluon import HybridBlock, nn

from .common import cross_entropy, index_array, labels_of, seeded

__all__ = ["Find", "Relate", "And", "Describe", "ModuleNet", "Program", "ProgramSample",
           "build", "generate", "forward", "loss", "HandBatched", "REGIONS", "CLASSES"]

REGIONS = 16
CLASSES = 6


class Find(HybridBlock):
    def __init__(self, embed, features, hidden, **kwargs):
        super(Find, self).__init__(**kwargs)
        with self.name_scope():
            self.query = nn.Dense(hidden, in_units=embed)
            self.keys = nn.Dense(hidden, in_units=features, flatten=False)

    def hybrid_forward(self, F, word, image):  # pylint: disable=arguments-differ
        scores = F.batch_dot(self.keys(image), F.expand_dims(self.query(word), axis=2))
        return F.sigmoid(F.reshape(scores, shape=(0, -1)))              # (B, REGIONS)


class Relate(HybridBlock):
    def __init__(self, embed, **kwargs):
        super(Relate, self).__init__(**kwargs)
        with self.name_scope():
            self.shift = nn.Dense(REGIONS, in_units=REGIONS + embed)

    def hybrid_forward(self, F, att, word):  # pylint: disable=arguments-differ
        return F.sigmoid(self.shift(F.concat(att, word, dim=1)))


class And(HybridBlock):
    def hybrid_forward(self, F, a, b):  # pylint: disable=arguments-differ
        return F.minimum(a, b)


class Describe(HybridBlock):
    def __init__(self, embed, features, hidden, **kwargs):
        super(Describe, self).__init__(**kwargs)
        with self.name_scope():
            self.mlp = nn.HybridSequential()
            self.mlp.add(nn.Dense(hidden, in_units=features + embed, activation="relu"),
                         nn.Dense(CLASSES, in_units=hidden))

    def hybrid_forward(self, F, att, image, word):  # pylint: disable=arguments-differ
        seen = F.reshape(F.batch_dot(F.expand_dims(att, axis=1), image), shape=(0, -1))
        return self.mlp(F.concat(seen, word, dim=1))


class ModuleNet(gluon.Block):
    def __init__(self, vocab, embed, features, hidden, **kwargs):
        super(ModuleNet, self).__init__(**kwargs)
        with self.name_scope():
            self.embed = nn.Embedding(vocab, embed)
            self.find = Find(embed, features, hidden)
            self.relate = Relate(embed)
            self.both = And()
            self.describe = Describe(embed, features, hidden)

    def forward(self, root, word_ids, image):  # pylint: disable=arguments-differ
        words = self.embed(nd.array(word_ids))                 # (modules with a word, E)
        return self.describe(self.attend(root.args[0], words, image), image,
                             words[root.word:root.word + 1])

    def attend(self, node, words, image):
        if node.kind == "and":
            return self.both(self.attend(node.args[0], words, image),
                             self.attend(node.args[1], words, image))
        word = words[node.word:node.word + 1]
        if node.kind == "find":
            return self.find(word, image)
        return self.relate(self.attend(node.args[0], words, image), word)


class Program(object):
    """A module call: ``kind``, ``word`` (the row of its word in the program's
    ``words``; None for ``and``) and ``args`` (its argument programs)."""
    __slots__ = ("kind", "word", "args")

    def __init__(self, kind, word, args=()):
        self.kind, self.word, self.args = kind, word, list(args)


class ProgramSample(object):
    """A program (``root``, a describe node; ``words``, its word ids), the image
    as a (1, REGIONS, D) NDArray, the answer as an int and a (1,) NDArray."""
    __slots__ = ("root", "words", "image", "label", "target")

    def __init__(self, root, words, image, label):
        self.root, self.words, self.image = root, words, nd.array(image)
        self.label = label
        self.target = nd.array([label])


def _random_attend(rng, words, vocab, depth):
    """A random attention program of at most ``depth`` levels; appends the word
    ids it uses to ``words``."""
    kind = "find" if depth == 1 else ["find", "relate", "and"][int(rng.choice(3, p=[.3, .35, .35]))]
    if kind == "and":
        return Program(kind, None, [_random_attend(rng, words, vocab, depth - 1),
                                    _random_attend(rng, words, vocab, depth - 1)])
    words.append(int(rng.integers(0, vocab)))
    node = Program(kind, len(words) - 1)
    if kind == "relate":
        node.args = [_random_attend(rng, words, vocab, depth - 1)]
    return node


def generate(rng, n, vocab=100, features=64, max_depth=4):
    """``n`` samples: random images, random programs of up to ``max_depth``
    attention levels under the describe; the answer is the sum of the program's
    word ids mod CLASSES."""
    out = []
    for _ in range(n):
        words = [int(rng.integers(0, vocab))]                  # describe's word
        root = Program("describe", 0, [_random_attend(rng, words, vocab, max_depth)])
        image = rng.normal(size=(1, REGIONS, features)).astype(np.float32)
        out.append(ProgramSample(root, words, image, sum(words) % CLASSES))
    return out


def build(seed=0, vocab=100, embed=64, features=64, hidden=96):
    return seeded(ModuleNet(vocab, embed, features, hidden), seed)


def forward(net, sample):
    return net(sample.root, sample.words, sample.image)


def loss(net, sample, out):  # pylint: disable=unused-argument
    return cross_entropy(out, sample.target)


class HandBatched(object):
    """Modules grouped by (height, type) across the minibatch (module docstring)."""

    def __init__(self, net):
        self.net = net

    @staticmethod
    def plan(samples):
        """Per height, per module type, the calls ``(sample, node)``; every node's
        height; the word offset of each sample in the joined word list."""
        height, groups, word_at = {}, {}, []
        offset = 0
        for b, s in enumerate(samples):
            word_at.append(offset)
            offset += len(s.words)
            stack = [(s.root.args[0], False)]
            while stack:                                       # postorder
                node, done = stack.pop()
                if not done:
                    stack.append((node, True))
                    stack.extend((a, False) for a in node.args)
                    continue
                height[id(node)] = 1 + max([height[id(a)] for a in node.args] or [-1])
                groups.setdefault((height[id(node)], node.kind), []).append((b, node))
        return sorted(groups.items()), word_at

    def forward(self, samples):
        net = self.net
        groups, word_at = self.plan(samples)
        # every index list first, so that they go to the device in one copy
        flat, calls_index, row, size = [], [], {}, 0

        def add(rows):
            flat.extend(rows)
            return (len(flat) - len(rows), len(flat))
        for (_, kind), calls in groups:
            if kind == "and":
                parts = [add([row[id(n.args[0])] for _, n in calls]),
                         add([row[id(n.args[1])] for _, n in calls])]
            else:
                parts = [add([word_at[b] + n.word for b, n in calls])]
                parts.append(add([b for b, _ in calls]) if kind == "find" else
                             add([row[id(n.args[0])] for _, n in calls]))
            calls_index.append((kind, parts))
            for j, (_, node) in enumerate(calls):
                row[id(node)] = size + j
            size += len(calls)
        top = add([row[id(s.root.args[0])] for s in samples])
        own_words = add(word_at)

        words = net.embed(nd.array([w for s in samples for w in s.words]))
        index = index_array(flat, words.context)
        images = nd.concat(*[s.image for s in samples], dim=0)   # (B, REGIONS, D)
        buf = None                                               # attention maps, as rows

        def take(table, span):
            return nd.take(table, index[span[0]:span[1]])
        for kind, parts in calls_index:
            if kind == "and":
                att = net.both(take(buf, parts[0]), take(buf, parts[1]))
            elif kind == "find":
                att = net.find(take(words, parts[0]), take(images, parts[1]))
            else:
                att = net.relate(take(buf, parts[1]), take(words, parts[0]))
            buf = att if buf is None else nd.concat(buf, att, dim=0)
        return net.describe(take(buf, top), images, take(words, own_words))

    def loss(self, samples, outs):
        return cross_entropy(outs, labels_of(samples, outs.context))
