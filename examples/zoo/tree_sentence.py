"""Binary Tree-LSTM, sentence-level style: the per-sample forward makes ONE
``nd.array`` of the sentence's word ids, embeds it once, and gives each leaf
its row ``emb[i:i + 1]``. Per tree of L words: one array creation, one
embedding lookup, L leaf-cell and L - 1 composition calls, one output call.

The same blocks and math as :mod:`examples.zoo.tree_leaf`; cells, data and the
hand-batched reference: :mod:`examples.zoo.binary_tree`."""
from mxnet import nd

from . import binary_tree
from .binary_tree import BinaryTreeLSTM, HandBatched, generate, loss

__all__ = ["TreeSentenceNet", "build", "generate", "forward", "loss", "HandBatched"]


class TreeSentenceNet(BinaryTreeLSTM):
    def forward(self, tree):  # pylint: disable=arguments-differ
        emb = self.embed(nd.array(tree.words))          # (L, E)
        h, _ = self.encode(tree, emb)
        return self.out(h)

    def encode(self, node, emb):
        if node.is_leaf:
            return self.leaf(emb[node.pos:node.pos + 1])
        hl, cl = self.encode(node.left, emb)
        hr, cr = self.encode(node.right, emb)
        return self.compose(hl, cl, hr, cr)


def build(seed=0, **sizes):
    return binary_tree.build(TreeSentenceNet, seed, **sizes)


def forward(net, sample):
    return net(sample.tree)
