"""Held-out programs, round 40: lazy values SHARED and KEPT by Python code
(memoization, caches, structure sharing), written as users write them, each
checked against plain per-sample Gluon.

* A DAG of subtrees shared by samples, encoded by a binary Tree-LSTM with a
  dict memo node -> (h, c): one subtree's state used by several samples'
  parents (and twice by one parent); the memo per minibatch, kept across
  three minibatches (each a new ``autograd.record``: in plain Gluon a state
  every loss reached is a constant in the next minibatch, its graph freed),
  kept across gradient-accumulation micro-batches (``grad_req='add'``);
  filled in an evaluation pass before training (pending over a Trainer
  step), or under ``autograd.pause()`` and read after the step; launch
  counts of the memoized DAG under 'depth' and 'agenda'.
* A word -> state cache (Embedding + Dense per word, a GRU per sentence):
  a dict per minibatch or kept, ``dict.setdefault`` (an unused call per
  cached use), ``functools.lru_cache`` on a method calling the flagged
  block (kept; 3 entries, evicting while the graph pends); states of an
  unlabelled sentence (recorded, left out of the loss) or of a sentence
  skipped after a KeyError, reused in the next minibatch (a finding), the
  same with ``retain_graph=True``; a minibatch's loss on outputs recorded
  in the previous one and left out of its loss (the documented
  NotDifferentiableError, its fix, the next minibatch).
* One lazy array used several times: ``cell(h, [h])``, ``block(h, h)``,
  ``nd.add_n(h, h, h)``, ``h + h * h``, ``concat`` of it with itself along
  axes 1 and 0 (one row gathered twice into a flagged block), ``stack``,
  two different blocks; a learned initial state computed once per
  minibatch for every sample's GRU; composites (``concat(dim=0)``,
  ``stack(axis=1)``, a slice of a concat) cached and fed again in later
  minibatches.
* A lazy output through ``detach()``, ``copy()``, ``as_in_context`` of its
  own context and ``astype(copy=False)`` (the same object, as in MXNet),
  ``astype`` of its own dtype, a copy written in place after the backward;
  kept in lists mutated before the loss (``append``, item replaced,
  ``reverse``, ``pop``, ``del`` of a slice, ``sort`` by a read value,
  ``[h] * 3``).
* Lazy states as attributes of ``Node`` objects: ``is`` checks, dicts keyed
  by lazy arrays and sets of them (identity hashing), before and after the
  backward; children sorted by a read value before composing; the Node
  objects pickled or deep-copied while their states pend, the copies
  seeding the next minibatch's memo. Python protocols on ``(1, 1)`` lazy
  scores: ``in`` (value equality), ``list.index``/``count``, ``max``,
  ``sorted``, ``if score > 0``.
* Generators: a ``yield``-based post-order traversal calling the flagged
  blocks inside the generator, consumed partially (``islice``), a value
  read, then the rest; several generators advanced round-robin; generators
  abandoned half-way.
* Owners going away while the graph pends: lists and the memo deleted,
  ``gc.collect()`` between the record and the read, a state owned only by a
  closure, a ``weakref.WeakValueDictionary`` of Node objects as the cache,
  memo entries popped once used.
* Exceptions while the shared structure is built: a KeyError (a word the
  vocabulary lacks) half-way through a sentence and MXNet's error for a
  malformed row at a flagged call, after the cache was filled by good
  sentences, caught per sample or leaving the recording (the minibatch
  dropped without a backward, its cached states reused by the next one:
  in plain Gluon they keep their graph); a recursive tree encoder with a
  memo whose forward fails on a missing child after memoizing subtrees:
  the encoder a flagged ``Block`` (a finding), only its cells flagged, or
  under ``jitbatch.map``.

The oracle is plain per-sample Gluon (no hybridize) on the same parameters and
inputs: outputs, gradients and parameters after two or three Trainer steps,
under the policies auto, depth, agenda and sequential. Launch counts are
asserted under 'depth' and 'agenda' only.

Not run (plain Gluon / MXNet itself is no oracle there): ``weakref.ref`` of a
lazy array (plain ``NDArray`` refuses weak references, ``LazyArray``
accepts them; only Node objects are weakly referenced here); a copy written
in place under ``autograd.pause()`` between its recorded use and the
backward (plain MXNet's backward reads the written value: a gradient of no
forward; jitbatch's launch read its rows at the call); states left out of
one minibatch's loss that share a subtree or a leaf input with states it
reached (plain MXNet's next backward fails: "The any container is empty
requested=...AGInfo", the first backward cleared the shared nodes); a weak
cache whose Node objects were also held by a recursive closure (what
survives depends on when Python's cyclic GC runs, plain Gluon too).

Findings (strict expected failures; docs/errors.rst, Known differences):

* A state recorded in one minibatch and left out of its loss (an unlabelled
  sentence's word states, the words of a sentence skipped after a
  KeyError), kept in a cache and used in the next minibatch together with
  new calls: plain Gluon differentiates it through its own recorded graph
  (no backward reached it), so the next backward reaches the word encoder
  through it. Merged, its rows are in a launch shared with the reached
  samples, which the first ``backward()`` (``retain_graph=False``) freed:
  silently a constant; the embedding rows of those words got zero
  gradient (0.07 off) and the parameters drifted from plain Gluon's. Under
  'auto', 'depth' and 'agenda' ('sequential' is right). Alone in the loss
  the same case is the documented NotDifferentiableError; with
  ``retain_graph=True`` on the first backward it is right. Since
  2026-11-26 its use in the next recording was that NotDifferentiableError
  (``gluon/history.py``), no longer silent. Fixed 2026-11-27: the calls a
  backward reaches run as a flush of their own, the others after it
  (``history.run_apart``), so the left-out states keep their own launch and
  record, and the next minibatch's backward reaches the encoder through
  them, as per sample.
* A flagged ``Block`` (a recursive tree encoder with a memo) whose forward
  raises after nested calls completed and memoized subtree states: the
  failed call's nodes are dropped (``patch._call`` ->
  ``Graph.discard_since``), those of the completed nested calls included,
  while the memo still holds their states; a later sample using one fails
  at the flush, the whole minibatch with it: an ``ExecutionError`` wrapping
  "AttributeError: 'NoneType' object has no attribute 'outs'" ('depth',
  'sequential'), a bare ``AssertionError`` "agenda scheduling lost nodes (a
  cycle in the graph?)" from ``schedule.py`` ('agenda'; 'auto' either).
  Plain Gluon trains (the memoized states are valid values). The same
  program with only the cells flagged, or under ``jitbatch.map``, is right.
  Since 2026-11-26 the call given a dropped value raises a StaleValueError
  naming the failed call's error and the fix, at its record
  (``Graph._link``), and nothing is lost
  (``test_a_value_dropped_with_a_failed_call_is_a_clear_error_at_its_use``);
  the values are still not plain Gluon's.
"""
import copy
import functools
import gc
import itertools
import pickle
import weakref

import numpy as np
import pytest
from mxnet import autograd, gluon, nd
from mxnet.base import MXNetError
from mxnet.gluon import HybridBlock, nn

import jitbatch
from heldout import initialized as init
from heldout import (both, error_of, flag, flag_all, grads_of, merged,  # noqa: F401
                     nothing_pending, params_dict, params_of, rng_for, same_values as same)

POLICIES = ["auto", "depth", "agenda", "sequential"]
POLICY = pytest.mark.parametrize("policy", POLICIES)
#: the policies whose launches are planned from the graph alone
MERGING = ["depth", "agenda"]
H = 5
F = 3


