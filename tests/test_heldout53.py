"""Held-out: the batching rules and canonicalizations of 2026-11-27 attacked with
naive per-sample models written the way users write them.

* basic indexing of lazy ``(T, E)`` sequences (``h[:, 1:]``, ``h[:, 0]``,
  ``e[:, 0, ::2]``, ``h[:, -1:]``, negative steps, gate splits
  ``h[:, :H]`` / ``h[:, H:2*H]``) merging across lengths
  (``lazy._tuple_index``);
* a lazy array's ``reshape`` keeping the rows (``(-1, heads, d)``,
  ``(0, 2, -1)``, ``(T, heads, d)``, ``reshape(0, -1)``) recorded as a
  target ``(0, ...)`` that runs as one launch across lengths
  (``opkeys.rows_copied``, ``opkeys._copies_rows``);
* the new operator rules (``rules.py``): ``tile``, ``LeakyReLU`` (leaky, elu,
  selu, gelu; prelu per call), ``broadcast_to``, ``broadcast_like``,
  ``swapaxes``, ``linalg_gemm2``, ``L2Normalization``, ``repeat``,
  ``broadcast_axis``, ``moments``.

Differential oracle: plain per-sample Gluon vs jitbatch (same parameters, same
inputs), outputs AND gradients, every policy, training and inference; a few
exact launch counts where merging is the point.

Found (``test_broadcast_like_right_hand_side_in_backward``, each case run in
a subprocess since it killed the process), fixed the same day: in training,
MXNet 1.9.1 gives ``broadcast_like``'s (and ``reshape_like``'s) right-hand
side a ``zeros_like`` gradient and segfaulted in ``backward()`` when that
input was rows gathered or sliced from a launch. (1) A regression of the new
rule: ``nd.broadcast_like(row, pooled) + pooled`` with samples of 1 and 2
rows (depth), or ``nd.broadcast_like(q, p) + p`` under chunked flushes
(agenda, ``max_pending=10``). (2) Older: a right-hand side reaching the loss
only as the shape source, in depth/agenda/auto. Plain Gluon runs all of
them; recorded operator launches now detach the inputs the operator passes
no gradient to (``executors.OpExec._detached``)."""
import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd

from harness import assert_same, run
from heldout import (initialized, launches_by_name, nothing_pending,  # noqa: F401
                     run_in_subprocess)

POLICIES = ["depth", "agenda", "sequential", "auto"]
POLICY = pytest.mark.parametrize("policy", POLICIES)
TRAIN = pytest.mark.parametrize("train", [False, True])
HEADS, D = 2, 3
E = HEADS * D
#: lengths with single-row samples mixed in (a one-row call keeps its exact
#: signature), lengths of two (``rows_copied``'s boundary) and repeats
LENGTHS = (3, 1, 5, 2, 4, 3, 1, 2)


def sequences(lengths=LENGTHS, seed=0, width=3, dtype="float32"):
    rng = np.random.default_rng(seed)
    return [nd.array(rng.normal(size=(t, width)), dtype=dtype) for t in lengths]


def square(net, x):
    y = net(x)
    return y, nd.sum(y * y)


def compare(make, train, policy, lengths=LENGTHS, mapped=False, dtype="float32",
            rtol=1e-4, atol=1e-5):
    def fresh():
        net = initialized(make())
        if dtype != "float32":
            net.cast(dtype)
        return net
    xs = sequences(lengths, dtype=dtype)
    ref = run(fresh(), square, xs, train, flag=False)
    got = run(fresh(), square, xs, train, flag=True, policy=policy, mapped=mapped)
    assert_same(ref, got, rtol=rtol, atol=atol)


