"""Held-out programs, round 36: saving, loading, copying and reproducing
flagged models in the middle of their use, written the way Gluon users write
them.

* ``save_parameters`` / ``load_parameters`` while per-sample calls pend:
  the file holds the values at the save (predictions recorded before a step
  and read after it), a checkpoint loaded back while predictions pend (they
  read the values they were called with), a fresh flagged net loaded then
  trained (an MLP and a GRU cell stepped over ragged sequences),
  ``collect_params().save`` / ``load`` with ``strip_prefix`` /
  ``restore_prefix``, ``allow_missing`` / ``ignore_extra``, a file of the
  wrong shape (MXNet's assertion, the pending predictions kept),
  ``net.cast('float64')`` then ``load_parameters(cast_dtype=True)`` with
  ``dtype_source`` 'current' and 'saved'.
* Lazy outputs written out: ``nd.save`` of a list, a dict holding lazy and
  concrete arrays, one lazy array, views (``y[0:1]``, ``y.reshape``), inside
  ``autograd.record`` before ``backward``; ``asnumpy()`` inside a ``with
  open(...)`` writing loop; ``pickle.dump`` of a list of lazy outputs to a
  file; ``copy.copy`` / ``copy.deepcopy`` / ``pickle`` of lazy outputs, then
  an in-place write to the original.
* ``net.export`` of a flagged net after per-sample training (predictions
  pending), ``SymbolBlock.imports`` of its files flagged with
  ``dynamic_batch=True``, run per sample and trained (a Dropout in it too).
* ``copy.deepcopy`` / ``pickle`` of a flagged net while its calls pend,
  then the original and the copy trained apart, and called interleaved in one
  pending graph.
* ``Trainer.save_states`` / ``load_states`` (Adam, SGD with momentum,
  ``update_on_kvstore`` both ways) resumed mid-epoch into a fresh flagged net
  and trainer, and a checkpoint-and-resume loop (save every k minibatches,
  reload, continue), against an uninterrupted plain run.
* Reproducibility: ``Dropout`` in training mode inside the flagged block,
  ``mx.random.seed`` between minibatches (plain Gluon's numbers); per-sample
  noise around the net (input noise, ``normal_like``, ``nd.Dropout``,
  ``uniform``) in two flagged runs from one seed; merged ``nd.Dropout``
  masks, one per sample, their gradients following them.
* Saving and copying while a recorded minibatch waits for its ``backward``:
  ``load_parameters`` inside ``autograd.record`` (refused in MXNet's words,
  as per sample), ``export``, ``pickle`` and ``copy.deepcopy`` (the copy
  called there too), ``Trainer.load_states`` before the backward, ``nd.save``
  of the gradients while predictions pend, ``save_parameters(deduplicate=
  True)`` of a net sharing another's parameters.
* Networks with deferred initialization (``nn.Dense(5)`` without
  ``in_units``, the Gluon default) whose first calls pend: the Parameter API
  used before the first read, a checkpoint loaded before the first call and
  after the first read, a net whose per-sample structure branches.

The oracle is plain per-sample Gluon (no hybridize; ``net.hybridize()`` for
the export, which plain Gluon needs) on the same parameters and inputs:
outputs, gradients and learned parameters, under the policies auto, depth,
agenda and sequential (some cases under two of them). Launch counts only
under 'depth' and 'agenda'.

Findings, fixed 2026-11-26: networks with deferred initialization. Plain
Gluon initializes a layer's parameters at the layer's first call; a flagged
block's first call only recorded, and its parameters stayed deferred until
its launch (``_build_cache`` inside ``executors.BlockExec.launch`` finished
the deferred initialization). Until that launch:

* ``load_parameters`` while the first calls pend lost the loaded values,
  silently: ``Parameter._load_init`` set the loaded array, its
  ``_init_grad`` (``autograd.mark_variables``) read the handle, which ran
  the pending graph, whose launch finished the deferred initialization and
  replaced the loaded array with the initializer's.
* ``initialize(force_reinit=True)`` while they pend: the pending predictions
  used the new initializer's values (plain Gluon: the old ones), silently.
* Reproducibility: the initializer drew from MXNet's generator at the
  launch, not at the first call (inputs drawn with ``nd.random.normal``
  between the first calls were not plain Gluon's, nor were the weights), and
  in launch order, not first-call order (a net whose samples take different
  branches got another layer's initial weights under 'depth').
* ``save_parameters``, ``collect_params().save``, ``param.data()``,
  ``param.grad()``, ``copy.deepcopy`` / ``pickle`` of the net raised
  ``DeferredInitializationError`` though a batch was passed;
  ``net.cast('float64')`` and ``collect_params().reset_ctx`` failed the
  pending launch (``ExecutionError``; the pending samples lost).

A new block signature now finishes the deferred initialization at the call
that makes it (``signatures._finish_deferred``), in the order the block's
graph reads the parameters, as plain Gluon does.

Nothing else found: with ``in_units`` given (or after the first read) every
program gives plain Gluon's numbers. Dropout's masks in merged launches are
plain Gluon's, bit for bit, from the same seed; random draws made between
the calls (input noise, ``normal_like``, ``nd.Dropout`` on lazy outputs,
``uniform(shape=y.shape)``) are made in another order than per sample, so
their numbers are not plain Gluon's (documented as per-sample draws, not as
plain Gluon's stream): those programs are checked for reproducibility (two
flagged runs, bit for bit) and, for ``nd.Dropout``, for per-sample masks
whose gradients follow them. Plain MXNet refuses ``Trainer(kvstore='local',
update_on_kvstore=True)`` with one device (no KVStore made): that case passes
a KVStore object.
"""
import copy
import os
import pickle
import warnings

import numpy as np
import pytest
import mxnet as mx
from mxnet import autograd, gluon, nd
from mxnet.gluon import HybridBlock, nn, rnn

import jitbatch
from heldout import (both, cleanup, flag, grads_of, merged, nothing_pending,  # noqa: F401
                     params_of, rng_for, same_values as same, seeded)

POLICIES = ["auto", "depth", "agenda", "sequential"]
POLICY = pytest.mark.parametrize("policy", POLICIES)
MERGING = ["depth", "agenda"]


# -- models and data -----------------------------------------------------------------------
class MLP(HybridBlock):
    def __init__(self, n_in=4, hidden=8, n_out=3, extra=False, **kw):
        super(MLP, self).__init__(**kw)
        self.extra = extra
        with self.name_scope():
            self.a = nn.Dense(hidden, in_units=n_in, activation="tanh")
            self.b = nn.Dense(n_out, in_units=hidden)
            if extra:
                self.c = nn.Dense(n_out, in_units=n_out)

    def hybrid_forward(self, F, x):
        y = self.b(self.a(x))
        return self.c(y) + y if self.extra else y