# -- models ------------------------------------------------------------------------------
class Leaf(HybridBlock):
    """A leaf's (h, c) from its (1, F) features."""

    def __init__(self, **kw):
        super().__init__(**kw)
        with self.name_scope():
            self.proj = nn.Dense(2 * H, in_units=F)

    def hybrid_forward(self, F_, x):
        z = self.proj(x)
        c = F_.slice_axis(z, axis=1, begin=0, end=H)
        o = F_.slice_axis(z, axis=1, begin=H, end=2 * H)
        return F_.sigmoid(o) * F_.tanh(c), c


class Compose(HybridBlock):
    """A binary Tree-LSTM cell: (hl, cl, hr, cr) -> (h, c)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        with self.name_scope():
            self.gates = nn.Dense(5 * H, in_units=2 * H)

    def hybrid_forward(self, F_, hl, cl, hr, cr):
        z = self.gates(F_.concat(hl, hr, dim=1))
        i, fl, fr, o, u = F_.split(z, num_outputs=5, axis=1)
        c = F_.sigmoid(i) * F_.tanh(u) + F_.sigmoid(fl) * cl + F_.sigmoid(fr) * cr
        return F_.sigmoid(o) * F_.tanh(c), c


def tree_nets(prefix="t"):
    """A maker of [leaf, compose, head] (the same initial values every call)."""
    def make():
        return [init(Leaf(prefix=prefix + "leaf_"), 1), init(Compose(prefix=prefix + "comp_"), 2),
                init(nn.Dense(2, in_units=H, prefix=prefix + "head_"), 3)]
    return make


#: a DAG of subtrees shared by samples: a leaf is its feature row's index, an
#: inner node its (left, right) children
LEAVES = 8
DAG = {8: (0, 1), 9: (2, 3), 10: (8, 9), 11: (8, 4), 12: (10, 5), 13: (11, 9), 14: (4, 5),
       15: (14, 8), 16: (6, 7), 17: (16, 10), 18: (13, 16), 19: (12, 12), 20: (9, 9)}
_RNG = rng_for("round40/dag")
FEATS = [nd.array(_RNG.normal(size=(1, F))) for _ in range(LEAVES)]
TARGETS = {n: nd.array(_RNG.normal(size=(1, 2))) for n in list(range(24))}
#: the roots of three minibatches (subtrees shared inside and across them)
MINIBATCHES = [[10, 11, 12, 13], [15, 12, 17, 19], [18, 14, 10, 20]]


def state(node, memo, leaf, comp):
    """The (h, c) of ``node``, memoized in ``memo`` (a dict node -> state)."""
    if node in memo:
        return memo[node]
    if node < LEAVES:
        st = leaf(FEATS[node])
    else:
        l, r = DAG[node]
        hl, cl = state(l, memo, leaf, comp)
        hr, cr = state(r, memo, leaf, comp)
        st = comp(hl, cl, hr, cr)
    memo[node] = st
    return st


def root_loss(head, node, h):
    return nd.sum(nd.square(head(h) - TARGETS[node]))


def trainer(nets, lr=0.1, optimizer="sgd"):
    return gluon.Trainer(params_dict(*nets), optimizer, {"learning_rate": lr})


# -- 1. a DAG memo inside one minibatch and across minibatches ---------------------------
@pytest.mark.parametrize("scope", ["minibatch", "kept", "kept-accumulated"])
@POLICY
def test_dag_memo_trained(policy, scope):
    """Samples share subtrees: a dict node -> (h, c) memoizes the states, one
    subtree's state used by several samples' parents (and twice by one
    parent: node 19 = (12, 12)). ``kept``: the dict lives across the three
    minibatches, each with a new ``autograd.record``: a state computed in
    minibatch 1 (every one reached by its loss, so its graph freed by that
    backward) is a constant in minibatch 2, in plain Gluon; three SGD steps.
    ``kept-accumulated``: the three minibatches are micro-batches whose
    gradients add up (``grad_req='add'``) with the memo kept across them,
    then one step, ``zero_grad``, a new memo, and the three again. Losses,
    gradients and parameters."""
    def program(nets, p):
        leaf, comp, head = nets
        flag_all(nets, p)
        tr = trainer(nets)
        if scope == "kept-accumulated":
            for net in nets:
                net.collect_params().setattr("grad_req", "add")
                net.collect_params().zero_grad()
        memo, out = {}, []
        for roots in (MINIBATCHES * 2 if scope == "kept-accumulated" else MINIBATCHES):
            if scope == "minibatch":
                memo = {}
            with autograd.record():
                ls = [root_loss(head, r, state(r, memo, leaf, comp)[0]) for r in roots]
                loss = nd.add_n(*ls)
            loss.backward()
            out += [l.asnumpy() for l in ls] + grads_of(*nets)
            if scope != "kept-accumulated":
                tr.step(len(roots), ignore_stale_grad=True)
            elif roots is MINIBATCHES[-1]:
                tr.step(12)
                memo = {}
                for net in nets:
                    net.collect_params().zero_grad()
        return out + params_of(*nets)

    want, got, st = both(tree_nets(), program, policy)
    same(want, got, "DAG memo (%s) under %s" % (scope, policy))
    if policy in MERGING:
        assert merged(st), st


@pytest.mark.parametrize("policy", MERGING)
def test_dag_memo_runs_each_shared_subtree_once(policy):
    """Under the planned policies each memoized subtree is one recorded call
    (no recomputation), and the leaves merge into one launch."""
    leaf, comp, head = tree_nets()()
    flag_all([leaf, comp, head], policy)
    memo = {}
    jitbatch.reset_stats()
    ys = [head(state(r, memo, leaf, comp)[0]) for r in MINIBATCHES[0]]
    jitbatch.flush()
    st = jitbatch.stats()
    nodes_in_trees = len(memo)
    assert sum(1 for n in memo if n < LEAVES) == 6
    # 6 leaves, 6 inner nodes (8, 9, 10, 11, 12, 13), 4 heads: 16 calls
    assert nodes_in_trees == 12 and st["nodes"] == 16, st
    # leaves: 1 launch; inner nodes by depth: {8, 9}, {10, 11}, {12, 13}; the heads
    # of roots 10, 11 (depth 3) and 12, 13 (depth 4): two launches under 'depth', one
    # under 'agenda'
    assert st["launches"] == {"depth": 6, "agenda": 5}[policy], st
    for y in ys:
        assert y.shape == (1, 2)


@POLICY
def test_memo_filled_in_evaluation_then_used_in_training(policy):
    """The memo is filled in an evaluation pass (no recording, never read)
    before training: the training minibatches use those states as constants
    and compute the rest. A Trainer step while the evaluation's states are
    still pending must not change them (they were called with the old
    parameters)."""
    def program(nets, p):
        leaf, comp, head = nets
        flag_all(nets, p)
        tr = trainer(nets)
        memo, out = {}, []
        evals = [state(r, memo, leaf, comp)[0] for r in (10, 14)]
        for roots in MINIBATCHES[1:]:
            with autograd.record():
                ls = [root_loss(head, r, state(r, memo, leaf, comp)[0]) for r in roots]
                loss = nd.add_n(*ls)
            loss.backward()
            out += [l.asnumpy() for l in ls] + grads_of(*nets)
            tr.step(len(roots), ignore_stale_grad=True)
        return out + [e.asnumpy() for e in evals] + params_of(*nets)

    want, got, _ = both(tree_nets(), program, policy)
    same(want, got, "evaluation memo under %s" % policy)


@POLICY
def test_memo_filled_before_a_step_and_read_after_it(policy):
    """States memoized under ``autograd.pause()`` inside the recording (a
    teacher-forcing cache), the minibatch trained and stepped, then the
    cached states read: plain Gluon's values from the parameters before the
    step."""
    def program(nets, p):
        leaf, comp, head = nets
        flag_all(nets, p)
        tr = trainer(nets)
        memo, out = {}, []
        with autograd.record():
            with autograd.pause():
                cached = [state(r, memo, leaf, comp) for r in (16, 14)]
            ls = [root_loss(head, r, state(r, {}, leaf, comp)[0]) for r in (10, 12)]
            loss = nd.add_n(*ls)
        loss.backward()
        tr.step(2)
        out += [a.asnumpy() for st in cached for a in st]
        with autograd.record():
            ls = [root_loss(head, r, state(r, memo, leaf, comp)[0]) for r in (17, 15)]
            loss = nd.add_n(*ls)
        loss.backward()
        out += [l.asnumpy() for l in ls] + grads_of(*nets)
        return out + params_of(*nets)

    want, got, _ = both(tree_nets(), program, policy)
    same(want, got, "paused memo under %s" % policy)


# -- 2. a word -> state cache --------------------------------------------------------------
VOCAB = 12


class WordEnc(HybridBlock):
    """A word's state: its embedding through a tanh layer."""

    def __init__(self, **kw):
        super().__init__(**kw)
        with self.name_scope():
            self.emb = nn.Embedding(VOCAB, 6)
            self.proj = nn.Dense(H, in_units=6, activation="tanh")

    def hybrid_forward(self, F_, w):
        return self.proj(self.emb(w))