# -- models ------------------------------------------------------------------------------
class SelfAttention(gluon.Block):
    """A transformer layer written per sample: heads by reshape + swapaxes,
    scores by linalg_gemm2 (alpha), softmax, batch_dot, heads merged back by
    reshape(0, -1), a GELU MLP, LayerNorm by nd.moments, an L2-normalized
    pooled query broadcast_to the sample's keys (cosine scores) and a bilinear
    score through a parameter (linalg_gemm2)."""

    def __init__(self, **kw):
        super().__init__(prefix="sa_", **kw)
        with self.name_scope():
            self.emb = gluon.nn.Dense(E, in_units=3, flatten=False)
            self.qkv = gluon.nn.Dense(3 * E, in_units=E, flatten=False)
            self.proj = gluon.nn.Dense(E, in_units=E, flatten=False)
            self.ff = gluon.nn.Dense(E, in_units=E, flatten=False)
            self.bil = self.params.get("bil", shape=(E, E))
            self.out = gluon.nn.Dense(2, in_units=E + 1)

    def forward(self, x):  # pylint: disable=arguments-differ
        T = x.shape[0]
        h = self.emb(x)                                                  # (T, E)
        qkv = self.qkv(h)                                                # (T, 3E)
        q, k, v = qkv[:, :E], qkv[:, E:2 * E], qkv[:, 2 * E:]            # gate-style splits
        q = nd.swapaxes(q.reshape((-1, HEADS, D)), 0, 1)                 # (H, T, D)
        k = nd.swapaxes(k.reshape((0, HEADS, -1)), 0, 1)
        v = nd.swapaxes(v.reshape((T, HEADS, D)), 0, 1)
        s = nd.linalg_gemm2(q, k, transpose_b=True, alpha=D ** -0.5)     # (H, T, T)
        a = nd.batch_dot(nd.softmax(s, axis=-1), v)                      # (H, T, D)
        a = nd.swapaxes(a, 0, 1).reshape(0, -1)                          # (T, E)
        h = h + self.proj(a)
        mean, var = nd.moments(h, axes=(-1,), keepdims=True)             # (T, 1) each
        h = (h - mean) / nd.sqrt(var + 1e-5)
        h = h + self.ff(nd.LeakyReLU(h, act_type="gelu"))
        n = nd.L2Normalization(h)                                        # rows unit length
        qv = nd.L2Normalization(nd.mean(h, axis=0, keepdims=True))       # (1, E)
        cos = nd.sum(n * nd.broadcast_to(qv, shape=(T, E)), axis=1, keepdims=True)
        bil = nd.linalg_gemm2(nd.linalg_gemm2(qv, self.bil.data()), n, transpose_b=True)
        pooled = nd.sum(n * nd.softmax(cos, axis=0), axis=0, keepdims=True)
        return self.out(nd.concat(pooled, nd.max(bil, axis=1, keepdims=True), dim=1))


class Gates(gluon.Block):
    """An LSTM-like gate split done by basic indexing of columns, last/first
    columns, strided and reversed columns, then ELU/SELU/leaky activations."""

    def __init__(self, **kw):
        super().__init__(prefix="gates_", **kw)
        with self.name_scope():
            self.inp = gluon.nn.Dense(4 * D, in_units=3, flatten=False)
            self.out = gluon.nn.Dense(2, in_units=D + 2)

    def forward(self, x):  # pylint: disable=arguments-differ
        g = self.inp(x)                                                  # (T, 4D)
        i, f = nd.sigmoid(g[:, :D]), nd.sigmoid(g[:, D:2 * D])
        c = nd.LeakyReLU(g[:, 2 * D:3 * D], act_type="elu", slope=0.7)
        o = nd.LeakyReLU(g[:, 3 * D:], act_type="selu")
        h = o * nd.tanh(i * c + f * g[:, ::-1][:, :D])                   # (T, D)
        e = h.expand_dims(1)                                             # (T, 1, D)
        first = h[:, 0].reshape((-1, 1)) * h[:, -1:]                     # (T, 1)
        strided = e[:, 0, ::2]                                           # (T, 2)
        back = nd.LeakyReLU(h[:, 2:0:-1], slope=0.1) + strided[:, -2:]  # (T, 2)
        z = nd.concat(h * first, back, dim=1)                            # (T, D + 2)
        return self.out(nd.mean(z, axis=0, keepdims=True))