class DropMLP(HybridBlock):
    def __init__(self, p=0.4, **kw):
        super(DropMLP, self).__init__(**kw)
        with self.name_scope():
            self.a = nn.Dense(8, in_units=4, activation="relu")
            self.drop = nn.Dropout(p)
            self.b = nn.Dense(3, in_units=8)

    def hybrid_forward(self, F, x):
        return self.b(self.drop(self.a(x)))


class Tagger(gluon.Block):
    """A GRU cell stepped over a ragged ``(T, 3)`` sequence, a Dense head on
    its last state (both flagged)."""

    def __init__(self, **kw):
        super(Tagger, self).__init__(**kw)
        with self.name_scope():
            self.cell = rnn.GRUCell(6, input_size=3)
            self.head = nn.Dense(2, in_units=6)

    def forward(self, seq):
        h = [nd.zeros((1, 6))]
        out = h[0]
        for t in range(seq.shape[0]):
            out, h = self.cell(seq[t:t + 1], h)
        return self.head(out)


def samples(key, n=5, width=4):
    rng = rng_for(key)
    return [nd.array(rng.normal(size=(1, width))) for _ in range(n)]


def sequences(key, n=4):
    rng = rng_for(key)
    return [nd.array(rng.normal(size=(int(rng.integers(1, 4)), 3))) for _ in range(n)]


def sq(y):
    return nd.sum(y * y)


def step(net, trainer, xs, fn=None):
    """One minibatch: per-sample losses recorded, backward, a Trainer step;
    returns the losses read."""
    fn = fn or (lambda x: sq(net(x)))
    with autograd.record():
        losses = [fn(x) for x in xs]
    autograd.backward(losses)
    trainer.step(len(xs))
    return [l.asnumpy() for l in losses]


def tag_of(policy):
    return "plain" if policy is None else "flagged"


# -- 1. save_parameters / load_parameters while calls pend --------------------------------
@POLICY
def test_a_save_while_predictions_pend_holds_the_values_at_the_save(policy, tmp_path):
    """Predictions recorded, the parameters saved, a step taken, saved again,
    the predictions read (the values they were called with); both files
    loaded into fresh flagged nets and run per sample."""
    xs = samples("save-pend")

    def program(net, p):
        flag(net, p)
        base = str(tmp_path / tag_of(p))
        tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.3})
        preds = [net(x) for x in xs]
        net.save_parameters(base + "-1.params")
        out = step(net, tr, xs)
        preds2 = [net(x) * 2 for x in xs]
        net.save_parameters(base + "-2.params")
        out += step(net, tr, xs[::-1])
        out += [y.asnumpy() for y in preds + preds2]
        for k in (1, 2):
            fresh = MLP(prefix="fresh%d_" % k)
            fresh.load_parameters(base + "-%d.params" % k)
            flag(fresh, p)
            out += [fresh(x).asnumpy() for x in xs] + params_of(fresh)
            fresh.hybridize(active=False)
        return out + params_of(net)

    want, got, st = both(seeded(MLP), program, policy)
    same(want, got, "prediction, loss or loaded parameter")
    if policy in MERGING:
        assert merged(st), st


@POLICY
def test_a_checkpoint_loaded_while_predictions_pend(policy, tmp_path):
    """A checkpoint saved, two steps, predictions (and a recorded loss not
    yet differentiated) pending, the checkpoint loaded: the predictions read
    the trained values, the next calls the checkpoint's; training goes on."""
    xs = samples("load-pend")

    def program(net, p):
        flag(net, p)
        path = str(tmp_path / (tag_of(p) + ".params"))
        net.save_parameters(path)
        tr = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 0.1})
        out = step(net, tr, xs) + step(net, tr, xs[1:])
        preds = [net(x) for x in xs]
        net.load_parameters(path)
        after = [net(x) for x in xs]
        out += [y.asnumpy() for y in preds + after] + params_of(net)
        out += step(net, tr, xs)
        return out + params_of(net)

    want, got, st = both(seeded(MLP), program, policy)
    same(want, got, "prediction, loss or parameter")
    if policy in MERGING:
        assert merged(st), st


@POLICY
def test_a_fresh_flagged_tagger_loaded_then_trained(policy, tmp_path):
    """A GRU tagger trained one minibatch per sample, saved while its next
    predictions pend; a fresh flagged tagger loads the file and trains on."""
    seqs = sequences("tagger")

    def program(net, p):
        flag(net, p)
        path = str(tmp_path / (tag_of(p) + ".params"))
        tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.2})
        out = step(net, tr, seqs)
        preds = [net(s) for s in seqs]
        net.save_parameters(path)
        out += [y.asnumpy() for y in preds]
        fresh = Tagger(prefix="again_")
        fresh.load_parameters(path)
        flag(fresh, p)
        tr2 = gluon.Trainer(fresh.collect_params(), "sgd", {"learning_rate": 0.2})
        for _ in range(2):
            out += step(fresh, tr2, seqs) + grads_of(fresh)
        fresh.hybridize(active=False)
        return out + params_of(net, fresh)

    want, got, st = both(seeded(Tagger), program, policy)
    same(want, got, "tagger loss, gradient or parameter")
    if policy in MERGING:
        assert merged(st), st


@POLICY
def test_collect_params_save_and_load_with_prefixes(policy, tmp_path):
    """``collect_params().save(strip_prefix=...)`` while predictions pend; a
    step; ``collect_params().load(restore_prefix=...)`` while new ones pend."""
    xs = samples("collect")

    def program(net, p):
        flag(net, p)
        path = str(tmp_path / (tag_of(p) + ".params"))
        tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.3})
        preds = [net(x) for x in xs]
        net.collect_params().save(path, strip_prefix=net.prefix)
        out = step(net, tr, xs)
        preds2 = [net(x) for x in xs]
        net.collect_params().load(path, restore_prefix=net.prefix)
        out += [y.asnumpy() for y in preds + preds2 + [net(x) for x in xs]]
        return out + params_of(net) + sorted(nd.load(path))

    want, got, _ = both(seeded(MLP, prefix="mlp_"), program, policy)
    same(want, got, "prediction or parameter")


@POLICY
def test_loading_a_file_of_another_architecture_while_calls_pend(policy, tmp_path):
    """A net with an extra layer loads a smaller net's file
    (``allow_missing``), or the smaller net the bigger one's
    (``ignore_extra``), while predictions pend; then a step."""
    for how in ("allow_missing", "ignore_extra"):
        loading_another_architecture(policy, how, tmp_path)