def word_nets(prefix="w"):
    def make():
        return [init(WordEnc(prefix=prefix + "enc_"), 4),
                init(gluon.rnn.GRUCell(H, input_size=H, prefix=prefix + "cell_"), 5),
                init(nn.Dense(2, in_units=H, prefix=prefix + "head_"), 6)]
    return make


_WRNG = rng_for("round40/words")
#: three minibatches of sentences (word ids), words repeated inside and across them
SENTENCES = [[[1, 2, 3, 2], [3, 4], [2, 5, 1]],
             [[1, 6, 2], [7, 3, 3, 4], [5, 5]],
             [[8, 1, 7], [2, 9], [6, 4, 10, 1]]]
SENT_TARGETS = [[nd.array(_WRNG.normal(size=(1, 2))) for _ in mb] for mb in SENTENCES]


def sentence(words, lookup, cell):
    """A GRU over the words' states (``lookup(w)``): the last state."""
    h = nd.zeros((1, H))
    for w in words:
        _, (h,) = cell(lookup(w), [h])
    return h


class CachedEncoder(object):
    """The user's word cache: ``functools.lru_cache`` on a method that calls
    the flagged word encoder."""

    def __init__(self, enc, maxsize):
        self.enc = enc
        self.state = functools.lru_cache(maxsize=maxsize)(self._state)

    def _state(self, w):
        return self.enc(nd.array([[w]]))


def dict_lookup(enc, cache):
    def lookup(w):
        if w not in cache:
            cache[w] = enc(nd.array([[w]]))
        return cache[w]
    return lookup


def setdefault_lookup(enc, cache):
    """The naive cache: ``setdefault`` calls the encoder at every use (an
    unused recorded call when the word is cached already)."""
    return lambda w: cache.setdefault(w, enc(nd.array([[w]])))


@pytest.mark.parametrize("cache", ["dict-per-minibatch", "dict-kept", "setdefault-kept",
                                   "lru-kept", "lru-small"])
@POLICY
def test_word_state_cache_trained(policy, cache):
    """A word's state is computed on its first use and kept in a cache
    (a dict; ``dict.setdefault``, which calls the encoder at every use and
    drops the new value of a cached word; ``functools.lru_cache`` on a
    method, ``lru-small`` holding 3 words, so entries are evicted and
    recomputed while the graph pends),
    reused by later words of the same sentence, other sentences of the
    minibatch and (``kept``) later minibatches. Three SGD steps."""
    def program(nets, p):
        enc, cell, head = nets
        flag_all(nets, p)
        tr = trainer(nets)
        out, store = [], {}
        cached = CachedEncoder(enc, 3 if cache == "lru-small" else None)
        for sents, targets in zip(SENTENCES, SENT_TARGETS):
            if cache == "dict-per-minibatch":
                store = {}
            lookup = dict_lookup(enc, store) if cache.startswith("dict") else \
                setdefault_lookup(enc, store) if cache == "setdefault-kept" else cached.state
            with autograd.record():
                ls = [nd.sum(nd.square(head(sentence(s, lookup, cell)) - t))
                      for s, t in zip(sents, targets)]
                loss = nd.add_n(*ls)
            loss.backward()
            out += [l.asnumpy() for l in ls] + grads_of(*nets)
            tr.step(len(sents), ignore_stale_grad=True)
        return out + params_of(*nets)

    want, got, st = both(word_nets(), program, policy)
    same(want, got, "word cache (%s) under %s" % (cache, policy))
    if policy in MERGING:
        assert merged(st), st


@POLICY
def test_word_states_cached_from_an_unlabelled_sentence(policy):
    """Semi-supervised: every sentence of a minibatch is encoded through the
    kept word cache (its prediction logged), only the labelled ones are in
    the loss. The unlabelled sentence of minibatch 1 brings words 11 and 0
    into the cache; in plain Gluon their states keep their own recorded
    graph (nothing of it was freed: no backward reached it), so minibatch
    2's backward reaches the word encoder through them, with minibatch 1's
    inputs. Merged, their rows were in the launch of the labelled sentences'
    words, which minibatch 1's backward freed: silently constants until
    2026-11-26, a NotDifferentiableError until 2026-11-27; now the calls
    minibatch 1's backward reaches run apart from the unlabelled sentence's
    (``history.run_apart``)."""
    batches = [([[1, 2, 3], [3, 4]], [[11, 0, 11]]), ([[0, 2, 5], [11, 4, 1]], [])]

    def program(nets, p):
        enc, cell, head = nets
        flag_all(nets, p)
        tr = trainer(nets)
        out, store = [], {}
        lookup = dict_lookup(enc, store)
        for b, (labelled, unlabelled) in enumerate(batches):
            with autograd.record():
                ls = [nd.sum(nd.square(head(sentence(s, lookup, cell)) - SENT_TARGETS[b][k]))
                      for k, s in enumerate(labelled)]
                logged = [head(sentence(s, lookup, cell)) for s in unlabelled]
                loss = nd.add_n(*ls)
            loss.backward()
            out += [l.asnumpy() for l in ls] + [y.asnumpy() for y in logged] + grads_of(*nets)
            tr.step(len(labelled))
        return out + params_of(*nets)

    want, got, _ = both(word_nets("u"), program, policy)
    same(want, got, "unlabelled words under %s" % policy)


@POLICY
def test_unlabelled_sentences_cached_with_retain_graph(policy):
    """The same semi-supervised program with ``retain_graph=True`` on the
    backward (the fix the NotDifferentiableError names for freed launches):
    every cached state keeps its graph, in plain Gluon and merged; the
    gradients through minibatch 1's states in minibatch 2 are plain Gluon's."""
    batches = [([[1, 2, 3], [3, 4]], [[11, 0, 11]]), ([[0, 2, 5], [11, 4, 1]], [])]

    def program(nets, p):
        enc, cell, head = nets
        flag_all(nets, p)
        tr = trainer(nets)
        out, store = [], {}
        lookup = dict_lookup(enc, store)
        for b, (labelled, unlabelled) in enumerate(batches):
            with autograd.record():
                ls = [nd.sum(nd.square(head(sentence(s, lookup, cell)) - SENT_TARGETS[b][k]))
                      for k, s in enumerate(labelled)]
                logged = [head(sentence(s, lookup, cell)) for s in unlabelled]
                loss = nd.add_n(*ls)
            loss.backward(retain_graph=True)
            out += [l.asnumpy() for l in ls] + [y.asnumpy() for y in logged] + grads_of(*nets)
            tr.step(len(labelled))
        return out + params_of(*nets)

    want, got, _ = both(word_nets("r"), program, policy)
    same(want, got, "unlabelled words, retain_graph, under %s" % policy)