class Positional(gluon.Block):
    """Per-sample positional tiling and repetition: a parameter row tiled
    over the sample's rows, tile with fewer reps than axes, tile with reps
    longer than the rank (no rule), repeat with a negative axis,
    broadcast_axis (MXNet refuses a negative axis there), broadcast_like with and without (negative) lhs_axes/rhs_axes."""

    def __init__(self, **kw):
        super().__init__(prefix="pos_", **kw)
        with self.name_scope():
            self.emb = gluon.nn.Dense(4, in_units=3, flatten=False)
            self.row = self.params.get("row", shape=(1, 4))
            self.out = gluon.nn.Dense(2, in_units=8)

    def forward(self, x):  # pylint: disable=arguments-differ
        T = x.shape[0]
        h = nd.tanh(self.emb(x))                                         # (T, 4)
        p = h + nd.tile(self.row.data(), reps=(T, 1))                    # positional row
        e = p.expand_dims(1)                                             # (T, 1, 4)
        t2 = nd.tile(e, reps=(2, 1)).reshape((0, -1))                    # fewer reps: (T, 8)
        t3 = nd.tile(p, reps=(2, 1, 1))                                  # longer reps: (2, T, 4)
        r = nd.repeat(p, repeats=2, axis=-1)                             # (T, 8)
        col = nd.sum(p, axis=-1, keepdims=True)                          # (T, 1)
        b = nd.broadcast_axis(col, axis=1, size=8)                       # (T, 8)
        q = nd.mean(p, axis=0, keepdims=True)                            # (1, 4)
        bl = nd.broadcast_like(q, p) + nd.broadcast_like(q, p, lhs_axes=(-2,), rhs_axes=(-2,))
        z = t2 * r + b + nd.concat(bl, bl, dim=1) + nd.concat(t3[0], t3[1], dim=1)
        return self.out(nd.max(z, axis=0, keepdims=True))


class Normalized(gluon.Block):
    """L2Normalization in every mode, LayerNorm and a statistic over the rows
    by nd.moments (keepdims on and off, negative axes), the sample's query
    broadcast over its rows, cosine scores."""

    def __init__(self, **kw):
        super().__init__(prefix="norm_", **kw)
        with self.name_scope():
            self.emb = gluon.nn.Dense(E, in_units=3, flatten=False)
            self.query = gluon.nn.Dense(E, in_units=E)
            self.out = gluon.nn.Dense(2, in_units=E)

    def forward(self, x):  # pylint: disable=arguments-differ
        T = x.shape[0]
        h = self.emb(x)                                                  # (T, E)
        m, v = nd.moments(h, axes=(1,))                                  # (T,), (T,)
        h = (h - m.reshape((-1, 1))) / nd.sqrt(v.reshape((0, 1)) + 1e-5)
        c = h.reshape((0, 2, 3))                                         # (T, 2, 3)
        n = nd.L2Normalization(c, mode="channel") + nd.L2Normalization(c, mode="spatial") + \
            nd.L2Normalization(c, mode="instance", eps=1e-3)
        n = n.reshape((-1, E))                                           # (T, E)
        m0, v0 = nd.moments(n, axes=(-2,), keepdims=True)                # over the rows: (1, E)
        q = nd.L2Normalization(self.query(m0 + v0))                      # (1, E)
        keys = nd.L2Normalization(n)
        cos = nd.sum(keys * nd.broadcast_to(q, shape=(T, E)), axis=-1)   # (T,)
        w = nd.softmax(cos)                                              # over the rows
        return self.out(nd.sum(keys * w.expand_dims(1), axis=0, keepdims=True))


