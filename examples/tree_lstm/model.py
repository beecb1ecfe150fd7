"""Child-sum Tree-LSTM for semantic relatedness (Tai, Socher & Manning, 2015),
written per sample: a recursion over the tree calling a hybridizable cell.

The same code runs plain, per-sample hybridized, or dynamically batched
(``net.hybridize(dynamic_batch=True)``); no batching logic lives here."""
import mxnet as mx
from mxnet import gluon, nd
from mxnet.gluon import HybridBlock, nn


class ChildSumLSTMCell(HybridBlock):
    """One tree node with children. ``x``: (B, D) inputs; ``ch``, ``cc``: (B, K, H)
    children's hidden and cell states (leaves: :class:`ChildSumLSTMLeaf`)."""

    def __init__(self, hidden_size, input_size=0, **kwargs):
        super(ChildSumLSTMCell, self).__init__(**kwargs)
        h = self._hidden = hidden_size
        with self.name_scope():
            self.W_iou = self.params.get("W_iou", shape=(3 * h, input_size), allow_deferred_init=True)
            self.b_iou = self.params.get("b_iou", shape=(3 * h,), init="zeros")
            self.U_iou = self.params.get("U_iou", shape=(3 * h, h))
            self.W_f = self.params.get("W_f", shape=(h, input_size), allow_deferred_init=True)
            self.b_f = self.params.get("b_f", shape=(h,), init="zeros")
            self.U_f = self.params.get("U_f", shape=(h, h))

    def hybrid_forward(self, F, x, ch, cc, W_iou, b_iou, U_iou, W_f, b_f, U_f):  # pylint: disable=arguments-differ
        h = self._hidden
        # sums over the child axis as (B, 1, K) x (B, K, H) products: MXNet's CPU
        # sum(axis=1) is ~10x slower than batch_dot for these shapes
        ones = F.slice_axis(F.ones_like(ch), axis=2, begin=0, end=1)       # (B, K, 1)
        hsum = F.reshape(F.batch_dot(ones, ch, transpose_a=True), shape=(0, -1))  # (B, H)
        iou = F.FullyConnected(x, W_iou, b_iou, num_hidden=3 * h) + \
            F.FullyConnected(hsum, U_iou, no_bias=True, num_hidden=3 * h)  # (B, 3H)
        i, o, u = F.split(F.reshape(iou, shape=(0, 3, -1)), num_outputs=3, axis=1,
                          squeeze_axis=True)
        i, o, u = F.sigmoid(i), F.sigmoid(o), F.tanh(u)
        fx = F.FullyConnected(x, W_f, b_f, num_hidden=h)                  # (B, H)
        fh = F.FullyConnected(ch, U_f, no_bias=True, num_hidden=h, flatten=False)  # (B, K, H)
        # fx copied to every child, also as a product: broadcast_add's backward is
        # the same slow reduction
        f = F.sigmoid(fh + F.batch_dot(ones, F.expand_dims(fx, axis=1)))

        fc = F.reshape(F.batch_dot(ones, f * cc, transpose_a=True), shape=(0, -1))
        c = i * u + fc
        return o * F.tanh(c), c


class ChildSumLSTMLeaf(HybridBlock):
    """A leaf of the same Tree-LSTM: the cell with no children, on the cell's own
    parameters (Gluon's sharing: the cell's prefix and parameter dict). With no
    children the child sum, the forget gates and the ``U`` products are zero,
    so a leaf computes only ``W_iou x + b_iou`` and the gates: about half a
    cell's arithmetic. Outputs equal ``cell(x, zero, zero)`` up to rounding."""

    def __init__(self, cell, **kwargs):
        super(ChildSumLSTMLeaf, self).__init__(prefix=cell.prefix, params=cell.params, **kwargs)
        h = self._hidden = cell._hidden  # pylint: disable=protected-access
        with self.name_scope():
            self.W_iou = self.params.get("W_iou", shape=cell.W_iou.shape,
                                         allow_deferred_init=True)
            self.b_iou = self.params.get("b_iou", shape=(3 * h,), init="zeros")

    def hybrid_forward(self, F, x, W_iou, b_iou):  # pylint: disable=arguments-differ
        iou = F.FullyConnected(x, W_iou, b_iou, num_hidden=3 * self._hidden)
        i, o, u = F.split(F.reshape(iou, shape=(0, 3, -1)), num_outputs=3, axis=1,
                          squeeze_axis=True)
        c = F.sigmoid(i) * F.tanh(u)
        return F.sigmoid(o) * F.tanh(c), c