@POLICY
def test_outputs_left_out_of_one_loss_are_the_next_minibatchs_loss(policy):
    """Predictions of four samples recorded; minibatch 1's loss takes two,
    the next ``record``'s loss the other two (kept in a list): plain Gluon
    differentiates them through their own graphs. Until 2026-11-27 merged
    they shared minibatch 1's launch, freed by its backward: a
    NotDifferentiableError naming ``retain_graph=True``. Now the two pairs
    run in launches of their own (``history.run_apart``): plain Gluon's
    gradients with and without ``retain_graph``, and the next minibatch's."""
    xs = [nd.array(r) for r in rng_for("round40/leftout").normal(size=(6, 1, F))]

    def program(net, p, retain):
        flag(net, p)
        with autograd.record():
            ys = [net(x) for x in xs[:4]]
            first = nd.add_n(*[nd.sum(y * y) for y in ys[:2]])
        first.backward(retain_graph=retain)
        out = [net.weight.grad().asnumpy().copy()]

        def second_minibatch():
            with autograd.record():
                second = nd.add_n(*[nd.sum(y * y) for y in ys[2:]])
            second.backward()
        err = error_of(second_minibatch)      # (refused at the use since 2026-11-26)
        if err is not None:
            return out, err
        out.append(net.weight.grad().asnumpy().copy())
        with autograd.record():   # the next minibatch
            third = nd.add_n(*[nd.sum(nd.tanh(net(x))) for x in xs[4:]])
        third.backward()
        return out + [third.asnumpy(), net.weight.grad().asnumpy().copy()], None

    make = lambda: init(nn.Dense(3, in_units=F, prefix="left_"), 7)  # noqa: E731
    want, err = program(make(), None, False)
    assert err is None
    net = make()
    try:
        got, err = program(net, policy, False)
        assert err is None, err
        same(want, got, "left-out outputs under %s" % policy)
        # with retain_graph, and the next minibatch
        want, _ = program(make(), None, True)
        got, err = program(net, policy, True)
        assert err is None, err
        same(want, got, "left-out outputs with retain_graph under %s" % policy)
    finally:
        jitbatch.flush()
        net.hybridize(active=False)


# -- 3. one lazy array in several places ---------------------------------------------------
def cell_nets(prefix="c"):
    def make():
        return [init(gluon.rnn.GRUCell(H, input_size=H, prefix=prefix + "gru_"), 8),
                init(nn.Dense(H, in_units=F, activation="tanh", prefix=prefix + "in_"), 9),
                init(nn.Dense(H, in_units=H, prefix=prefix + "other_"), 10)]
    return make


def samples(key, count=4):
    return [nd.array(r) for r in rng_for("round40/" + key).normal(size=(count, 1, F))]


USES = {"one-call": ["cell(h,[h])", "block(h,h)"],
        "operators": ["add_n(h,h,h)", "h+h*h", "concat-dim1"],
        "structure": ["two-blocks", "concat-dim0", "stack-axis1"]}


@pytest.mark.parametrize("group", sorted(USES))
@POLICY
def test_one_lazy_array_used_several_times(policy, group):
    """One lazy array ``h`` (a flagged block's output) given twice to one
    call (``cell(h, [h])``: the input and the state of a GRU cell; a
    two-input block ``block(h, h)``), to ``nd.add_n(h, h, h)``,
    ``h + h * h``, ``concat(h, h)`` along axis 1; to two different blocks,
    ``concat(h, h)`` along axis 0 (free structure gathering one row twice,
    then a flagged block over both rows), ``stack(h, h, axis=1)``: every
    sample does each use of its group. Gradients add up over the uses; two
    SGD steps."""
    xs = samples("several")

    class Pair(HybridBlock):
        def __init__(self, **kw):
            super().__init__(**kw)
            with self.name_scope():
                self.d = nn.Dense(H, in_units=2 * H)

        def hybrid_forward(self, F_, a, b):
            return self.d(F_.concat(a, F_.tanh(b), dim=1))

    def use_of(use, h, cell, other, pair):
        return {"cell(h,[h])": lambda: cell(h, [h])[0],
                "block(h,h)": lambda: pair(h, h),
                "add_n(h,h,h)": lambda: other(nd.add_n(h, h, h)),
                "h+h*h": lambda: other(h + h * h),
                "concat-dim1": lambda: nd.concat(h, h, dim=1),
                "two-blocks": lambda: other(h) * cell(h, [nd.zeros((1, H))])[0],
                "concat-dim0": lambda: other(nd.concat(h, h, dim=0)),
                "stack-axis1": lambda: other(nd.stack(h, h, axis=1).reshape((2, H)) * 2)}[use]()

    def program(nets, p):
        cell, inp, other, pair = nets
        flag_all(nets, p)
        tr = trainer(nets)
        out = []
        for _ in range(2):
            with autograd.record():
                ys = []
                for x in xs:
                    h = inp(x)
                    ys += [use_of(u, h, cell, other, pair) for u in USES[group]]
                loss = nd.add_n(*[nd.sum(nd.square(y)) for y in ys])
            loss.backward()
            out += [y.asnumpy() for y in ys] + grads_of(*nets)
            tr.step(len(xs), ignore_stale_grad=True)
        return out + params_of(*nets)

    def make():
        return cell_nets()() + [init(Pair(prefix="cpair_"), 11)]

    want, got, st = both(make, program, policy)
    same(want, got, "%s under %s" % (group, policy))
    if policy in MERGING:
        assert merged(st), st


@POLICY
def test_a_shared_initial_state_computed_once_for_every_sample(policy):
    """A learned initial state ``h0 = init_net(ones)`` computed once per
    minibatch (one lazy array) starts every sample's GRU; its gradient is
    the sum over samples and steps. Three SGD steps over ragged sequences."""
    seqs = [nd.array(r) for r in (rng_for("round40/h0").normal(size=(n, H)) for n in (3, 1, 4, 2))]

    def program(nets, p):
        cell, _, start = nets
        flag_all(nets, p)
        tr = trainer(nets)
        out = []
        for _ in range(3):
            with autograd.record():
                h0 = start(nd.ones((1, H)))
                ls = []
                for s in seqs:
                    h = h0
                    for t in range(s.shape[0]):
                        _, (h,) = cell(s[t:t + 1], [h])
                    ls.append(nd.sum(nd.square(h - 0.5)))
                loss = nd.add_n(*ls)
            loss.backward()
            out += [l.asnumpy() for l in ls] + [h0.asnumpy()] + grads_of(cell, start)
            tr.step(len(seqs), ignore_stale_grad=True)
        return out + params_of(cell, start)

    want, got, st = both(cell_nets("h0"), program, policy)
    same(want, got, "shared h0 under %s" % policy)
    if policy in MERGING:
        assert merged(st), st


# -- 4. copies, views and lists of a lazy output --------------------------------------------
@pytest.mark.parametrize("how", ["detach", "copy", "same-object", "astype-same",
                                 "copy-written"])