class Codes(gluon.Block):
    """Reshape targets with MXNet's special codes and written lengths, around
    the new row-keeping canonicalization: (0, -4, 2, -1), (0, -3), (-2,),
    (T, ...) written out, reverse=True, a target counting other rows
    ((-1, 3): per length), and basic indexing of the results (negative steps,
    axis 0 reversed)."""

    def __init__(self, **kw):
        super().__init__(prefix="codes_", **kw)
        with self.name_scope():
            self.emb = gluon.nn.Dense(E, in_units=3, flatten=False)
            self.out = gluon.nn.Dense(2, in_units=E)

    def forward(self, x):  # pylint: disable=arguments-differ
        T = x.shape[0]
        h = nd.tanh(self.emb(x))                                         # (T, 6)
        a = h.reshape((0, -4, 2, -1))                                    # (T, 2, 3)
        b = nd.reshape(a, shape=(0, -3)) + h.reshape((T, 6, 1, 1)).reshape((0, -2)).reshape(0, -1)
        c = h.reshape((-1, 3), reverse=True).reshape((T, -1))            # counts other rows
        d = nd.reshape(h, shape=(0, 3, -1))[:, ::-1, :].reshape((-1, E))
        f = h[::-1, :] * b + c * d + a.reshape((-1, 2, 3))[:, :, 0].tile((1, 3))
        return self.out(nd.mean(f, axis=0, keepdims=True))


MODELS = {"attention": SelfAttention, "gates": Gates, "positional": Positional,
          "normalized": Normalized, "codes": Codes}


@TRAIN
@POLICY
@pytest.mark.parametrize("model", sorted(MODELS))
def test_per_sample_models_equal_plain_gluon(model, policy, train):
    compare(MODELS[model], train, policy)


@pytest.mark.parametrize("lengths", [(1, 1, 1), (2, 2, 2, 2), (2, 1, 2, 7, 1)],
                         ids=["ones", "twos", "mixed"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_length_boundaries(model, lengths):
    """All single rows (exact signatures only), all two rows (the smallest
    ragged group, ``rows_copied``'s boundary) and a mix, training."""
    for policy in ("depth", "auto"):
        compare(MODELS[model], True, policy, lengths=lengths)


@pytest.mark.parametrize("model", ["attention", "gates"])
@POLICY
def test_through_jitbatch_map(model, policy):
    compare(MODELS[model], True, policy, mapped=True)


@pytest.mark.parametrize("model", ["attention", "normalized"])
@POLICY
def test_float64(model, policy):
    """float64 parameters and inputs: the merged launches compute in float64
    (a float32 detour would be ~1e-7 off, far beyond the tolerance)."""
    compare(MODELS[model], True, policy, dtype="float64", rtol=1e-9, atol=1e-11)


# -- training-loop interactions --------------------------------------------------------
def _program(policy, mode):
    """The attention model through a training pattern; flat list of arrays."""
    net = initialized(SelfAttention())
    if policy is not None:
        net.hybridize(dynamic_batch=True, policy=policy)
    params = list(net.collect_params().values())
    out = []
    if mode == "add":
        for p in params:
            p.grad_req = "add"
            p.zero_grad()
        for seed in (0, 1):
            xs = sequences(seed=seed)
            with autograd.record():
                ys = [net(x) for x in xs]
                loss = nd.add_n(*[nd.sum(y * y) for y in ys])
            loss.backward()
            out += [y.asnumpy() for y in ys]
    elif mode == "input_grads":
        xs = sequences()
        for x in xs:
            x.attach_grad()
        with autograd.record():
            ys = [net(x) for x in xs]
            loss = nd.add_n(*[nd.sum(y * y) for y in ys])
        loss.backward()
        out += [y.asnumpy() for y in ys] + [x.grad.asnumpy() for x in xs]
    elif mode == "read_midway":
        xs = sequences()
        with autograd.record():
            ys = []
            for i, x in enumerate(xs):
                ys.append(net(x))
                if i == 2:
                    out.append(ys[-1].asnumpy())     # forces a flush mid-minibatch
            loss = nd.add_n(*[nd.sum(y * y) for y in ys])
        loss.backward()
        out += [y.asnumpy() for y in ys]
    out += [p.grad().asnumpy().copy() for p in params]
    net.hybridize(active=False)
    return out


@pytest.mark.parametrize("mode", ["add", "input_grads", "read_midway"])
@POLICY
def test_training_patterns(mode, policy):
    want = _program(None, mode)
    got = _program(policy, mode)
    assert len(want) == len(got)
    for i, (a, b) in enumerate(zip(want, got)):
        assert a.shape == b.shape, i
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-5, err_msg="array %d" % i)


# -- in-place writes next to the new views -----------------------------------------
def _aliasing(policy, variant):
    """Inference: the new lazy slices and reshapes of a sample's rows, then an
    in-place write to the source or to one of them; every array read after.
    MXNet's reshape is a view (a write shows through), its column slices
    are copies (it does not)."""
    mx.random.seed(0)
    net = gluon.nn.Dense(E, in_units=3, flatten=False, prefix="alias_")
    net.initialize(mx.init.Uniform(0.5))
    if policy is not None:
        net.hybridize(dynamic_batch=True, policy=policy)
    kept = []
    for x in sequences((3, 1, 4, 2)):
        h = net(x)
        e = h.expand_dims(1)
        views = [h[:, 1:], h[:, 0], h.reshape((-1, HEADS, D)), h.reshape(0, -1), e[:, 0],
                 e[:, :, ::2], h[:, -1:]]
        if variant == "source":
            h[:] = 7.0
        elif variant == "source_add":
            h += 1
        elif variant == "reshape":
            views[2][:] = 3.0
        elif variant == "reshape_row":
            views[3][0] = 2.0
        elif variant == "slice":
            views[0][:] = 3.0
        kept.append([h, e] + views)
    out = [a.asnumpy() for arrays in kept for a in arrays]
    net.hybridize(active=False)
    return out


@pytest.mark.parametrize("variant", ["none", "source", "source_add", "reshape", "reshape_row",
                                     "slice"])
@POLICY
def test_writes_beside_new_views(variant, policy):
    want = _aliasing(None, variant)
    got = _aliasing(policy, variant)
    assert len(want) == len(got)
    for i, (a, b) in enumerate(zip(want, got)):
        assert a.shape == b.shape, i
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg="array %d" % i)