def loading_another_architecture(policy, how, tmp_path):
    xs = samples("arch-" + how)
    big = how == "allow_missing"

    def make():
        mx.random.seed(1)
        donor = MLP(extra=not big, prefix="m_")
        donor.initialize(mx.init.Uniform(0.7))
        mx.random.seed(0)
        net = MLP(extra=big, prefix="m_")
        net.initialize(mx.init.Uniform(0.5))
        return [net, donor]

    def program(nets, p):
        net, donor = nets
        path = str(tmp_path / (tag_of(p) + how + ".params"))
        donor.save_parameters(path)
        flag(net, p)
        preds = [net(x) for x in xs]
        net.load_parameters(path, **{how: True})
        out = [y.asnumpy() for y in preds + [net(x) for x in xs]]
        tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.2})
        return out + step(net, tr, xs) + params_of(net)

    want, got, _ = both(make, program, policy)
    same(want, got, how + ": prediction, loss or parameter")


@pytest.mark.parametrize("policy", ["auto", "depth"])
def test_a_file_of_the_wrong_shape_is_refused_and_pending_predictions_survive(
        policy, tmp_path):
    xs = samples("wrong-shape")
    mx.random.seed(2)
    other = MLP(hidden=5, prefix="o_")
    other.initialize()
    path = str(tmp_path / "other.params")
    other.save_parameters(path)

    def program(net, p):
        flag(net, p)
        preds = [net(x) for x in xs]
        with pytest.raises(AssertionError, match="shape incompatible"):
            net.load_parameters(path)
        return [y.asnumpy() for y in preds + [net(x) for x in xs]] + params_of(net)

    want, got, _ = both(seeded(MLP), program, policy)
    same(want, got, "prediction or parameter")


@POLICY
def test_cast_to_float64_then_load_with_cast_dtype(policy, tmp_path):
    """float32 parameters saved; float32 predictions pending; ``cast
    ('float64')``; ``load_parameters(cast_dtype=True, dtype_source=...)``:
    'current' keeps float64 (float64 samples follow), 'saved' brings float32
    back; a step in that dtype."""
    for source in ("current", "saved"):
        cast_then_load(policy, source, tmp_path)


def cast_then_load(policy, source, tmp_path):
    xs = samples("cast-" + source)

    def program(net, p):
        flag(net, p)
        path = str(tmp_path / (tag_of(p) + source + ".params"))
        tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.2})
        out = step(net, tr, xs)
        net.save_parameters(path)
        preds = [net(x) for x in xs]
        net.cast("float64")
        preds64 = [net(x.astype("float64")) for x in xs]
        net.load_parameters(path, cast_dtype=True, dtype_source=source)
        dt = "float64" if source == "current" else "float32"
        tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.2})
        xd = [x.astype(dt) for x in xs]
        out += [y.asnumpy() for y in preds + preds64 + [net(x) for x in xd]]
        out += step(net, tr, xd)
        out += [p_.data().dtype.__name__ for p_ in net.collect_params().values()]
        return out + params_of(net)

    want, got, _ = both(seeded(MLP), program, policy)
    same(want, got, source + ": prediction, loss, dtype or parameter")


# -- 2. lazy outputs written out ----------------------------------------------------------
@POLICY
def test_nd_save_of_lazy_outputs_in_lists_dicts_and_views(policy, tmp_path):
    """``nd.save`` of a list of pending outputs, of a dict holding pending
    and concrete arrays, of one pending array, and of views of pending
    arrays (``y[0:1]``, ``y.reshape``, ``y[0]``), each loaded back."""
    xs = samples("nd-save")

    def program(net, p):
        flag(net, p)
        base = str(tmp_path / tag_of(p))
        out = []
        ys = [net(x) for x in xs]
        nd.save(base + "-list", ys)
        out += [a.asnumpy() for a in nd.load(base + "-list")]
        ys = [net(x) for x in xs]
        nd.save(base + "-dict", {"y%d" % i: y for i, y in enumerate(ys)})
        ys = [net(x) + 1 for x in xs]
        mixed = {"lazy": ys[0], "concrete": nd.ones((2, 3)), "sum": nd.add_n(*ys),
                 "input": xs[1]}
        nd.save(base + "-mixed", mixed)
        loaded = nd.load(base + "-mixed")
        out += [loaded[k].asnumpy() for k in sorted(loaded)]
        loaded = nd.load(base + "-dict")
        out += [loaded[k].asnumpy() for k in sorted(loaded)]
        y = net(xs[2]) * 3
        nd.save(base + "-one", y)
        out += [a.asnumpy() for a in nd.load(base + "-one")]
        ys = [net(x) for x in xs]
        nd.save(base + "-views", [ys[0][0:1], ys[1].reshape((-1,)), ys[2][0], ys[3].T])
        return out + [a.asnumpy() for a in nd.load(base + "-views")]

    want, got, st = both(seeded(MLP), program, policy)
    same(want, got, "saved array")
    if policy in MERGING:
        assert merged(st), st


@POLICY
def test_nd_save_and_pickle_inside_autograd_record_then_backward(policy, tmp_path):
    """Per-sample losses saved with ``nd.save`` and pickled inside the
    recording, before ``backward``; the gradients and the step are plain
    Gluon's."""
    xs = samples("save-record")

    def program(net, p):
        flag(net, p)
        base = str(tmp_path / tag_of(p))
        tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
        out = []
        for k in range(2):
            with autograd.record():
                ys = [net(x) for x in xs]
                losses = [sq(y) for y in ys]
                nd.save(base + "-losses", losses)
                blob = pickle.dumps(ys)
            autograd.backward(losses)
            out += grads_of(net)
            tr.step(len(xs))
            out += [a.asnumpy() for a in nd.load(base + "-losses")]
            out += [a.asnumpy() for a in pickle.loads(blob)]
        return out + params_of(net)

    want, got, _ = both(seeded(MLP), program, policy)
    same(want, got, "loss, output, gradient or parameter")


@POLICY
def test_outputs_read_inside_a_file_writing_loop(policy, tmp_path):
    """Predictions written one line per sample inside ``with open(...)``
    (``asnumpy`` of each in the loop), and ``pickle.dump`` of the list of
    pending outputs into an open file; the files are plain Gluon's."""
    xs = samples("write-loop", n=6)

    def program(net, p):
        flag(net, p)
        base = str(tmp_path / tag_of(p))
        ys = [net(x) for x in xs]
        with open(base + ".txt", "w") as f:
            for i, y in enumerate(ys):
                f.write("%d %s\n" % (i, " ".join("%.5f" % v for v in y.asnumpy().ravel())))
                if i == 2:
                    ys.append(net(y[:, :1].tile((1, 4))))   # a call recorded mid-loop
        ys = [net(x) for x in xs]
        with open(base + ".pkl", "wb") as f:
            pickle.dump(ys, f)
        with open(base + ".pkl", "rb") as f:
            back = pickle.load(f)
        with open(base + ".txt") as f:
            text = f.read()
        return [text] + [a.asnumpy() for a in back]

    want, got, _ = both(seeded(MLP), program, policy)
    same(want, got, "written text or pickled output")