@POLICY
def test_a_lazy_output_through_a_copy_or_a_view(policy, how):
    """Each sample's ``h = inp(x)`` goes on through ``h.detach()`` (no
    gradient to ``inp`` through that path), ``h.copy()``,
    ``h.as_in_context(h.context)`` or ``astype(..., copy=False)`` (the same
    array, as in MXNet: ``same-object``), ``h.astype('float32')`` (a copy),
    or a copy (``copy-written``) written in place after the backward
    (``c[:] = c * 2``) and used again, unrecorded (the original ``h``
    unchanged); the result is memoized per sample in a dict and used by two
    blocks. Two SGD steps. (Not run: the copy written under
    ``autograd.pause()`` between its recorded use and the backward: plain
    MXNet's backward then reads the written value, a gradient of no
    forward.)"""
    xs = samples("copies", 5)

    def program(nets, p):
        cell, inp, other = nets
        flag_all(nets, p)
        tr = trainer(nets)
        out = []
        for _ in range(2):
            memo = {}
            with autograd.record():
                ys, same_obj, origs = [], [], []
                for k, x in enumerate(xs):
                    h = inp(x)
                    origs.append(h)
                    if how == "detach":
                        v = h.detach()
                    elif how == "copy":
                        v = h.copy()
                    elif how == "same-object":
                        v = h.as_in_context(h.context) if k % 2 else \
                            h.astype("float32", copy=False)
                    elif how == "astype-same":
                        v = h.astype("float32")
                    else:
                        v = h.copy()
                    same_obj.append(v is h)
                    memo[k] = v
                    ys.append(other(memo[k]) + h)
                loss = nd.add_n(*[nd.sum(nd.square(y)) for y in ys])
            loss.backward()
            if how == "copy-written":
                for k in memo:
                    memo[k][:] = memo[k] * 2
                ys = [y + cell(memo[k], [memo[k]])[0] for k, y in enumerate(ys)] + origs
            out += [y.asnumpy() for y in ys] + [memo[k].asnumpy() for k in memo]
            out += [np.array(same_obj)] + grads_of(*nets)
            tr.step(len(xs), ignore_stale_grad=True)
        return out + params_of(*nets)

    want, got, _ = both(cell_nets("cp"), program, policy)
    same(want, got, "%s under %s" % (how, policy))


@POLICY
def test_lazy_outputs_in_lists_mutated_before_the_loss(policy):
    """States kept in Python lists that are mutated while the graph pends
    (``append``, item replaced by a new expression of itself, ``reverse``,
    ``pop``, ``del`` of a slice, ``sort`` by a read value, a list built
    with ``*`` of one element); the loss is built from what is left."""
    xs = samples("lists", 6)

    def program(nets, p):
        cell, inp, other = nets
        flag_all(nets, p)
        tr = trainer(nets)
        out = []
        for _ in range(2):
            with autograd.record():
                hs = [inp(x) for x in xs]
                keep = list(hs)
                keep.append(other(hs[0]))
                keep[1] = keep[1] * 3 + keep[2]
                keep.reverse()
                gone = keep.pop(2)
                del keep[3:5]
                keep.sort(key=lambda a: float(a.sum().asscalar()))
                rep = [hs[4]] * 3
                ys = [cell(a, [b])[0] for a, b in zip(keep, rep + keep)]
                loss = nd.add_n(*[nd.sum(nd.square(y)) for y in ys]) + nd.sum(gone)
            loss.backward()
            out += [y.asnumpy() for y in ys] + grads_of(*nets)
            tr.step(len(xs), ignore_stale_grad=True)
        return out + params_of(*nets)

    want, got, _ = both(cell_nets("ls"), program, policy)
    same(want, got, "mutated lists under %s" % policy)


# -- 5. lazy arrays kept as attributes of Python objects -------------------------------------
class Node(object):
    """The user's tree node: its children and, once encoded, its ``h`` and ``c``."""

    def __init__(self, key, kids=()):
        self.key, self.kids, self.h, self.c = key, list(kids), None, None


def build_nodes(keys):
    """Node objects for the DAG below ``keys``, shared subtrees shared."""
    made = {}
    return [_node(k, made) for k in keys], made


def _node(k, made):
    # (no closure calling itself: that cycle would keep ``made`` alive until a
    # collection, and what a weak cache holds would depend on the GC's timing)
    if k not in made:
        made[k] = Node(k, [_node(c, made) for c in DAG[k]] if k >= LEAVES else ())
    return made[k]


def encode_node(node, leaf, comp, order=None):
    """Post-order encoding into ``node.h``/``node.c`` (a node encoded once);
    ``order``: children ordered by a read value of their states first."""
    if node.h is not None:
        return node
    if not node.kids:
        node.h, node.c = leaf(FEATS[node.key])
        return node
    kids = [encode_node(k, leaf, comp, order) for k in node.kids]
    if order is not None:
        kids = sorted(kids, key=order)
    node.h, node.c = comp(kids[0].h, kids[0].c, kids[1].h, kids[1].c)
    return node


@pytest.mark.parametrize("order", ["as-built", "sorted-by-read-value"])
@POLICY
def test_states_kept_on_node_objects(policy, order):
    """``Node`` objects (shared subtrees shared) get their states as
    attributes; ``is`` tells a node encoded already, a dict keyed by the lazy
    ``h`` (hashed by identity) maps states back to nodes, a set of them
    counts the distinct states; ``sorted-by-read-value``: each node's children
    are ordered by ``h.sum().asscalar()`` (a read inside the recording) before
    composing. Three minibatches, new Node objects each, three SGD steps."""
    def program(nets, p):
        leaf, comp, head = nets
        flag_all(nets, p)
        tr = trainer(nets)
        out = []
        key = None if order == "as-built" else (lambda n: float(n.h.sum().asscalar()))
        for roots in MINIBATCHES:
            tops, made = build_nodes(roots)
            with autograd.record():
                for t in tops:
                    encode_node(t, leaf, comp, key)
                owner = {n.h: n for n in made.values()}
                distinct = set(n.h for n in made.values())
                assert all(owner[n.h] is n for n in made.values())
                assert all(n.h in distinct for n in made.values()) and len(distinct) == len(made)
                ls = [root_loss(head, t.key, t.h) for t in tops]
                loss = nd.add_n(*ls)
            loss.backward()
            assert all(owner[n.h] is n and n.h in distinct for n in made.values())
            out += [l.asnumpy() for l in ls] + grads_of(*nets)
            out.append(np.array(sorted(n.key for n in made.values())))
            tr.step(len(roots), ignore_stale_grad=True)
        return out + params_of(*nets)

    want, got, st = both(tree_nets("n"), program, policy)
    same(want, got, "node objects (%s) under %s" % (order, policy))
    if policy in MERGING:
        assert merged(st), st


