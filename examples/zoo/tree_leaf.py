"""Binary Tree-LSTM, per-leaf style: the per-sample forward recurses over the
tree and makes each leaf's input with its own ``nd.array([word_id])``, as
code that reads a tree of Python word ids naturally does. Per tree of L words:
L small array creations from Python data, L embedding lookups, L leaf-cell
and L - 1 composition calls, one output call.

Cells, data and the hand-batched reference: :mod:`examples.zoo.binary_tree`."""
from mxnet import nd

from . import binary_tree
from .binary_tree import BinaryTreeLSTM, HandBatched, generate, loss

__all__ = ["TreeLeafNet", "build", "generate", "forward", "loss", "HandBatched"]


class TreeLeafNet(BinaryTreeLSTM):
    def forward(self, tree):  # pylint: disable=arguments-differ
        h, _ = self.encode(tree)
        return self.out(h)

    def encode(self, node):
        if node.is_leaf:
            return self.leaf(self.embed(nd.array([node.word])))
        hl, cl = self.encode(node.left)
        hr, cr = self.encode(node.right)
        return self.compose(hl, cl, hr, cr)


def build(seed=0, **sizes):
    return binary_tree.build(TreeLeafNet, seed, **sizes)


def forward(net, sample):
    return net(sample.tree)