@POLICY
def test_copies_of_lazy_outputs_keep_their_values_after_a_write(policy):
    """A pending output copied (``copy.copy``, ``copy.deepcopy``, pickled
    and unpickled), then the original written in place (``y += 1``,
    ``y[:] = 0``): the copy keeps the value it had, as in plain Gluon."""
    for how in ("copy", "deepcopy", "pickle"):
        copies_of_lazy_outputs(policy, how)


def copies_of_lazy_outputs(policy, how):
    xs = samples("copy-lazy-" + how)
    dup = {"copy": copy.copy, "deepcopy": copy.deepcopy,
           "pickle": lambda a: pickle.loads(pickle.dumps(a))}[how]

    def program(net, p):
        flag(net, p)
        ys = [net(x) for x in xs]
        copies = [dup(y) for y in ys]
        ys[0] += 1
        ys[1][:] = 0
        out = [c.asnumpy() for c in copies] + [y.asnumpy() for y in ys]
        zs = [net(x) * 2 for x in xs]
        more = dup(zs)
        zs[2] *= 3
        return out + [c.asnumpy() for c in more] + [z.asnumpy() for z in zs]

    want, got, _ = both(seeded(MLP), program, policy)
    same(want, got, how + ": copied or written output")


# -- 3. export and SymbolBlock.imports ----------------------------------------------------
def imports(prefix, epoch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return gluon.SymbolBlock.imports(prefix + "-symbol.json", ["data"],
                                         prefix + "-%04d.params" % epoch)


@POLICY
@pytest.mark.parametrize("model", ["mlp", "dropout"])
def test_export_after_per_sample_training_then_imports_flagged_and_trained(
        policy, model, tmp_path):
    """A net trained per sample, exported while its next predictions pend;
    the files imported as a ``SymbolBlock``, flagged with
    ``dynamic_batch=True``, run per sample and trained two steps (for the
    Dropout net: in training mode, a seed before each minibatch). Plain
    Gluon needs ``hybridize()`` to export: its oracle runs so."""
    xs = samples("export-" + model)
    cls = MLP if model == "mlp" else DropMLP

    def program(net, p):
        if p is None:
            net.hybridize()
        else:
            flag(net, p)
        prefix = str(tmp_path / tag_of(p))
        tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.2})
        out = []
        for k in range(2):
            mx.random.seed(10 + k)
            out += step(net, tr, xs)
        preds = [net(x) for x in xs]
        net.export(prefix, epoch=2)
        out += [y.asnumpy() for y in preds]
        sb = imports(prefix, 2)
        flag(sb, p)
        out += [sb(x).asnumpy() for x in xs]
        tr2 = gluon.Trainer(sb.collect_params(), "sgd", {"learning_rate": 0.2})
        for k in range(2):
            mx.random.seed(20 + k)
            out += step(sb, tr2, xs[k:]) + grads_of(sb)
        out += [sb(x).asnumpy() for x in xs]
        sb.hybridize(active=False)
        return out + params_of(net, sb)

    want, got, st = both(seeded(cls), program, policy)
    same(want, got, "output, loss, gradient or parameter")
    if policy in MERGING:
        assert merged(st), st


# -- 4. copies of flagged nets ------------------------------------------------------------
@POLICY
def test_a_copy_made_while_calls_pend_trains_apart(policy):
    """Predictions pending, the net copied (``copy.deepcopy``, or pickled and
    unpickled) and re-flagged, then the original and the copy trained apart
    (other data, other optimizers), called interleaved in one pending graph;
    the predictions read at the end."""
    for how in ("deepcopy", "pickle"):
        copy_trained_apart(policy, how)


def copy_trained_apart(policy, how):
    xs = samples("copy-net-" + how, n=4)
    dup = copy.deepcopy if how == "deepcopy" else (lambda n: pickle.loads(pickle.dumps(n)))

    def program(net, p):
        flag(net, p)
        tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.3})
        out = step(net, tr, xs)
        preds = [net(x) for x in xs]
        twin = dup(net)
        # MXNet's copy has no gradient buffers attached (plain Gluon too)
        twin.collect_params().setattr("grad_req", "null")
        twin.collect_params().setattr("grad_req", "write")
        flag(twin, p)
        tr2 = gluon.Trainer(twin.collect_params(), "adam", {"learning_rate": 0.1})
        out += step(twin, tr2, xs[::-1]) + step(net, tr, xs[1:])
        mixed = [m(x) for x in xs for m in (net, twin)]
        out += step(twin, tr2, xs, fn=lambda x: sq(twin(x)) + sq(twin(x * 2)))
        out += [y.asnumpy() for y in preds + mixed]
        mine, theirs = params_of(net), params_of(twin)
        assert not any(np.allclose(a, b) for a, b in zip(mine, theirs)), "parameters shared"
        twin.hybridize(active=False)
        return out + mine + theirs

    want, got, st = both(seeded(MLP), program, policy)
    same(want, got, how + ": loss, prediction or parameter of the original or the copy")
    if policy in MERGING:
        assert merged(st), st


@pytest.mark.parametrize("policy", MERGING)
def test_a_deepcopy_keeps_its_flags_and_its_calls_merge(policy):
    """A deep copy of a flagged net is flagged (its ``hybridize`` flags
    copied): its per-sample calls merge without flagging it again, and give
    the original's numbers."""
    xs = samples("copy-flags")

    def program(net, p):
        flag(net, p)
        out = [net(x).asnumpy() for x in xs]
        twin = copy.deepcopy(net)
        jitbatch.reset_stats()
        ys = [twin(x) for x in xs]
        out += [y.asnumpy() for y in ys]
        if p is not None:
            st = jitbatch.stats()
            assert st["launches"] == 1 and st["nodes"] == len(xs), st
        twin.hybridize(active=False)
        return out

    want, got, _ = both(seeded(MLP), program, policy)
    same(want, got, "output of the copy")



# -- 4b. saving and copying while a recorded graph waits for its backward ---------------
def load_inside_record(net, p, tmp):
    """``load_parameters`` inside ``autograd.record`` while the recorded calls
    pend: refused in MXNet's words, as per sample (an in-place write to
    arrays in the graph); the backward and the step after are plain Gluon's."""
    path = os.path.join(tmp, "other.params")
    mx.random.seed(9)
    other = MLP(prefix="o_")
    other.initialize(mx.init.Uniform(1.0))
    other.save_parameters(path)
    tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    with autograd.record():
        losses = [sq(net(x)) for x in XS]
        err = None
        try:
            net.load_parameters(path)
        except mx.base.MXNetError as e:
            err = e
    assert err is not None and "already in a computational graph" in str(err), err
    autograd.backward(losses)
    out = grads_of(net)
    tr.step(len(XS))
    net.load_parameters(path)
    return out + [l.asnumpy() for l in losses] + step(net, tr, XS) + params_of(net)