@pytest.mark.parametrize("how", ["pickle", "deepcopy"])
@POLICY
def test_node_objects_pickled_with_their_states(policy, how):
    """The encoded Node objects of minibatch 1 (their ``h``/``c`` still
    pending, inside the recording) are pickled (or deep-copied) as a
    checkpoint of the memo; the copies' states are plain arrays of the same
    values. After the step the loaded memo seeds minibatch 2's encoding (its
    states constants) and the original objects are read again."""
    def program(nets, p):
        leaf, comp, head = nets
        flag_all(nets, p)
        tr = trainer(nets)
        tops, made = build_nodes(MINIBATCHES[0])
        with autograd.record():
            for t in tops:
                encode_node(t, leaf, comp)
            blob = pickle.dumps(made) if how == "pickle" else None
            saved = pickle.loads(blob) if how == "pickle" else copy.deepcopy(made)
            ls = [root_loss(head, t.key, t.h) for t in tops]
            loss = nd.add_n(*ls)
        loss.backward()
        tr.step(4)
        out = [l.asnumpy() for l in ls] + grads_of(*nets)
        out += [a.asnumpy() for k in sorted(saved) for a in (saved[k].h, saved[k].c)]
        out.append(np.array([type(saved[k].h) is nd.NDArray for k in sorted(saved)]))
        tops2, made2 = build_nodes(MINIBATCHES[1])
        for k, n in made2.items():
            if k in saved:
                n.h, n.c = saved[k].h, saved[k].c
        with autograd.record():
            for t in tops2:
                encode_node(t, leaf, comp)
            ls = [root_loss(head, t.key, t.h) for t in tops2]
            loss = nd.add_n(*ls)
        loss.backward()
        tr.step(4, ignore_stale_grad=True)
        out += [l.asnumpy() for l in ls] + grads_of(*nets)
        out += [made[k].h.asnumpy() for k in sorted(made)]
        return out + params_of(*nets)

    want, got, _ = both(tree_nets("p"), program, policy)
    same(want, got, "%s of nodes under %s" % (how, policy))


# -- 6. generators yielding lazy values ------------------------------------------------------
def postorder(node, memo, leaf, comp):
    """Yield (key, h) of every node below ``node`` in post-order, computing
    each state (a flagged call) inside the generator when it is reached."""
    if node in memo:
        return
    if node < LEAVES:
        memo[node] = leaf(FEATS[node])
    else:
        for kid in DAG[node]:
            yield from postorder(kid, memo, leaf, comp)
        l, r = DAG[node]
        memo[node] = comp(*memo[l], *memo[r])
    yield node, memo[node][0]


@pytest.mark.parametrize("consume", ["partial-read-rest", "interleaved", "abandoned"])
@POLICY
def test_a_generator_traversal_calling_the_block(policy, consume):
    """A ``yield``-based post-order traversal calls the flagged blocks inside
    the generator. ``partial-read-rest``: the first three states are taken
    with ``islice``, one is read (``asnumpy``), then the rest consumed;
    ``interleaved``: the generators of all roots advanced round-robin
    (``zip_longest``); ``abandoned``: a generator dropped half-way (its
    memoized states used by the next root's traversal). Every yielded state
    goes through the head into the loss; two SGD steps."""
    def program(nets, p):
        leaf, comp, head = nets
        flag_all(nets, p)
        tr = trainer(nets)
        out = []
        for roots in MINIBATCHES[:2]:
            memo = {}
            with autograd.record():
                seen = []
                if consume == "partial-read-rest":
                    for r in roots:
                        g = postorder(r, memo, leaf, comp)
                        first = list(itertools.islice(g, 3))
                        if first:
                            out.append(first[-1][1].asnumpy())
                        seen += first + list(g)
                elif consume == "interleaved":
                    gens = [postorder(r, memo, leaf, comp) for r in roots]
                    for items in itertools.zip_longest(*gens):
                        seen += [i for i in items if i is not None]
                else:
                    for k, r in enumerate(roots):
                        g = postorder(r, memo, leaf, comp)
                        seen += list(itertools.islice(g, 2)) if k % 2 == 0 else list(g)
                        del g
                ls = [nd.sum(nd.square(head(h) - TARGETS[n])) for n, h in seen]
                loss = nd.add_n(*ls)
            loss.backward()
            out += [np.array([n for n, _ in seen])] + [l.asnumpy() for l in ls] + grads_of(*nets)
            tr.step(len(roots), ignore_stale_grad=True)
        return out + params_of(*nets)

    want, got, st = both(tree_nets("g"), program, policy)
    same(want, got, "generator (%s) under %s" % (consume, policy))


# -- 7. owners dropped while the graph pends ----------------------------------------------
@pytest.mark.parametrize("owner", ["del-lists", "gc-collect", "closure", "weak-node-cache",
                                   "dict-popped"])
@POLICY
def test_lazy_values_whose_owners_go_away_while_pending(policy, owner):
    """The memo and the lists holding intermediate states are deleted while
    the graph pends (``del-lists``, ``gc-collect``: ``gc.collect()`` after
    the deletion, between the record and the read); a root's state whose
    only owner is a closure (``closure``: read later through the function);
    a ``weakref.WeakValueDictionary`` of Node objects as the cache (entries
    vanish with their nodes: the next minibatch recomputes them); memo
    entries popped as soon as their parent is composed (``dict-popped``).
    Losses, gradients and parameters after two SGD steps."""
    def program(nets, p):
        leaf, comp, head = nets
        flag_all(nets, p)
        tr = trainer(nets)
        out = []
        weak = weakref.WeakValueDictionary()
        for roots in MINIBATCHES[:2]:
            with autograd.record():
                if owner == "weak-node-cache":
                    tops, made = build_nodes(roots)
                    for t in tops:
                        for k, n in list(made.items()):
                            if k in weak and weak[k].h is not None:
                                n.h, n.c = weak[k].h, weak[k].c
                        encode_node(t, leaf, comp)
                    for k, n in made.items():
                        weak[k] = n
                    hs = [t.h for t in tops]
                    del tops, made, n
                    out.append(np.array(sorted(weak.keys())))
                elif owner == "dict-popped":
                    memo = {}
                    hs = []
                    for r in roots:
                        hs.append(state(r, memo, leaf, comp)[0])
                        for k in [k for k in memo if k < LEAVES]:
                            memo.pop(k)
                else:
                    memo = {}
                    tops = [state(r, memo, leaf, comp) for r in roots]
                    hs = [t[0] for t in tops]
                    if owner == "closure":
                        getters = [(lambda v=h: v) for h in hs]
                        del hs
                    del tops, memo
                    if owner == "gc-collect":
                        gc.collect()
                if owner == "closure":
                    hs = [get() for get in getters]
                ls = [root_loss(head, r, h) for r, h in zip(roots, hs)]
                loss = nd.add_n(*ls)
                del hs
            if owner == "gc-collect":
                gc.collect()
            loss.backward()
            out += [l.asnumpy() for l in ls] + grads_of(*nets)
            tr.step(len(roots), ignore_stale_grad=True)
        return out + params_of(*nets)

    want, got, _ = both(tree_nets("o"), program, policy)
    same(want, got, "owners (%s) under %s" % (owner, policy))


# -- 8. exceptions while the shared structure is built ------------------------------------
#: word lists with words the vocabulary lacks ('?'), or a malformed feature row ('bad')
VOCAB_IDS = {w: i for i, w in enumerate("abcdefghijkl")}
RAW_BATCHES = [["abc", "cb?e", "bad", "bca"], ["dab", "ecd", "b?", "aeb"], ["cde", "abd"]]
RAW_FRESH = [["abc", "jk?", "cda"], ["kj", "bjk", "ab"], ["cab", "kkd"]]


def text_sentence(text, lookup, cell):
    """A GRU over the states of the words of ``text``, each looked up in the
    vocabulary as it is reached (a missing one raises KeyError half-way)."""
    h = nd.zeros((1, H))
    for ch in text:
        _, (h,) = cell(lookup(VOCAB_IDS[ch]), [h])
    return h