# -- launch counts ---------------------------------------------------------------------
class Counted(gluon.Block):
    """One call per sample of each operator under test, each once per sample
    (every sample's graph has the same structure, so in ``depth`` and
    ``agenda`` the calls of one signature are ready together)."""

    def __init__(self, **kw):
        super().__init__(prefix="cnt_", **kw)
        with self.name_scope():
            self.emb = gluon.nn.Dense(E, in_units=3, flatten=False)

    def forward(self, x):  # pylint: disable=arguments-differ
        h = self.emb(x)                                       # (T, 6)
        a = h[:, 1:]                                          # slice             (T, 5)
        b = h[:, 0]                                           # slice + squeeze   (T,)
        r = a[:, :4].reshape((-1, 2, 2))                      # slice + Reshape   (T, 2, 2)
        r = nd.LeakyReLU(r, act_type="gelu")                  # LeakyReLU
        n = nd.L2Normalization(r, mode="channel")             # L2Normalization
        t = nd.tile(n, reps=(1, 2))                           # tile (fewer reps) (T, 2, 4)
        m, v = nd.moments(t, axes=(2,))                       # moments           (T, 2)
        w = nd.swapaxes(t, 1, 2)                              # SwapAxis (mixes no rows, but
                                                              # has no ragged rule)
        z = nd.sum(w, axis=(1, 2)) + b + nd.sum(m + v, axis=1)
        return nd.sum(z, keepdims=True)


COUNT_LENGTHS = (3, 1, 5, 2, 4, 3, 1, 2, 6)