def export_inside_record(net, p, tmp):
    """``net.export`` inside the recording, before ``backward``; the exported
    files imported again."""
    if p is None:
        net.hybridize()
    prefix = os.path.join(tmp, "rec")
    tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    with autograd.record():
        losses = [sq(net(x)) for x in XS]
        net.export(prefix)
    autograd.backward(losses)
    out = grads_of(net)
    tr.step(len(XS))
    sb = imports(prefix, 0)
    return out + [l.asnumpy() for l in losses] + [sb(x).asnumpy() for x in XS] + params_of(net)


def copies_inside_record(net, p, tmp):
    """``pickle`` and ``copy.deepcopy`` of the net inside the recording; the
    deep copy called there too (its calls recorded beside the original's);
    the original's backward and step."""
    tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
    with autograd.record():
        losses = [sq(net(x)) for x in XS]
        twin = pickle.loads(pickle.dumps(net))
        deep = copy.deepcopy(net)
        others = [sq(deep(x)) for x in XS]
    autograd.backward(losses)
    out = grads_of(net)
    tr.step(len(XS))
    deep.hybridize(active=False)
    return out + [l.asnumpy() for l in losses + others] + params_of(net, twin, deep)


def states_and_gradients_saved_while_pending(net, p, tmp):
    """Adam: ``save_states`` after a step, a recorded minibatch pending,
    ``load_states`` before its backward; ``nd.save`` of the gradients (a
    dict) while new predictions pend."""
    path = os.path.join(tmp, "adam.states")
    tr = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 0.1})
    out = step(net, tr, XS)
    tr.save_states(path)
    out += step(net, tr, XS[1:])
    with autograd.record():
        losses = [sq(net(x)) for x in XS]
    tr.load_states(path)
    autograd.backward(losses)
    tr.step(len(XS))
    preds = [net(x) for x in XS]
    nd.save(path + ".grads", {k: q.grad() for k, q in net.collect_params().items()})
    grads = nd.load(path + ".grads")
    return (out + [l.asnumpy() for l in losses] + [grads[k].asnumpy() for k in sorted(grads)]
            + [y.asnumpy() for y in preds] + params_of(net))


def shared_parameters_deduplicated(net, p, tmp):
    """A second net sharing the first's parameters (``params=``), both
    flagged; ``save_parameters(deduplicate=True)`` of the second while both
    nets' predictions pend, a step, the file loaded back."""
    path = os.path.join(tmp, "dedup.params")
    twin = MLP(prefix="twin_", params=net.collect_params())
    flag(twin, p)
    preds = [net(x) for x in XS] + [twin(x) * 2 for x in XS]
    twin.save_parameters(path, deduplicate=True)
    tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.2})
    out = step(net, tr, XS, fn=lambda x: sq(net(x)) + sq(twin(x * 0.5)))
    preds2 = [twin(x) for x in XS]
    twin.load_parameters(path)
    out += [y.asnumpy() for y in preds + preds2] + [net(x).asnumpy() for x in XS]
    twin.hybridize(active=False)
    return out + params_of(net) + sorted(nd.load(path))


XS = samples("mid-record")
MID_RECORD = {"load_parameters": load_inside_record, "export": export_inside_record,
              "copies": copies_inside_record,
              "trainer_states_and_grads": states_and_gradients_saved_while_pending,
              "shared_deduplicated": shared_parameters_deduplicated}


@pytest.mark.parametrize("policy", ["auto", "agenda"])
@pytest.mark.parametrize("case", sorted(MID_RECORD))
def test_saving_and_copying_while_a_recorded_minibatch_pends(policy, case, tmp_path):
    def program(net, p):
        flag(net, p)
        tmp = tmp_path / tag_of(p)
        tmp.mkdir()
        return MID_RECORD[case](net, p, str(tmp))

    want, got, st = both(seeded(MLP), program, policy)
    same(want, got, case)
    if policy == "agenda":
        assert merged(st), st

# -- 5. Trainer states, checkpoints and resuming ------------------------------------------
OPTIMIZERS = {"adam": ("adam", {"learning_rate": 0.05}),
              "momentum": ("sgd", {"learning_rate": 0.1, "momentum": 0.9, "wd": 0.01})}


def minibatches(key, count, n=3):
    return [samples("%s/%d" % (key, i), n=n) for i in range(count)]


@POLICY
@pytest.mark.parametrize("opt,on_kvstore", [("adam", False), ("momentum", True)],
                         ids=["adam-local-updates", "momentum-kvstore-updates"])
def test_trainer_states_resumed_mid_epoch_equal_an_uninterrupted_run(
        policy, opt, on_kvstore, tmp_path):
    """Plain Gluon trains five minibatches without a stop; the flagged run
    saves the parameters and ``Trainer.save_states`` after two (predictions
    pending), and a fresh flagged net and Trainer load them and train the
    other three: the same losses and parameters."""
    batches = minibatches("resume-" + opt, 5)
    name, hp = OPTIMIZERS[opt]

    def trainer_of(net):
        # a KVStore object: with one device MXNet makes none from the name 'local'
        return gluon.Trainer(net.collect_params(), name, dict(hp),
                             kvstore=mx.kv.create("local"), update_on_kvstore=on_kvstore)

    def program(net, p):
        flag(net, p)
        tr = trainer_of(net)
        out = []
        for i, xs in enumerate(batches):
            if p is not None and i == 2:
                base = str(tmp_path / "mid")
                preds = [net(x) for x in xs]
                net.save_parameters(base + ".params")
                tr.save_states(base + ".states")
                out.append(preds[0].asnumpy() * 0)
                net.hybridize(active=False)
                net = MLP(prefix="resumed_")
                net.load_parameters(base + ".params")
                flag(net, p)
                tr = trainer_of(net)
                tr.load_states(base + ".states")
            elif p is None and i == 2:
                out.append(np.zeros((1, 3), "float32"))
            out += step(net, tr, xs)
        net.hybridize(active=False)
        return out + params_of(net)

    want, got, st = both(seeded(MLP), program, policy)
    same(want, got, "loss or parameter")
    if policy in MERGING:
        assert merged(st), st


