"""The model zoo: per-sample models written as users write them, each with a
synthetic data generator, a per-sample loss and (where one can be written) a
hand-batched reference of the same math on the same parameters.

``MODELS`` maps a name to its :class:`~examples.zoo.common.Entry`;
``scripts/bench_zoo.py`` times them, ``tests/test_zoo.py`` checks them.
See ``examples/zoo/README.rst``."""
from . import (attention, fused_gru, graph_net, greedy_decode, gru_seq, module_net, moe, tree_leaf,
               tree_sentence)
from .common import Entry

__all__ = ["MODELS", "Entry"]

_TINY = dict(vocab=20, embed=6, hidden=5)

MODELS = {e.name: e for e in [
    Entry("tree_leaf", tree_leaf,
          "binary Tree-LSTM, one nd.array([word_id]) per leaf (SST-style trees, 2-24 words)",
          train_size=25, tiny=_TINY, tiny_data=dict(vocab=20, max_len=7)),
    Entry("tree_sentence", tree_sentence,
          "binary Tree-LSTM, one nd.array of ids per tree, leaves as rows emb[i:i+1]",
          train_size=25, tiny=_TINY, tiny_data=dict(vocab=20, max_len=7)),
    Entry("gru_seq", gru_seq, "GRUCell looped over 3-40 tokens, classified from the last state",
          tiny=_TINY, tiny_data=dict(vocab=20, max_len=7)),
    Entry("attention", attention,
          "GRU encoder (3-20 tokens), 5-step GRU decoder with dot-product attention",
          tiny=_TINY, tiny_data=dict(vocab=20, max_len=6)),
    Entry("attention_masked", attention,
          "the same, its attention block taking the key count, keys declared zero-paddable "
          "(README: per-sample code that batches well)",
          options=dict(masked=True), tiny=_TINY, tiny_data=dict(vocab=20, max_len=6)),
    # a read per sample per decoding step: a plain loop flushes at each, so a flush
    # holds one sample's step (and the previous sample's loss), nothing to merge with
    Entry("greedy_decode", greedy_decode,
          "GRU encoder (3-15 tokens), greedy GRU decoder reading its argmax per step "
          "(up to 8 steps)",
          tiny=_TINY, tiny_data=dict(vocab=20, max_len=6), merges=False, steered=True),
    Entry("graph_net", graph_net,
          "message passing over a random graph (5-20 nodes, 3 rounds), mean read-out",
          tiny=dict(types=8, hidden=5), tiny_data=dict(types=8, max_nodes=7)),
    # the read per sample flushes what is pending: a flush holds one sample's
    # gate and the previous sample's expert and loss, so little or nothing merges
    Entry("moe", moe, "8 experts, top-1 by the gate's argmax read with asscalar() per sample",
          tiny=_TINY, tiny_data=dict(vocab=20, max_len=6), merges=False),
    Entry("moe_domain", moe, "8 experts, top-1 by the sample's domain id (no read)",
          options=dict(routing="domain"), tiny=_TINY, tiny_data=dict(vocab=20, max_len=6)),
    Entry("module_net", module_net,
          "module network: find/relate/and/describe programs over 16 image regions",
          tiny=dict(vocab=20, embed=6, features=6, hidden=5),
          tiny_data=dict(vocab=20, features=6, max_depth=3)),
    Entry("fused_gru", fused_gru, "the GRU classifier with the fused gluon.rnn.GRU layer (TNC)",
          tiny=_TINY, tiny_data=dict(vocab=20, max_len=7)),
    Entry("fused_gru_ntc", fused_gru, "the same fused layer in layout NTC, called without states",
          options=dict(layout="NTC"), tiny=_TINY, tiny_data=dict(vocab=20, max_len=7)),
]}