@pytest.mark.parametrize("policy", ["depth", "agenda"])
def test_launch_counts(policy):
    """Nine samples: seven of two rows or more (lengths 3, 5, 2, 4, 3, 2, 6:
    five distinct) and two single rows. Each operator that maps rows to rows
    whatever their number runs in one ragged launch for the seven, plus one
    for the two single-row samples (a call of one row keeps its exact
    signature; both single-row calls share it): 2 launches. That holds for

    * ``slice``: two calls per sample (``h[:, 1:]``, ``a[:, :4]``), each
      with axis 0 taken whole (begin/end None), ready at different depths,
      each its own signature (different attributes) -> 2 * 2 = 4; plus
      ``h[:, 0]``'s slice -> 6;
    * ``squeeze`` (``h[:, 0]``'s dropped axis) -> 2;
    * ``Reshape`` (target ``(0, 2, 2)`` for T >= 2; ``(-1, 2, 2)`` as given
      for the single rows) -> 2;
    * ``LeakyReLU`` (gelu), ``L2Normalization`` (channel), ``tile`` (reps
      (1, 2) on rank 3: axis 0 repeated once) -> 2 each;
    * ``moments`` over axis 2 -> 2.

    ``swapaxes`` has a rule (samples stacked) but no ragged one: one launch
    per distinct length: 5 + 1 (the single rows) = 6.

    Measured on the code before these changes (7d59c32, pure Python): slice
    18 (one per distinct length, 6, per site), Reshape 12 (the two of
    ``h[:, 0]`` and ``a[:, :4].reshape``, each per length), tile 9 and
    LeakyReLU, L2Normalization, moments, SwapAxis 9 each (one per call)."""
    net = initialized(Counted())
    net.hybridize(dynamic_batch=True, policy=policy)
    xs = sequences(COUNT_LENGTHS)
    seen = launches_by_name(lambda: nd.concat(*[net(x) for x in xs], dim=0).asnumpy())
    net.hybridize(active=False)
    want = {"slice": 6, "squeeze": 2, "Reshape": 2, "LeakyReLU": 2, "L2Normalization": 2,
            "tile": 2, "moments": 2, "SwapAxis": 6}
    assert {k: seen.get(k) for k in want} == want, seen


class NoRuleKinds(gluon.Block):
    """Kinds left without a merging rule: prelu (a slope per channel), tile
    with more reps than axes; each call its own launch."""

    def __init__(self, **kw):
        super().__init__(prefix="norule_", **kw)
        with self.name_scope():
            self.emb = gluon.nn.Dense(4, in_units=3, flatten=False)
            self.gamma = self.params.get("gamma", shape=(4,), init=mx.init.Constant(0.25))

    def forward(self, x):  # pylint: disable=arguments-differ
        h = self.emb(x)                                             # (T, 4)
        p = nd.LeakyReLU(h, gamma=self.gamma.data(), act_type="prelu")
        t = nd.tile(p, reps=(2, 1, 1))                              # (2, T, 4)
        return nd.sum(t, axis=(0, 1)).reshape((1, 4))


@TRAIN
@POLICY
def test_kinds_without_rules_equal_plain_gluon(policy, train):
    compare(NoRuleKinds, train, policy)


def test_kinds_without_rules_run_per_call():
    """Six samples of two lengths: ``LeakyReLU`` prelu and the tile whose
    reps outnumber the axes run one launch per call (6 each); the merged
    ``Dense`` runs once."""
    net = initialized(NoRuleKinds())
    net.hybridize(dynamic_batch=True, policy="depth")
    xs = sequences((2, 3, 2, 3, 2, 3))
    seen = launches_by_name(lambda: nd.concat(*[net(x) for x in xs], dim=0).asnumpy())
    net.hybridize(active=False)
    assert seen.get("LeakyReLU") == 6 and seen.get("tile") == 6, seen