@POLICY
def test_a_checkpoint_and_resume_loop_equals_plain_training(policy, tmp_path):
    """Save every two minibatches (parameters and Trainer states), reload into
    a fresh flagged tagger and Trainer, continue; the last losses and
    parameters are those of plain Gluon trained without a stop."""
    batches = [sequences("loop/%d" % i, n=3) for i in range(6)]

    def fresh(k):
        mx.random.seed(100 + k)      # other initial values: the load must replace them
        net = Tagger(prefix="tagger_")
        net.initialize(mx.init.Uniform(0.9))
        return net

    def program(net, p):
        flag(net, p)
        tr = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 0.05})
        out = []
        for i, seqs in enumerate(batches):
            out += step(net, tr, seqs)
            if p is not None and i % 2 == 1:
                base = str(tmp_path / ("ckpt-%d" % i))
                net.save_parameters(base + ".params")
                tr.save_states(base + ".states")
                net.hybridize(active=False)
                net = fresh(i)
                flag(net, p)
                net.load_parameters(base + ".params")
                tr = gluon.Trainer(net.collect_params(), "adam", {"learning_rate": 0.05})
                tr.load_states(base + ".states")
        net.hybridize(active=False)
        return out + params_of(net)

    want, got, st = both(lambda: fresh(-1), program, policy)
    same(want, got, "loss or parameter")
    if policy in MERGING:
        assert merged(st), st


@POLICY
def test_trainer_states_loaded_while_predictions_pend(policy, tmp_path):
    """Momentum SGD: states saved; two steps; predictions pending; parameters
    and states loaded back; the step repeated: plain Gluon's numbers."""
    xs = samples("states-pend")
    name, hp = OPTIMIZERS["momentum"]

    def program(net, p):
        flag(net, p)
        base = str(tmp_path / tag_of(p))
        tr = gluon.Trainer(net.collect_params(), name, dict(hp))
        out = step(net, tr, xs)
        net.save_parameters(base + ".params")
        tr.save_states(base + ".states")
        out += step(net, tr, xs) + step(net, tr, xs[::-1])
        preds = [net(x) for x in xs]
        net.load_parameters(base + ".params")
        tr.load_states(base + ".states")
        preds2 = [net(x) for x in xs]
        out += step(net, tr, xs)
        return out + [y.asnumpy() for y in preds + preds2] + params_of(net)

    want, got, _ = both(seeded(MLP), program, policy)
    same(want, got, "loss, prediction or parameter")


# -- 6. reproducibility --------------------------------------------------------------------
@POLICY
def test_dropout_in_training_mode_with_a_seed_per_minibatch_is_plain_gluons(policy):
    """A Dropout inside the flagged block, training mode, ``mx.random.seed``
    before each minibatch: the outputs, gradients and parameters of plain
    Gluon from the same seed (the merged launch's mask holds the rows plain
    Gluon draws one sample at a time)."""
    batches = minibatches("dropout-seeded", 3, n=4)

    def program(net, p):
        flag(net, p)
        tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
        out = []
        for k, xs in enumerate(batches):
            mx.random.seed(31 + k)
            with autograd.record():
                ys = [net(x) for x in xs]
                losses = [sq(y) for y in ys]
            autograd.backward(losses)
            out += [y.asnumpy() for y in ys] + grads_of(net)
            tr.step(len(xs))
        return out + params_of(net)

    want, got, st = both(seeded(DropMLP), program, policy)
    same(want, got, "output, gradient or parameter")
    if policy in MERGING:
        assert merged(st), st


def noisy(net, x):
    """Per-sample randomness around a flagged net, written naively: input
    noise of fixed shape, ``normal_like`` of the output, ``nd.Dropout``, a
    uniform draw of the output's shape."""
    y = net(x + nd.random.normal(shape=(1, 4), scale=0.1))
    y = nd.Dropout(y + nd.random.normal_like(y) * 0.1, p=0.3)
    return y * nd.random.uniform(shape=y.shape)


@POLICY
def test_two_flagged_runs_from_one_seed_give_the_same_numbers(policy):
    """Random inputs, Dropout in the block and between blocks, noise draws:
    two flagged runs from the same seeds give the same losses and
    parameters, bit for bit (MXNet's draws are made in another order than
    per sample, so they are not plain Gluon's numbers: that is left open)."""
    batches = minibatches("repro", 3, n=4)

    def run():
        net = seeded(DropMLP)()
        flag(net, policy)
        tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
        out = []
        try:
            for k, xs in enumerate(batches):
                mx.random.seed(7 + k)
                out += step(net, tr, xs, fn=lambda x: sq(noisy(net, x)))
            return out + params_of(net)
        finally:
            cleanup()
            net.hybridize(active=False)

    first, second = run(), run()
    for i, (a, b) in enumerate(zip(first, second)):
        np.testing.assert_array_equal(a, b, err_msg="value %d" % i)


@POLICY
def test_merged_dropout_masks_are_per_sample_and_their_gradients_follow_them(policy):
    """``nd.Dropout`` of each sample's output (merged under 'depth' and
    'agenda'): every sample gets its own mask (not one shared), kept entries
    are scaled by 1/(1-p), and the gradients are those of plain Gluon with
    the masks the flagged forward drew (the backward reuses its mask)."""
    xs = samples("masks", n=6)
    rate = 0.5

    def run(net, masks):
        with autograd.record():
            ys = [net(x) for x in xs]
            if masks is None:
                zs = [nd.Dropout(y, p=rate) for y in ys]
            else:
                zs = [y * nd.array(m) / (1 - rate) for y, m in zip(ys, masks)]
            losses = [sq(z * nd.arange(16).reshape((1, 16))) for z in zs]
        autograd.backward(losses)
        return [y.asnumpy() for y in ys], [z.asnumpy() for z in zs], grads_of(net)

    make = seeded(MLP, n_out=16)
    net = make()
    flag(net, policy)
    jitbatch.reset_stats()
    try:
        mx.random.seed(3)
        ys, zs, grads = run(net, None)
        st = jitbatch.stats()
    finally:
        cleanup()
        net.hybridize(active=False)
    if policy in MERGING:
        assert st["launches"] * len(xs) == st["nodes"], st    # each kind of call in one launch
    masks = [(z != 0).astype("float32") for z in zs]
    for y, z, m in zip(ys, zs, masks):
        np.testing.assert_allclose(z, y * m / (1 - rate), rtol=1e-5, atol=1e-6)
    assert len({m.tobytes() for m in masks}) == len(masks), "samples share a mask"
    kept = np.mean(masks)
    assert 0.25 < kept < 0.75, kept
    _, _, want = run(make(), masks)
    same(want, grads, "gradient")