@pytest.mark.parametrize("escape", ["caught-per-sample", "minibatch-abandoned"])
@POLICY
def test_bad_samples_after_the_word_cache_was_filled(policy, escape):
    """The kept word cache is filled by good sentences; then a sentence with
    a word the vocabulary lacks raises ``KeyError`` in the user's lookup
    half-way (after caching the words before it), and a malformed feature
    row raises MXNet's error at the flagged block's call. ``caught-per-
    sample``: the loop skips them and trains on the rest (every word the bad
    sentences cached is used by a good one too); ``minibatch-abandoned``:
    the exception leaves the recording, the minibatch is dropped without a
    backward, and the next one reuses what the dropped one cached (in plain
    Gluon those states keep their graph: the next backward reaches the
    encoder through them too). Three minibatches."""
    def program(nets, p):
        enc, cell, head = nets
        flag_all(nets, p)
        tr = trainer(nets)
        out, store = [], {}
        lookup = dict_lookup(enc, store)

        def encode(text):
            if text == "bad":
                enc(nd.ones((1, 2, 2)))          # a malformed row into the flagged block
            return text_sentence(text, lookup, cell)
        for b, texts in enumerate(RAW_BATCHES):
            ls = []
            try:
                with autograd.record():
                    for k, text in enumerate(texts):
                        if escape == "caught-per-sample":
                            try:
                                h = encode(text)
                            except (KeyError, MXNetError):
                                continue
                        else:
                            h = encode(text)
                        ls.append(nd.sum(nd.square(head(h) - SENT_TARGETS[b % 3][k % 3])))
                    loss = nd.add_n(*ls)
            except (KeyError, MXNetError) as e:
                out.append(np.array([b, len(ls)]))
                if isinstance(e, MXNetError):
                    assert "in_units" in str(e) or "shape" in str(e).lower(), e
                continue
            loss.backward()
            out += [l.asnumpy() for l in ls] + grads_of(*nets)
            tr.step(len(ls), ignore_stale_grad=True)
        out.append(np.array(sorted(store)))
        return out + params_of(*nets)

    want, got, st = both(word_nets("x"), program, policy)
    same(want, got, "bad samples (%s) under %s" % (escape, policy))


@POLICY
def test_words_cached_by_a_skipped_sentence_used_by_the_next_minibatch(policy):
    """As above (skipped per sample), but the bad sentence ``jk?`` brings the
    new words ``j`` and ``k`` into the cache before its KeyError, and no
    good sentence of that minibatch uses them: in plain Gluon their states
    keep their graph and minibatch 2's backward reaches the encoder through
    them. Merged with the good sentences' words in minibatch 1's launch,
    freed by its backward, they were constants (the same defect as the
    unlabelled sentence, fixed 2026-11-27 alike)."""
    def program(nets, p):
        enc, cell, head = nets
        flag_all(nets, p)
        tr = trainer(nets)
        out, store = [], {}
        lookup = dict_lookup(enc, store)
        for b, texts in enumerate(RAW_FRESH):
            with autograd.record():
                ls = []
                for k, text in enumerate(texts):
                    try:
                        h = text_sentence(text, lookup, cell)
                    except KeyError:
                        continue
                    ls.append(nd.sum(nd.square(head(h) - SENT_TARGETS[b][k])))
                loss = nd.add_n(*ls)
            loss.backward()
            out += [l.asnumpy() for l in ls] + grads_of(*nets)
            tr.step(len(ls), ignore_stale_grad=True)
        return out + params_of(*nets)

    want, got, _ = both(word_nets("y"), program, policy)
    same(want, got, "words of a skipped sentence under %s" % policy)


class TreeEncoder(gluon.Block):
    """The user's recursive encoder, a ``Block`` flagged as a whole (as the
    README's per-sample models are): ``self(child)`` per child, the states
    memoized in ``self.memo``; ``guard``: a left child that fails is
    replaced by a zero state inside ``forward``."""

    def __init__(self, dag, guard=False, **kw):
        super().__init__(**kw)
        with self.name_scope():
            self.leaf = Leaf()
            self.comp = Compose()
        self.dag, self.guard, self.memo = dag, guard, {}

    def forward(self, node):
        if node in self.memo:
            return self.memo[node]
        if node < LEAVES:
            st = self.leaf(FEATS[node])
        else:
            l, r = self.dag[node]              # KeyError for a node the data lacks
            try:
                hl, cl = self(l)
            except KeyError:
                if not self.guard:
                    raise
                hl = cl = nd.zeros((1, H))
            hr, cr = self(r)
        if node >= LEAVES:
            st = self.comp(hl, cl, hr, cr)
        self.memo[node] = st
        return st


#: node 21's right child is missing (its left child 12 is encoded first);
#: node 22's left child 23 = (5, 30) fails after encoding leaf 5
BAD_DAG = dict(DAG)
BAD_DAG.update({21: (12, 30), 22: (23, 9), 23: (5, 30)})

_DISCARDED = ("a flagged Block whose forward raises drops every node recorded since its call "
              "began (patch._call -> Graph.discard_since), the memoized states of subtrees "
              "its nested calls completed included (documented: docs/errors.rst, Known "
              "differences); a later sample using one gets a StaleValueError at its call "
              "(until 2026-11-26 the flush failed with an internal AttributeError, or "
              "'agenda scheduling lost nodes', and discarded the whole minibatch); plain Gluon "
              "trains")


def bad_tree_program(setup, guard):
    """Two minibatches of roots, one of them bad (see below), encoded by a
    ``TreeEncoder`` with a fresh memo each: ``block`` flagged as a whole,
    only its ``cells`` flagged, or the whole ``block`` under ``jitbatch.map``
    (plain Gluon: a loop)."""
    def program(nets, p):
        enc, head = nets
        flag_all([enc.leaf, enc.comp, head] if setup == "cells" else nets, p)
        tr = trainer(nets)
        out = []
        bad = 22 if guard else 21

        def sample(r):
            try:
                return root_loss(head, r, enc(r)[0])
            except KeyError:
                return None
        for roots in ([bad, 19, 15, 10], [17, bad, 18]):
            enc.memo = {}
            with autograd.record():
                ls = jitbatch.map(sample, roots) if setup == "map" and p else \
                    [sample(r) for r in roots]
                out.append(np.array([l is None for l in ls]))
                ls = [l for l in ls if l is not None]
                loss = nd.add_n(*ls)
            loss.backward()
            out += [l.asnumpy() for l in ls] + grads_of(*nets)
            tr.step(len(ls), ignore_stale_grad=True)
        return out + params_of(*nets)
    return program


def bad_tree_nets(guard):
    def make():
        return [init(TreeEncoder(BAD_DAG, guard, prefix="bt_"), 12),
                init(nn.Dense(2, in_units=H, prefix="bthead_"), 13)]
    return make


GUARD = pytest.mark.parametrize("guard", [False, True], ids=["caught-by-the-loop",
                                                            "caught-inside"])


@GUARD
@pytest.mark.parametrize("policy", [pytest.param(p, marks=pytest.mark.xfail(
    strict=True, raises=jitbatch.StaleValueError, reason=_DISCARDED)) for p in POLICIES])
def test_a_bad_tree_after_its_subtrees_were_memoized_by_a_flagged_block(policy, guard):
    """Per-sample trees encoded by a flagged ``Block`` with a memo: root 21
    fails on its missing right child after its left subtree (12) was encoded
    and memoized, the loop catches the KeyError and goes on; or
    (``caught-inside``) the left child 23 of root 22 fails after encoding
    leaf 5 and 22's forward catches it (a zero state). Later roots reuse the
    memoized subtrees (19 = (12, 12); 15 = (14, 8) with 14 = (4, 5)). Plain
    Gluon: those states are valid values; two minibatches, losses,
    gradients and parameters."""
    want, got, _ = both(bad_tree_nets(guard), bad_tree_program("block", guard), policy)
    same(want, got, "bad tree (guard=%s) under %s" % (guard, policy))