class Similarity(HybridBlock):
    """Distance features of two sentence vectors -> log class probabilities."""

    def __init__(self, sim_hidden, num_classes, in_units, **kwargs):
        super(Similarity, self).__init__(**kwargs)
        with self.name_scope():
            self.wh = nn.Dense(sim_hidden, in_units=2 * in_units, activation="sigmoid")
            self.wp = nn.Dense(num_classes, in_units=sim_hidden)

    def hybrid_forward(self, F, lh, rh):  # pylint: disable=arguments-differ
        feats = F.concat(lh * rh, F.abs(lh - rh), dim=1)
        return F.log_softmax(self.wp(self.wh(feats)), axis=-1)


class TreeEncoder(gluon.Block):
    """Embeds a sentence and runs the cell over its dependency tree, per sample."""

    def __init__(self, vocab_size, embed_size, hidden_size, sparse_grad=False, **kwargs):
        super(TreeEncoder, self).__init__(**kwargs)
        self.hidden_size = hidden_size
        with self.name_scope():
            self.embed = nn.Embedding(vocab_size, embed_size, sparse_grad=sparse_grad)
            self.cell = ChildSumLSTMCell(hidden_size, input_size=embed_size)
            self.leaf = ChildSumLSTMLeaf(self.cell)

    def forward(self, tokens, tree):  # pylint: disable=arguments-differ
        emb = self.embed(tokens)                       # (L, E)
        states = {}
        for node in tree.postorder():
            x = emb[node.idx:node.idx + 1]             # (1, E)
            if node.children:
                kids = [states.pop(id(k)) for k in node.children]
                ch = nd.stack(*[s[0] for s in kids], axis=1)   # (1, K, H)
                cc = nd.stack(*[s[1] for s in kids], axis=1)
                states[id(node)] = self.cell(x, ch, cc)
            else:
                states[id(node)] = self.leaf(x)
        return states[id(tree)][0]


#: how the word embedding is trained: 'frozen' (Tai et al.'s choice for
#: relatedness: the vectors are kept fixed), 'sparse' (only the rows a minibatch
#: used are updated: a row-sparse gradient, which MXNet's optimizers update
#: lazily; weight decay is off for that parameter, as row-sparse updates need)
#: or 'dense' (every row every step: a dense gradient and a full update)
EMBED_UPDATES = ("frozen", "sparse", "dense")


class SimilarityTreeLSTM(gluon.Block):
    """The whole relatedness model: two sentences -> (1, num_classes) log-probs.
    ``embed_update``: one of :data:`EMBED_UPDATES`."""

    def __init__(self, vocab_size, embed_size=300, hidden_size=150, sim_hidden=50,
                 num_classes=5, embed_update="dense", **kwargs):
        super(SimilarityTreeLSTM, self).__init__(**kwargs)
        if embed_update not in EMBED_UPDATES:
            raise ValueError("embed_update=%r: expected one of %s"
                             % (embed_update, ", ".join(EMBED_UPDATES)))
        self.embed_update = embed_update
        with self.name_scope():
            self.encoder = TreeEncoder(vocab_size, embed_size, hidden_size,
                                       sparse_grad=embed_update == "sparse")
            self.similarity = Similarity(sim_hidden, num_classes, hidden_size)
        weight = self.encoder.embed.weight
        if embed_update == "frozen":
            weight.grad_req = "null"
        elif embed_update == "sparse":
            weight.wd_mult = 0.0

    def forward(self, a_tokens, a_tree, b_tokens, b_tree):  # pylint: disable=arguments-differ
        return self.similarity(self.encoder(a_tokens, a_tree), self.encoder(b_tokens, b_tree))


def expected_score(log_probs, num_classes=5):
    """Expected relatedness in [1, K] from (B, K) log-probabilities (lazy-friendly)."""
    ks = nd.arange(1, num_classes + 1, ctx=log_probs.context).reshape((1, num_classes))
    return nd.sum(nd.exp(log_probs) * ks, axis=1)


def kl_loss():
    """KL divergence against the sparse target distribution (Tai et al.)."""
    return gluon.loss.KLDivLoss(from_logits=True)


__all__ = ["EMBED_UPDATES", "ChildSumLSTMCell", "ChildSumLSTMLeaf", "Similarity", "TreeEncoder", "SimilarityTreeLSTM",
           "expected_score", "kl_loss", "mx"]