# -- 7. deferred initialization: the first calls pending ----------------------------------
def deferred_net():
    """The Gluon default: no ``in_units``, shapes (and the initializer's
    draws) at the first call."""
    mx.random.seed(0)
    net = nn.HybridSequential(prefix="lazy_")
    with net.name_scope():
        net.add(nn.Dense(5, activation="tanh"), nn.Dense(3))
    net.initialize(mx.init.Uniform(0.5))
    return net


def donor_file(tmp_path):
    """A file of other values for ``deferred_net`` (a trained model)."""
    mx.random.seed(7)
    donor = nn.HybridSequential(prefix="lazy_")
    with donor.name_scope():
        donor.add(nn.Dense(5, activation="tanh", in_units=4), nn.Dense(3, in_units=5))
    donor.initialize(mx.init.Uniform(1.0))
    path = str(tmp_path / "donor.params")
    donor.save_parameters(path)
    return path


@POLICY
def test_load_parameters_while_the_first_calls_of_a_deferred_net_pend(policy, tmp_path):
    """A model made (no ``in_units``), called on a first minibatch, then its
    trained weights loaded before the outputs are read: the next calls must
    use the loaded weights. Until 2026-11-26 they used the initializer's
    random weights, silently (the launch that _load_init's _init_grad ran
    finished the deferred initialization over the loaded values)."""
    xs = samples("deferred-load")
    path = donor_file(tmp_path)

    def program(net, p):
        flag(net, p)
        first = [net(x) for x in xs]
        net.load_parameters(path)
        return ([y.asnumpy() for y in first + [net(x) for x in xs]] + params_of(net)
                + [a.asnumpy() for _, a in sorted(nd.load(path).items())])

    want, got, _ = both(deferred_net, program, policy)
    same(want, got, "output or parameter")


@POLICY
def test_load_parameters_into_a_deferred_flagged_net_before_and_after_its_first_read(
        policy, tmp_path):
    """The same model loaded before its first call, and loaded again after
    its first outputs were read: plain Gluon's numbers."""
    xs = samples("deferred-load-ok")
    path = donor_file(tmp_path)

    def program(nets, p):
        net, other = nets
        flag(net, p)
        net.load_parameters(path)
        out = [net(x).asnumpy() for x in xs] + params_of(net)
        flag(other, p)
        first = [other(x) for x in xs]
        out += [y.asnumpy() for y in first]
        other.load_parameters(path)
        return out + [other(x).asnumpy() for x in xs] + params_of(other)

    want, got, st = both(lambda: [deferred_net(), deferred_net()], program, policy)
    same(want, got, "output or parameter")
    if policy in MERGING:
        assert merged(st), st


@POLICY
def test_force_reinit_while_the_first_calls_of_a_deferred_net_pend(policy):
    """Until 2026-11-26 the pending predictions used the new initializer's
    values, silently."""
    xs = samples("deferred-reinit")

    def program(net, p):
        flag(net, p)
        first = [net(x) for x in xs]
        net.initialize(mx.init.Constant(0.1), force_reinit=True)
        return [y.asnumpy() for y in first + [net(x) for x in xs]] + params_of(net)

    want, got, _ = both(deferred_net, program, policy)
    same(want, got, "output or parameter")


@POLICY
def test_seeded_random_inputs_drawn_between_the_first_calls_of_a_deferred_net(policy):
    """``mx.random.seed``, then per sample an input drawn with
    ``nd.random.normal`` and the net called (a synthetic-data smoke run):
    plain Gluon's inputs, outputs and weights. Until 2026-11-26 the
    initializer drew at the flush: other inputs and weights, silently."""
    def program(net, p):
        flag(net, p)
        mx.random.seed(11)
        xs = [nd.random.normal(shape=(1, 4)) for _ in range(1)]
        ys = [net(xs[0])]
        for _ in range(3):
            xs.append(nd.random.normal(shape=(1, 4)))
            ys.append(net(xs[-1]))
        return [a.asnumpy() for a in xs + ys] + params_of(net)

    want, got, _ = both(deferred_net, program, policy)
    same(want, got, "input, output or parameter")



class Branchy(gluon.Block):
    """Per-sample structure: even samples go through an encoder and a long
    head, odd ones through a short head; every layer deferred (no
    ``in_units``)."""

    def __init__(self, **kw):
        super(Branchy, self).__init__(**kw)
        with self.name_scope():
            self.enc = nn.Dense(4, activation="tanh")
            self.long = nn.Dense(3)
            self.short = nn.Dense(3)

    def forward(self, x, i):
        return self.long(self.enc(x)) if i % 2 == 0 else self.short(x)


def branchy():
    mx.random.seed(0)
    net = Branchy(prefix="branchy_")
    net.initialize(mx.init.Uniform(0.5))
    return net


@pytest.mark.parametrize("policy", ["depth"])
def test_one_seed_gives_plain_gluons_initial_weights_to_a_deferred_net_with_branches(policy):
    """Sample 0 calls ``enc`` then ``long``, sample 1 ``short``: plain Gluon
    initializes enc, long, short in that order (each at its first call);
    under 'depth' ``short`` launches on the first level, with ``enc``, and is
    initialized before ``long`` draws. ('auto', 'agenda' and 'sequential'
    happen to launch in call order here.) Trained two steps. Until
    2026-11-26 ``short`` got plain Gluon's ``long`` weights, silently."""
    xs = samples("branchy", n=4)

    def program(net, p):
        flag(net, p)
        ys = [net(x, i) for i, x in enumerate(xs)]
        out = [y.asnumpy() for y in ys]
        tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.2})
        for _ in range(2):
            with autograd.record():
                losses = [sq(net(x, i)) for i, x in enumerate(xs)]
            autograd.backward(losses)
            tr.step(len(xs))
            out += [l.asnumpy() for l in losses]
        return out + params_of(net)

    want, got, _ = both(branchy, program, policy)
    same(want, got, "output, loss or parameter")


@POLICY
def test_a_branchy_net_with_in_units_given_is_plain_gluons(policy):
    """The same program with every layer's ``in_units`` given: the same
    initial weights whatever the launch order."""
    xs = samples("branchy-given", n=4)

    def make():
        mx.random.seed(0)
        net = Branchy(prefix="given_")
        for blk, n_in in ((net.enc, 4), (net.long, 4), (net.short, 4)):
            blk.weight.shape = (blk.weight.shape[0], n_in)
        net.initialize(mx.init.Uniform(0.5))
        return net

    def program(net, p):
        flag(net, p)
        return [y.asnumpy() for y in [net(x, i) for i, x in enumerate(xs)]] + params_of(net)

    want, got, st = both(make, program, policy)
    same(want, got, "output or parameter")
    if policy in MERGING:
        assert merged(st), st

def _save(net, tmp):
    net.save_parameters(os.path.join(tmp, "saved.params"))
    return sorted(nd.load(os.path.join(tmp, "saved.params")).items())