# -- found and fixed: broadcast_like's right-hand side in backward() -------------------------
_BROADCAST_LIKE = """
import numpy as np, mxnet as mx
from mxnet import autograd, gluon, nd
import jitbatch
jitbatch.config.pipeline = False

class Net(gluon.Block):
    def __init__(self, **kw):
        super().__init__(prefix="bl_", **kw)
        with self.name_scope():
            self.a = gluon.nn.Dense(4, in_units=3, flatten=False)
            self.b = gluon.nn.Dense(4, in_units=4, flatten=False)
            self.row = self.params.get("row", shape=(1, 4))
    def forward(self, x):
        h = self.a(x)                              # (T, 4)
        p = nd.tanh(h)                             # (T, 4)
        k = self.b(h)                              # (T, 4)
        q = nd.mean(p, axis=0, keepdims=True)      # (1, 4): the sample's pooled row
        row = self.row.data()                      # (1, 4): a learned row
        return %s

def go(policy):
    mx.random.seed(0)
    net = Net(); net.initialize(mx.init.Uniform(0.5))
    if policy:
        net.hybridize(dynamic_batch=True, policy=policy)
    rng = np.random.default_rng(0)
    xs = [nd.array(rng.normal(size=(t, 3))) for t in %s]
    if %s:
        with autograd.record():
            ys = [net(x) for x in xs]
            loss = nd.add_n(*[nd.sum(y * y) for y in ys])
        loss.backward()
        grads = [p.grad().asnumpy().copy() for p in net.collect_params().values()]
    else:
        ys, grads = [net(x) for x in xs], []
    out = [y.asnumpy() for y in ys] + grads
    net.hybridize(active=False)
    return out

jitbatch.config.max_pending = %d
want = go(None)
got = go(%r)
for i, (w, g) in enumerate(zip(want, got)):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=str(i))
print("same")
"""

#: found by this file (2026-11-27): each crashed the process in backward()
#: where plain Gluon runs. MXNet 1.9.1 gives the shape source of
#: broadcast_like / reshape_like / slice_like a zeros_like gradient and crashed
#: on it where that input was rows gathered or sliced from a launch (the first
#: two since broadcast_like merges, the others before too); recorded launches
#: now detach such inputs (executors.OpExec._detached)
#: (expression, lengths, training, policy, max_pending)
BROADCAST_LIKE_CASES = [
    pytest.param("nd.broadcast_like(row, q) + q", (1, 2), True, "depth", 200000,
                 id="learned-row-like-pooled-lengths-1-2"),
    pytest.param("nd.broadcast_like(q, p) + p", (2,) * 5, True, "agenda", 10,
                 id="pooled-like-rows-chunked-flushes"),
    pytest.param("nd.broadcast_like(q, k)", (2, 3), True, "depth", 200000,
                 id="rhs-shape-only"),
    pytest.param("nd.broadcast_like(q, k, lhs_axes=(0,), rhs_axes=(0,))", (2, 2), True,
                 "auto", 200000,
                 id="rhs-shape-only-axes"),
    pytest.param("nd.reshape_like(p, k)", (2, 2), True, "depth", 200000,
                 id="reshape_like-rhs-shape-only"),
    pytest.param("nd.broadcast_like(row, q) + q", (1, 2), True, "sequential", 200000,
                 id="sequential-runs"),
    pytest.param("nd.broadcast_like(row, q) + q", (1, 2), False, "depth", 200000,
                 id="inference-runs"),
    pytest.param("nd.broadcast_like(row, q.detach()) + q", (1, 2), True, "depth", 200000,
                 id="detached-rhs-runs"),
    pytest.param("nd.broadcast_to(q, shape=p.shape) + p", (2,) * 5, True, "agenda", 10,
                 id="broadcast_to-chunked-runs"),
    pytest.param("nd.broadcast_like(q, k) + k", (2, 3), True, "depth", 200000,
                 id="rhs-also-used-runs"),
    pytest.param("nd.slice_like(p, k) + nd.slice_like(k, q) * q", (2, 3, 1), True, "agenda",
                 200000, id="slice_like-rhs"),
]


@pytest.mark.parametrize("expr, lengths, train, policy, max_pending", BROADCAST_LIKE_CASES)
def test_broadcast_like_right_hand_side_in_backward(expr, lengths, train, policy, max_pending):
    rc, out, err = run_in_subprocess(_BROADCAST_LIKE % (expr, lengths, train, max_pending, policy))
    assert rc == 0 and "same" in out, (rc, out[-500:], err[-1500:])