@POLICY
def test_a_value_dropped_with_a_failed_call_is_a_clear_error_at_its_use(policy):
    """The known difference above, as the user meets it: root 21 fails after
    its left subtree 12 was memoized; root 19 = (12, 12) then uses the
    dropped state. Its call raises StaleValueError naming the failed call's
    error and the fix (until 2026-11-26 the flush failed with an internal
    AttributeError, or 'agenda scheduling lost nodes', losing the minibatch);
    nothing is left pending, and the next minibatch, with a fresh memo, is
    plain Gluon's."""
    make = bad_tree_nets(False)
    want_nets, nets = make(), make()
    flag_all(nets, policy)
    enc, head = nets
    with pytest.raises(KeyError):
        enc(21)
    with pytest.raises(jitbatch.StaleValueError, match=r"(?s)raised while recording \(KeyError"
                       r".*Fix: record it again"):
        enc(19)
    assert not jitbatch.current_graph().nodes
    for e, h in (want_nets, nets):
        e.memo = {}
    want = [root_loss(want_nets[1], r, want_nets[0](r)[0]).asnumpy() for r in (19, 15, 10)]
    got = [root_loss(head, r, enc(r)[0]).asnumpy() for r in (19, 15, 10)]
    same(want, got, "the next minibatch under %s" % policy)


@GUARD
@pytest.mark.parametrize("setup", ["cells", "map"])
@POLICY
def test_a_bad_tree_with_the_cells_flagged_or_under_map(policy, setup, guard):
    """The same programs with the recursive ``Block`` left unflagged and its
    two cells flagged (the failing forward is the user's, not a flagged
    block's), or the flagged ``Block`` run under ``jitbatch.map`` (whose
    samples keep the nodes a failed call recorded): the memoized states stay
    valid, as in plain Gluon."""
    want, got, st = both(bad_tree_nets(guard), bad_tree_program(setup, guard), policy)
    same(want, got, "bad tree, %s (guard=%s) under %s" % (setup, guard, policy))
    assert want[0].tolist() == [not guard, False, False, False], want[0]
    if policy in MERGING:
        assert merged(st), st


@POLICY
def test_composites_of_lazy_rows_kept_across_minibatches(policy):
    """Each minibatch caches ``nd.concat(h1, h2, dim=0)``, ``stack`` of the
    two along axis 1 and a slice of the concatenation, of two samples'
    states (free structure: no node of their own); every later minibatch
    feeds every cached composite to a flagged ``flatten=False`` layer again
    (plain Gluon: constants after the minibatch that made them). Three SGD
    steps."""
    xs = samples("composites", 6)

    def make():
        return [init(nn.Dense(H, in_units=F, activation="tanh", prefix="co_a_"), 14),
                init(nn.Dense(2, in_units=H, flatten=False, prefix="co_b_"), 15)]

    def program(nets, p):
        a, b = nets
        flag_all(nets, p)
        tr = trainer(nets)
        cache, out = {}, []
        for mb in range(3):
            with autograd.record():
                hs = [a(x) for x in xs[2 * mb:2 * mb + 2]]
                both_rows = nd.concat(*hs, dim=0)
                cache[mb] = [both_rows, nd.stack(*hs, axis=1), both_rows[1:2]]
                ls = [nd.sum(nd.square(b(c))) for k in sorted(cache) for c in cache[k]]
                loss = nd.add_n(*ls)
            loss.backward()
            out += [l.asnumpy() for l in ls] + grads_of(*nets)
            tr.step(2, ignore_stale_grad=True)
        return out + [c.asnumpy() for k in sorted(cache) for c in cache[k]] + params_of(*nets)

    want, got, _ = both(make, program, policy)
    same(want, got, "composites kept under %s" % policy)


@POLICY
def test_python_protocols_on_lazy_scores(policy):
    """Per-sample scores ``(1, 1)`` (lazy) handled by Python's protocols:
    ``score in seen`` on a list (value equality: a read per comparison),
    ``list.index`` / ``count``, ``max()`` and ``sorted()`` of the scores
    (``__gt__`` / ``__lt__`` then ``bool``), a dict keyed by the score arrays
    (identity), ``if score > 0`` branching; the loss takes the best half
    and the de-duplicated ones. Two SGD steps; two samples are duplicates."""
    xs = samples("protocols", 5)
    xs[3] = xs[1].copy()

    def make():
        return [init(nn.Dense(4, in_units=F, activation="tanh", prefix="pr_a_"), 16),
                init(nn.Dense(1, in_units=4, prefix="pr_b_"), 17)]

    def program(nets, p):
        a, b = nets
        flag_all(nets, p)
        tr = trainer(nets)
        out = []
        for _ in range(2):
            with autograd.record():
                scores = [b(a(x)) for x in xs]
                seen = []
                for sc in scores:
                    if sc not in seen:
                        seen.append(sc)
                where = {sc: k for k, sc in enumerate(scores)}
                best = sorted(scores)[len(scores) // 2:]
                top = max(scores)
                signs = [1.0 if sc > 0 else -1.0 for sc in scores]
                meta = [scores.index(scores[3]), scores.count(scores[1]), where[top], len(seen)]
                loss = nd.add_n(*[nd.sum(nd.square(sc)) for sc in best + seen]) + \
                    nd.add_n(*[s * sc for s, sc in zip(signs, scores)]).sum()
            loss.backward()
            out += [np.array(meta), np.array(signs), loss.asnumpy()] + grads_of(*nets)
            tr.step(len(xs))
        return out + params_of(*nets)

    want, got, _ = both(make, program, policy)
    same(want, got, "protocols under %s" % policy)
    assert want[0].tolist()[:2] == [1, 2] and want[0].tolist()[3] == 4, want[0]


@pytest.mark.parametrize("policy", MERGING)
def test_a_state_left_out_of_the_loss_is_used_in_the_next_recording(policy):
    """The word cache of ``test_word_states_cached_from_an_unlabelled_sentence``
    written small: four outputs of four calls, two in minibatch 1's loss,
    the other two kept and used beside a new call in minibatch 2. Until
    2026-11-26 their share of the gradient was silently lost; until
    2026-11-27 the backward reaching them was a NotDifferentiableError
    naming retain_graph=True. Now the first backward's calls run apart from
    the kept ones (``history.run_apart``): plain Gluon's gradients with and
    without retain_graph, and outputs read but left out of the loss in the
    minibatch that made them (metrics) run."""
    xs = [nd.array(r) for r in rng_for("round40/refused").normal(size=(5, 1, F))]
    make = lambda: init(nn.Dense(3, in_units=F, prefix="refd_"), 8)  # noqa: E731

    def program(net, retain):
        with autograd.record():
            ys = [net(x) for x in xs[:4]]
            first = nd.add_n(*[nd.sum(y * y) for y in ys[:2]])
        first.backward(retain_graph=retain)
        with autograd.record():
            second = nd.add_n(*[nd.sum(nd.tanh(y)) for y in ys[2:]] + [nd.sum(net(xs[4]))])
        second.backward()
        return [second.asnumpy(), net.weight.grad().asnumpy().copy()]

    want = program(make(), False)
    net = make()
    flag(net, policy)
    same(want, program(net, False), "without retain_graph under %s" % policy)
    same(want, program(net, True), "with retain_graph under %s" % policy)
    with autograd.record():             # outputs read for a metric, not in the loss
        ys = [net(x) for x in xs[:4]]
        loss = nd.add_n(*[nd.sum(y * y) for y in ys[:2]])
        jitbatch.flush()
        acc = [float(y.asnumpy().argmax()) for y in ys]
    loss.backward()
    assert len(acc) == 4