def _collect_save(net, tmp):
    net.collect_params().save(os.path.join(tmp, "collected.params"), strip_prefix="lazy_")
    return sorted(nd.load(os.path.join(tmp, "collected.params")).items())


def _data(net, tmp):
    return [("weight", net[0].weight.data()), ("grad", net[0].weight.grad())]


def _deepcopy(net, tmp):
    return [("copy", copy.deepcopy(net)[1].weight.data())]


def _pickle(net, tmp):
    return [("pickle", pickle.loads(pickle.dumps(net))[1].weight.data())]


def _cast(net, tmp):
    net.cast("float64")
    return [("float64", net(nd.ones((1, 4), dtype="float64")))]


def _reset_ctx(net, tmp):
    net.collect_params().reset_ctx(mx.cpu(1))
    return [("cpu1", net(nd.ones((1, 4), ctx=mx.cpu(1))))]


PARAMETER_API = {"save_parameters": _save, "collect_params_save": _collect_save,
                 "param_data": _data, "deepcopy": _deepcopy, "pickle": _pickle,
                 "cast_float64": _cast, "reset_ctx": _reset_ctx}


@pytest.mark.parametrize("act", sorted(PARAMETER_API))
def test_the_parameter_api_right_after_the_first_calls_of_a_deferred_net(act, tmp_path):
    """What a user does after a first forward (plain Gluon: the parameters
    exist): save, print a weight, copy the model, cast it, move it; then the
    first outputs read. Until 2026-11-26 the first five raised
    DeferredInitializationError and the last two failed the pending launch."""
    xs = samples("deferred-api-" + act)

    def program(net, p):
        flag(net, p)
        first = [net(x) for x in xs]
        got = PARAMETER_API[act](net, str(tmp_path))
        return [a.asnumpy() for _, a in got] + [k for k, _ in got] + \
            [y.asnumpy() for y in first]

    want, got, _ = both(deferred_net, program, "auto")
    same(want, got, "value")


@pytest.mark.parametrize("policy", ["auto", "depth"])
def test_a_deferred_net_after_its_first_read_saves_copies_and_casts(policy, tmp_path):
    """The same calls after the first outputs were read: plain Gluon's."""
    xs = samples("deferred-after-read")

    def program(net, p):
        flag(net, p)
        out = [y.asnumpy() for y in [net(x) for x in xs]]
        preds = [net(x) for x in xs]
        for act in ("save_parameters", "collect_params_save", "param_data", "deepcopy",
                    "pickle", "cast_float64"):
            out += [a.asnumpy() for _, a in PARAMETER_API[act](net, str(tmp_path))]
        return out + [y.asnumpy() for y in preds]

    want, got, _ = both(deferred_net, program, policy)
    same(want, got, "value")


class _CellStep(HybridBlock):
    """A GRU cell without ``input_size``, one step from a zero state."""

    def __init__(self, **kw):
        super(_CellStep, self).__init__(**kw)
        with self.name_scope():
            self.cell = rnn.GRUCell(5)

    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        return self.cell(x, [F.zeros_like(F.slice_axis(x, axis=1, begin=0, end=1)).tile(
            (1, 5))])[0]


def _deferred_layer(kind):
    """A model of ``kind`` whose every layer defers its shapes (Gluon's
    default), and per-sample inputs for it."""
    mx.random.seed(3)
    rng = rng_for("deferred-layer", kind)
    if kind == "conv_bn":
        net = nn.HybridSequential(prefix="dconv_")
        with net.name_scope():
            net.add(nn.Conv2D(3, 3, padding=1), nn.BatchNorm(), nn.Activation("relu"),
                    nn.GlobalAvgPool2D(), nn.Dense(2))
        xs = [nd.array(rng.normal(size=(1, 2, 5, 5))) for _ in range(4)]
    elif kind == "gru_cell":
        net = _CellStep(prefix="dcell_")
        xs = [nd.array(rng.normal(size=(1, 4))) for _ in range(4)]
    elif kind == "fused_gru":
        net = rnn.GRU(5, layout="NTC", prefix="dgru_")
        xs = [nd.array(rng.normal(size=(1, int(rng.integers(2, 5)), 4))) for _ in range(4)]
    else:                                               # layer_norm
        net = nn.HybridSequential(prefix="dln_")
        with net.name_scope():
            net.add(nn.Dense(6, flatten=False), nn.LayerNorm(), nn.Dense(2, flatten=False))
        xs = [nd.array(rng.normal(size=(1, 3, 4))) for _ in range(4)]
    net.initialize(mx.init.Uniform(0.5))
    return net, xs


@pytest.mark.parametrize("mapped", [False, True], ids=["loop", "map"])
@pytest.mark.parametrize("policy", ["auto", "depth"])
@pytest.mark.parametrize("kind", ["conv_bn", "gru_cell", "fused_gru", "layer_norm"])
def test_deferred_layers_are_initialized_at_the_first_call_as_plain_gluon(
        kind, policy, mapped):
    """Convolution with BatchNorm, a GRU cell, a fused GRU layer (NTC) and
    LayerNorm, none told its input size: right after the first calls (still
    pending) every parameter exists with plain Gluon's values (the same seed,
    drawn at the first call), a seeded draw after the calls is plain
    Gluon's, and the outputs and a training step's parameters are too. Also
    with the first calls made by ``jitbatch.map``: its samples ran in pool
    threads, whose MXNet generators are their own, and the initializer had
    to run in the caller's thread, as in the loop; they are greenlets on the
    caller's thread now (``gluon/interleave.py``)."""
    def program(flagged):
        net, xs = _deferred_layer(kind)
        if flagged:
            flag(net, policy)
        if flagged and mapped:
            first = jitbatch.map(net, xs[:2])    # (two maps: two items each)
            first += jitbatch.map(net, xs[2:])
            noise = nd.random.uniform(shape=(1, 3))   # the caller's stream, untouched
        else:
            first = [net(xs[0])]
            first += [net(x) for x in xs[1:]]
            noise = nd.random.uniform(shape=(1, 3))   # drawn after the initializer
        init = [p.data().asnumpy() for _, p in sorted(net.collect_params().items())]
        tr = gluon.Trainer(net.collect_params(), "sgd", {"learning_rate": 0.1})
        with autograd.record():
            losses = [sq(net(x)) for x in xs]
        autograd.backward(losses)
        tr.step(len(xs))
        return (init + [noise.asnumpy()] + [y.asnumpy() for y in first] +
                [l.asnumpy() for l in losses] + params_of(net))

    want = program(False)
    got = program(True)
    same(want, got, "initial parameter, draw, output, loss or parameter")
