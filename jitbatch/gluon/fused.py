"""Fused RNN layers (``gluon.rnn.GRU``, ``LSTM``, ``RNN``) called without states.

Gluon hands such a layer begin states of shape ``(layers, 1, H)``: their batch
axis is 1 whatever the layout, so the call cannot merge along axis 0 as it
comes. The states are zeros the layer can make itself, so the call is recorded
as a call of a wrapper whose graph makes them for the merged batch (what
wrapping the layer in a HybridBlock by hand does):

- layout NTC (``Stateless``): the input's batch axis is 0 already;
- layout TNC (``TimeMajor``): a sample ``(T, B, C)`` sits in the merged input
  as rows ``i*T:(i+1)*T`` of ``(N*T, B, C)``; the wrapper's graph turns that
  into the layer's ``(T, N*B, C)`` and its output back, so it is made per
  ``(T, B)`` (the samples of one length merge, as in NTC)."""
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


class TimeMajor(Stateless):
    """``layer(x)`` for a layer in layout TNC, its input the flat rows of
    samples of ``steps`` time steps and ``batch`` rows each."""

    def __init__(self, layer, steps, batch):
        super(TimeMajor, self).__init__(layer)
        self.steps, self.batch = steps, batch

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        # named apart from the layer's own operators (the same prefix): the
        # batch-axis contract reads the graph's shapes by operator name
        name = "time_major_"
        x = F.reshape(x, shape=(-4, -1, self.steps, -2), name=name + "split")   # (N, T, B, C)
        x = F.transpose(x, axes=(1, 0, 2, 3), name=name + "swap")               # (T, N, B, C)
        y = self.layer(F.reshape(x, shape=(0, -3, -2), name=name + "in"))       # (T, N*B, H)
        y = F.reshape(y, shape=(0, -4, -1, self.batch, -2), name=name + "out")  # (T, N, B, H)
        y = F.transpose(y, axes=(1, 0, 2, 3), name=name + "back")               # (N, T, B, H)
        return F.reshape(y, shape=(-3, -2), name=name + "join")                 # (N*T, B, H)


class _Made(object):
    """A layer's wrappers (by the shape they are made for, None in NTC) and the
    settings they were made under (not a dict attribute: Gluon warns of
    containers of blocks among a block's attributes)."""
    __slots__ = ("key", "wrappers")

    def __init__(self, key):
        self.key = key
        self.wrappers = {}


def stateless(layer, args):
    """The wrapper to record for the call ``layer(*args)`` of a flagged block,
    or None where the call is not a fused layer given Gluon's begin states
    (``skip_states``: the user passed none) on a sample of a layout above."""
    if not isinstance(layer, _RNNLayer) or not getattr(layer, "skip_states", False) or \
            len(args) != 2 or layer._use_sequence_length:  # pylint: disable=protected-access
        return None
    axis = layer._layout.find("N")        # pylint: disable=protected-access
    if axis == 0:
        shape = None
    else:
        shape = tuple(args[0].shape)
        if axis != 1 or len(shape) != 3:
            return None
        shape = shape[:2]
    made = layer.__dict__.get("_jb_stateless")
    key = (layer._jb_token, layer._jb_cfg)
    if made is None or made.key != key:
        # in the layer's __dict__: as an attribute it would become its child
        made = layer.__dict__["_jb_stateless"] = _Made(key)
    w = made.wrappers.get(shape)
    if w is None:
        w = Stateless(layer) if shape is None else TimeMajor(layer, *shape)
        w._active = True                      # pylint: disable=protected-access
        w._flags = list(layer._flags)         # pylint: disable=protected-access
        w._jb_cfg = layer._jb_cfg
        renew_token(w)
        made.wrappers[shape] = w
    return w
