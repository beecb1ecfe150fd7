"""Fused RNN layers (``gluon.rnn.GRU``, ``LSTM``, ``RNN``) called without states.

Gluon hands such a layer begin states of shape ``(layers, 1, H)``: their batch
axis is 1 whatever the layout, so the call cannot merge along axis 0 as it
comes. In layout NTC the input's batch axis is 0, and the states are zeros the
layer can make itself: the call is recorded as a call of a ``Stateless``
wrapper whose graph makes them for the merged batch (what wrapping the layer
in a HybridBlock by hand does)."""
from mxnet.gluon.block import HybridBlock
from mxnet.gluon.rnn.rnn_layer import _RNNLayer

from .flags import renew_token


class Stateless(HybridBlock):
    """``layer(x)`` with the begin states made inside the graph; named as the
    layer, holding no parameters of its own."""

    def __init__(self, layer):
        super(Stateless, self).__init__(prefix=layer.prefix, params=layer.params)
        self.layer = layer

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        return self.layer(x)


class _Made(object):
    """A layer's wrapper and what it was made for (not a tuple: Gluon warns of
    containers of blocks among a block's attributes)."""
    __slots__ = ("key", "wrapper")

    def __init__(self, key, wrapper):
        self.key = key
        self.wrapper = wrapper


def stateless(layer, args):
    """The ``Stateless`` wrapper to record for the call ``layer(*args)`` of a
    flagged block, or None where the call is not a fused layer in layout NTC
    given Gluon's begin states (``skip_states``: the user passed none)."""
    if not isinstance(layer, _RNNLayer) or not getattr(layer, "skip_states", False) or \
            len(args) != 2 or layer._layout.find("N") != 0 or layer._use_sequence_length:  # pylint: disable=protected-access
        return None
    made = layer.__dict__.get("_jb_stateless")
    key = (layer._jb_token, layer._jb_cfg)
    if made is None or made.key != key:
        w = Stateless(layer)
        w._active = True                      # pylint: disable=protected-access
        w._flags = list(layer._flags)         # pylint: disable=protected-access
        w._jb_cfg = layer._jb_cfg
        renew_token(w)
        # in the layer's __dict__: as an attribute it would become its child
        made = layer.__dict__["_jb_stateless"] = _Made(key, w)
    return made.wrapper
