"""Held-out round 6: the first-run experience of the Tree-LSTM example and of
the library (a new user following README.rst, then going off the happy path).

The trainer runs in-process (``train.main``) on tiny settings; one subprocess
checks the real ``--help`` entry point. Strict xfails are real problems found.
"""
import os
import re
import shutil
import subprocess
import sys

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd, gluon, nd

import jitbatch
from examples.tree_lstm import train
from examples.tree_lstm.model import SimilarityTreeLSTM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL_DATA = os.path.join(ROOT, "data", "sick_small")
MEDIUM_DATA = os.path.join(ROOT, "data", "sick_medium")
README = os.path.join(ROOT, "README.rst")
TINY = ["--embed-size", "8", "--hidden-size", "4", "--sim-hidden", "3", "--quiet", "--no-plot"]


def _small_copy(tmp_path, name="data"):
    """A private copy of the bundled test data (errors are planted in it; the
    vector cache lands there, not in the checkout)."""
    dst = tmp_path / name
    shutil.copytree(SMALL_DATA, dst, ignore=shutil.ignore_patterns(".vectors_cache"))
    return dst


def _edit_line(path, lineno, fn):
    lines = path.read_text().split("\n")
    lines[lineno - 1] = fn(lines[lineno - 1])
    path.write_text("\n".join(lines))


def _cli_error(capsys, argv):
    """Run the trainer expecting a command-line error; return its stderr."""
    with pytest.raises(SystemExit) as exc:
        train.main(argv)
    assert exc.value.code == 2, exc.value.code
    return capsys.readouterr().err


# ---------------------------------------------------------------------------
# --help and the documented flags
# ---------------------------------------------------------------------------

def _readme_trainer_flags():
    text = open(README).read()
    start = text.index("The Tree-LSTM example\n---")
    section = text[start:text.index("Distributed training\n---")]
    para = section[section.index("Run\n``python -m examples.tree_lstm.train --help``"):]
    para = para[:para.index("* Word vectors")]
    flags = set(re.findall(r"``(--[a-z][a-z_-]*)", para))
    flags |= {f for pair in re.findall(r"``(--[a-z-]+)/(--[a-z-]+)``", para) for f in pair}
    flags |= set(re.findall(r"/(--[a-z][a-z_-]*)``", para))
    return sorted(flags)


def test_help_runs_and_lists_every_flag_the_readme_names():
    flags = _readme_trainer_flags()
    assert len(flags) >= 20, flags        # the parse found the README's list
    env = dict(os.environ, OMP_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-m", "examples.tree_lstm.train", "--help"], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    helptext = res.stdout
    missing = [f for f in flags if not re.search(re.escape(f) + r"\b", helptext)]
    assert not missing, missing
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("argv, flag, shown", [
    (["--epochs", "-1"], "--epochs", "-1"),
    (["--policy", "fast"], "--policy", "fast"),
    (["--granularity", "levels"], "--granularity", "levels"),
    (["--batch-size", "0"], "--batch-size", "0"),
    (["--max-pairs", "0"], "--max-pairs", "0"),
    (["--lr", "0"], "--lr", "0"),
    (["--analysis-budget", "-0.5"], "--analysis-budget", "-0.5"),
    (["--optimizer", "adamm"], "--optimizer", "adamm"),
    (["--hidden-size", "0"], "--hidden-size", "0"),
    (["--epochs", "1.5"], "--epochs", "1.5"),
    (["--word-embed", "no_such_vectors.txt"], "--word-embed", "no_such_vectors.txt"),
    (["--load", "no_such.params"], "--load", "no_such.params"),
])
def test_bad_flag_values_name_the_flag_and_the_value(tmp_path, capsys, argv, flag, shown):
    err = _cli_error(capsys, ["--data", SMALL_DATA, "--out", str(tmp_path)] + TINY + argv)
    last = err.strip().splitlines()[-1]
    assert flag in last and shown in last, last
    assert "Traceback" not in err


def test_a_missing_data_directory_names_flag_and_path(tmp_path, capsys):
    missing = str(tmp_path / "no_data_here")
    err = _cli_error(capsys, ["--data", missing, "--out", str(tmp_path)] + TINY)
    assert "--data" in err and missing in err and "does not exist" in err


@pytest.mark.parametrize("seed", ["-1", str(2 ** 32)])
def test_out_of_range_seed_is_a_usage_error(tmp_path, capsys, seed):
    err = _cli_error(capsys, ["--data", SMALL_DATA, "--out", str(tmp_path), "--epochs", "0",
                              "--max-pairs", "2", "--seed", seed] + TINY)
    assert "--seed" in err and seed in err


@pytest.mark.parametrize("argv", [["--wd", "nan"], ["--lr", "inf"], ["--wd", "inf"]])
def test_non_finite_hyperparameters_are_refused(tmp_path, capsys, argv):
    data = _small_copy(tmp_path)
    err = _cli_error(capsys, ["--data", str(data), "--out", str(tmp_path / "o"), "--epochs", "1",
                              "--max-pairs", "4", "--batch-size", "2", "--word-embed", "none",
                              "--embed-update", "dense"] + TINY + argv)
    assert argv[0] in err and argv[1] in err


# ---------------------------------------------------------------------------
# malformed data: file, line, expected vs actual
# ---------------------------------------------------------------------------

def _plant_cycle(d):
    # train/a.parents line 2: tokens 1 and 2 are each other's parent, the rest hang on token 1
    p = d / "train" / "a.parents"
    _edit_line(p, 2, lambda line: " ".join(["2", "1"] + ["1"] * (len(line.split()) - 2)))
    return "train/a.parents line 2", ["cycle", "1 -> 2 -> 1"]


def _plant_out_of_range(d):
    p = d / "dev" / "b.parents"
    n = []

    def edit(line):
        f = line.split()
        n.append(len(f))
        f[0] = "99"
        return " ".join(f)
    _edit_line(p, 5, edit)
    return "dev/b.parents line 5", ["99", "out of range", "between 1 and %d" % n[0]]


def _plant_self_parent(d):
    p = d / "test" / "a.parents"

    def edit(line):
        f = line.split()
        root = f.index("0")
        f[root] = str(root + 1)
        return " ".join(f)
    _edit_line(p, 3, edit)
    return "test/a.parents line 3", ["own parent"]


def _plant_bad_score(d):
    _edit_line(d / "test" / "sim.txt", 3, lambda line: line + " extra")
    return "test/sim.txt line 3", ["not a number"]


def _plant_score_out_of_range(d):
    _edit_line(d / "train" / "sim.txt", 7, lambda line: "7.5")
    return "train/sim.txt line 7", ["7.5", "outside [1, 5]"]


def _plant_token_mismatch(d):
    _edit_line(d / "train" / "b.toks", 7, lambda line: line + " extra")
    return "train/b.toks", ["line 7", "parent indices"]


def _plant_non_integer_parent(d):
    _edit_line(d / "dev" / "a.parents", 2, lambda line: line.replace(" ", " x", 1))
    return "dev/a.parents line 2", ["'x", "not an integer"]


def _plant_empty_file(d):
    (d / "dev" / "a.toks").write_text("")
    return "dev/a.toks", ["0 lines", "dev/b.toks"]


def _plant_missing_file(d):
    (d / "train" / "sim.txt").unlink()
    return "train/sim.txt", ["missing file", "a.toks, b.toks, a.parents, b.parents, sim.txt"]


def _plant_empty_split(d):
    for name in ("a.toks", "b.toks", "a.parents", "b.parents", "sim.txt"):
        (d / "test" / name).write_text("")
    return "'test'", ["empty"]


@pytest.mark.parametrize("plant", [_plant_cycle, _plant_out_of_range, _plant_self_parent,
                                   _plant_bad_score, _plant_score_out_of_range,
                                   _plant_token_mismatch, _plant_non_integer_parent,
                                   _plant_empty_file, _plant_missing_file, _plant_empty_split],
                         ids=lambda f: f.__name__[len("_plant_"):])
def test_malformed_data_names_file_line_and_values(tmp_path, capsys, plant):
    d = _small_copy(tmp_path)
    where, words = plant(d)
    err = _cli_error(capsys, ["--data", str(d), "--out", str(tmp_path / "o"), "--epochs", "0"]
                     + TINY)
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert "--data" in last and where in last, last
    for w in words:
        assert w in last, (w, last)


# ---------------------------------------------------------------------------
# word vectors
# ---------------------------------------------------------------------------

def _vocab_word_used_by_dev(d):
    return (d / "dev" / "a.toks").read_text().split("\n")[0].split()[0]


@pytest.mark.parametrize("content, words", [
    ("", ["contains no word vectors"]),
    ("\n  \n\n", ["contains no word vectors"]),
    ("foo 0.1 0.2 0.3\nbar 1 2 3\n", ["dimension 3", "dim=8", "--embed-size 3"]),
    ("{w} 0.1 abc 0.3 0.4 0.5 0.6 0.7 0.8\n", ["line 1", "'abc'", "not a number"]),
    ("foo 1 2 3 4 5 6 7 8\nbar 1 2 3 4 5 6 7 8\n{w} 1 2\n", ["line 3", "2 values, expected 8"]),
], ids=["empty", "blank", "wrong-dim", "not-a-number", "short-line"])
def test_bad_vector_files_name_file_line_and_fix(tmp_path, capsys, content, words):
    d = _small_copy(tmp_path)
    vec = tmp_path / "glove.test.txt"
    vec.write_text(content.format(w=_vocab_word_used_by_dev(d)))
    err = _cli_error(capsys, ["--data", str(d), "--out", str(tmp_path / "o"), "--epochs", "0",
                              "--max-pairs", "3", "--word-embed", str(vec)] + TINY)
    last = err.strip().splitlines()[-1]
    assert "--word-embed" in last and str(vec) in last and "--word-embed none" in last, last
    for w in words:
        assert w in last, (w, last)


def test_nan_in_a_vector_file_is_refused(tmp_path, capsys):
    d = _small_copy(tmp_path)
    vec = tmp_path / "glove.nan.txt"
    vec.write_text("%s 0.1 nan 0.3 0.4 0.5 0.6 0.7 0.8\nfoo 1 2 3 4 5 6 7 8\n"
                   % _vocab_word_used_by_dev(d))
    err = _cli_error(capsys, ["--data", str(d), "--out", str(tmp_path / "o"), "--epochs", "0",
                              "--max-pairs", "3", "--word-embed", str(vec)] + TINY)
    assert "line 1" in err and "nan" in err


def test_a_vector_file_matching_no_word_is_reported(tmp_path, capsys):
    d = _small_copy(tmp_path)
    vec = tmp_path / "glove.other.txt"
    vec.write_text("".join("zzword%d %s\n" % (i, " ".join(["0.5"] * 8)) for i in range(30)))
    metrics = train.main(["--data", str(d), "--out", str(tmp_path / "o"), "--epochs", "0",
                          "--max-pairs", "3", "--word-embed", str(vec)] + TINY)
    out = capsys.readouterr().out
    assert metrics["words_with_vectors"] == 0         # what happened
    assert any("random vectors" in n for n in metrics["notes"]), (metrics["notes"], out)


# ---------------------------------------------------------------------------
# metrics
# ---------------------------------------------------------------------------

def _ref_ranks(x):
    x = np.asarray(x, dtype=np.float64)
    return np.array([(x < v).sum() + ((x == v).sum() + 1) / 2.0 for v in x])


def _ref_metrics(pred, gold):
    pred, gold = np.asarray(pred, np.float64), np.asarray(gold, np.float64)
    return {"pearson": np.corrcoef(pred, gold)[0, 1],
            "spearman": np.corrcoef(_ref_ranks(pred), _ref_ranks(gold))[0, 1],
            "mse": np.mean((pred - gold) ** 2)}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_correlations_match_numpy_with_ties(seed):
    rng = np.random.default_rng(seed)
    gold = rng.integers(1, 6, 40).astype(float) + rng.choice([0.0, 0.5], 40)  # many ties
    pred = np.round(gold + rng.normal(0, 1.0, 40), 1)                          # ties too
    got = train.correlations(pred, gold)
    ref = _ref_metrics(pred, gold)
    for k in ("pearson", "spearman", "mse"):
        assert got[k] == pytest.approx(ref[k], rel=1e-12, abs=1e-12), k


def test_spearman_of_nan_predictions_is_nan():
    got = train.correlations([np.nan, 1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0])
    assert np.isnan(got["pearson"]) and np.isnan(got["mse"])
    assert np.isnan(got["spearman"]), got


# ---------------------------------------------------------------------------
# results: the flag changes nothing; evaluation; checkpoints across modes
# ---------------------------------------------------------------------------

MEDIUM_RUN = ["--data", MEDIUM_DATA, "--max-pairs", "12", "--batch-size", "4", "--epochs", "2",
              "--hidden-size", "8", "--sim-hidden", "6", "--quiet", "--no-plot"]


@pytest.fixture(scope="module")
def medium_runs(tmp_path_factory):
    """The default job (bundled sick_medium, its 50-d vectors, frozen embedding,
    default policy) cut down: 12 pairs, 3 updates per epoch, 2 epochs; once with
    the flag and once without, each saving its best-dev parameters and keeping
    its last-epoch parameters."""
    out = {}
    orig_restore = train._restore
    for mode in ("dynamic", "plain"):
        d = tmp_path_factory.mktemp(mode)
        last = {}

        def restore(net, snap, _last=last):
            _last.update({k: p.data().asnumpy().copy()      # save_parameters' names
                          for k, p in net._collect_params_with_prefix().items()})
            return orig_restore(net, snap)
        train._restore = restore
        try:
            flag = "--dynamic-batch" if mode == "dynamic" else "--no-dynamic-batch"
            jitbatch.reset_stats()
            metrics = train.main(MEDIUM_RUN + ["--out", str(d), "--save", str(d / "best.params"),
                                               flag])
        finally:
            train._restore = orig_restore
        out[mode] = {"metrics": metrics, "last": last, "params": str(d / "best.params"),
                     "dir": d}
    return out


def test_flag_gives_plain_gluons_losses_and_parameters_on_the_bundled_data(medium_runs):
    dyn, plain = medium_runs["dynamic"], medium_runs["plain"]
    assert dyn["metrics"]["jitbatch"]["launches"] < dyn["metrics"]["jitbatch"]["nodes"]
    assert plain["metrics"]["jitbatch"]["nodes"] == 0
    assert len(dyn["metrics"]["step_losses"]) == 6
    np.testing.assert_allclose(dyn["metrics"]["step_losses"], plain["metrics"]["step_losses"],
                               rtol=1e-4)
    np.testing.assert_allclose(dyn["metrics"]["train_loss"], plain["metrics"]["train_loss"],
                               rtol=1e-4)
    assert set(dyn["last"]) == set(plain["last"]) and dyn["last"]
    for name, value in plain["last"].items():
        # Adagrad's first steps are ~lr * sign(grad): allow the float32 rounding it amplifies
        np.testing.assert_allclose(dyn["last"][name], value, atol=2e-3, err_msg=name)
    # the parameters did move (so the comparison above is not of two initialisations)
    assert len(set(np.round(plain["metrics"]["step_losses"], 6))) > 1
    saved = {k: v.asnumpy() for k, v in mx.nd.load(plain["params"]).items()}
    if plain["metrics"]["best_epoch"] == 2:
        for name, value in plain["last"].items():
            np.testing.assert_array_equal(saved[name], value)
    for split in ("dev", "test"):
        for key in ("pearson", "spearman", "mse"):
            np.testing.assert_allclose(dyn["metrics"][split][key], plain["metrics"][split][key],
                                       atol=2e-3)


def _plain_net(metrics, params):
    net = SimilarityTreeLSTM(metrics["vocab_size"], embed_size=metrics["args"]["embed_size"],
                             hidden_size=metrics["args"]["hidden_size"],
                             sim_hidden=metrics["args"]["sim_hidden"], num_classes=5,
                             embed_update=metrics["args"]["embed_update"])
    net.load_parameters(params, ctx=mx.cpu())
    return net


def test_reported_test_metrics_are_those_of_the_saved_best_parameters(medium_runs):
    from examples.tree_lstm import data as D
    run = medium_runs["dynamic"]
    metrics = run["metrics"]
    net = _plain_net(metrics, run["params"])       # no jitbatch flag: plain Gluon
    splits, _ = D.load_dataset(MEDIUM_DATA)
    test = splits["test"][:12]
    pred = []
    for p in test:
        lp = net(nd.array(p.a_ids), p.a_tree, nd.array(p.b_ids), p.b_tree).asnumpy()
        pred.append(float(np.exp(lp[0]) @ np.arange(1, 6)))
    ref = _ref_metrics(pred, [p.score for p in test])
    for key in ("pearson", "spearman", "mse"):
        assert metrics["test"][key] == pytest.approx(ref[key], rel=1e-4, abs=1e-5), key
    assert metrics["test"]["pairs"] == 12
    assert metrics["dev"] == metrics["epochs"][metrics["best_epoch"]]["dev"]


@pytest.mark.parametrize("saved, loaded", [("dynamic", "--no-dynamic-batch"),
                                           ("plain", "--dynamic-batch")])
def test_checkpoint_loads_across_the_flag(medium_runs, tmp_path, saved, loaded):
    run = medium_runs[saved]
    argv = [a for a in MEDIUM_RUN]
    argv[argv.index("--epochs") + 1] = "0"
    again = train.main(argv + ["--load", run["params"], loaded, "--out", str(tmp_path)])
    assert again["start"] == "loaded " + run["params"]
    for split in ("dev", "test"):
        for key in ("pearson", "spearman", "mse"):
            np.testing.assert_allclose(again[split][key], run["metrics"][split][key],
                                       rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------
# progress output, plot, output paths
# ---------------------------------------------------------------------------

def test_progress_bars_and_plot(tmp_path, capsys):
    d = _small_copy(tmp_path)
    out = tmp_path / "run"
    argv = ["--data", str(d), "--out", str(out), "--epochs", "1", "--max-pairs", "8",
            "--batch-size", "4", "--embed-size", "8", "--hidden-size", "4", "--sim-hidden", "3"]
    train.main(argv)
    err = capsys.readouterr().err
    assert "epoch 1/1" in err and "loss=" in err and "pairs_s=" in err, err[-500:]
    assert "dev (epoch 0)" in err and "test" in err
    png = out / "learning_curve.png"
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    import matplotlib.image
    img = matplotlib.image.imread(str(png))
    assert img.shape[0] > 200 and img.shape[1] > 200 and img[..., :3].std() > 0.01
    train.main(argv + ["--quiet", "--no-plot", "--out", str(tmp_path / "quiet")])
    err = capsys.readouterr().err
    assert "epoch 1/1" not in err and "pairs_s=" not in err
    assert not (tmp_path / "quiet" / "learning_curve.png").exists()


@pytest.mark.parametrize("which", ["out", "save"])
def test_unusable_output_paths_are_refused_before_training(tmp_path, capsys, which):
    d = _small_copy(tmp_path)
    afile = tmp_path / "a_file"
    afile.write_text("x")
    argv = ["--data", str(d), "--epochs", "1", "--max-pairs", "4", "--batch-size", "2"] + TINY
    if which == "out":
        argv += ["--out", str(afile)]
    else:
        argv += ["--out", str(tmp_path / "o"), "--save", str(tmp_path)]
    with pytest.raises(SystemExit) as exc:
        train.main(argv)
    err = capsys.readouterr()
    assert exc.value.code == 2
    assert "--" + which in err.err
    assert "epoch 1:" not in err.out       # refused before the work, not after


# ---------------------------------------------------------------------------
# the library's first touch
# ---------------------------------------------------------------------------

def _batched_run(make, xs, flag=True):
    mx.random.seed(3)
    net = make()
    if flag:
        net.hybridize(dynamic_batch=True)      # before initialize(): deferred init
    net.initialize(mx.init.Xavier())
    jitbatch.reset_stats()
    xs = [x.copy() for x in xs]
    for x in xs:
        x.attach_grad()
    with autograd.record():
        ys = [net(x) for x in xs]
        loss = nd.add_n(*[(y * y).sum() for y in ys])
    loss.backward()
    grads = {k: p.grad().asnumpy() for k, p in net._collect_params_with_prefix().items()
             if p.grad_req != "null"}
    grads.update({"x%d" % i: x.grad.asnumpy() for i, x in enumerate(xs)})
    return [y.asnumpy() for y in ys], grads, jitbatch.stats()


class _NoParams(gluon.HybridBlock):
    def hybrid_forward(self, F, x):  # pylint: disable=arguments-differ
        return F.tanh(x) * 2 + 1


class _PlainOuter(gluon.Block):
    """A plain Block (not hybridizable) with Python control flow and hybrid children."""

    def __init__(self, **kw):
        super().__init__(**kw)
        with self.name_scope():
            self.a = gluon.nn.Dense(5, activation="relu")
            self.b = gluon.nn.Dense(2)

    def forward(self, x):  # pylint: disable=arguments-differ
        h = self.a(x)
        for _ in range(int(x.shape[0])):
            h = h + 1
        return self.b(h)


def _seq():
    s = gluon.nn.HybridSequential()
    s.add(gluon.nn.Dense(6, activation="tanh"), gluon.nn.Dense(3))
    return s


@pytest.mark.parametrize("make", [lambda: gluon.nn.Dense(3), _seq, _NoParams, _PlainOuter],
                         ids=["dense-deferred", "sequential-deferred", "no-params",
                              "plain-block-hybrid-children"])
def test_flag_before_initialize_and_odd_blocks_match_plain_gluon(make):
    xs = [nd.random.normal(shape=(1, 4), dtype="float32") for _ in range(5)]
    ref_out, ref_grads, _ = _batched_run(make, xs, flag=False)
    got_out, got_grads, st = _batched_run(make, xs, flag=True)
    for a, b in zip(got_out, ref_out):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert got_grads.keys() == ref_grads.keys()
    for k in ref_grads:
        np.testing.assert_allclose(got_grads[k], ref_grads[k], rtol=1e-5, atol=1e-6)
    assert 0 < st["launches"] < st["nodes"]


def test_import_twice_uninstall_and_install_again():
    import importlib
    hooked_call, hooked_hyb = gluon.Block.__call__, gluon.Block.hybridize
    jb = importlib.import_module("jitbatch")
    import jitbatch as again  # noqa: F401  (a second import is a no-op)
    assert jb is again is jitbatch
    jitbatch.install()
    jitbatch.install()                       # idempotent: nothing wrapped twice
    assert gluon.Block.__call__ is hooked_call and gluon.Block.hybridize is hooked_hyb
    xs = [nd.random.normal(shape=(1, 4)) for _ in range(4)]
    ref, _, st = _batched_run(lambda: gluon.nn.Dense(3), xs)
    assert st["launches"] < st["nodes"]
    try:
        jitbatch.uninstall()
        jitbatch.uninstall()                 # twice is fine too
        assert gluon.Block.__call__ is not hooked_call
        plain, _, st = _batched_run(lambda: gluon.nn.Dense(3), xs, flag=False)
        assert st["nodes"] == 0
        for a, b in zip(plain, ref):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    finally:
        jitbatch.install()
    assert gluon.Block.__call__ is hooked_call
    got, _, st = _batched_run(lambda: gluon.nn.Dense(3), xs)
    assert 0 < st["launches"] < st["nodes"]
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


README_STATS = ["nodes", "launches", "flushes", "forced_flushes", "filler_samples",
                "pipelined_flushes", "gather_ops", "signatures", "failures", "analysis_seconds",
                "execute_seconds", "release_seconds", "policies", "last_flush", "pipeline"]
README_LAST_FLUSH = ["policy", "why", "predicted", "execute_seconds", "calibrated", "padding",
                     "granularity", "chunk_size"]


def test_stats_has_every_key_the_readme_documents():
    text = " ".join(open(README).read().split())
    api = text[text.index("``jitbatch.flush()``, ``jitbatch.stats()``"):]
    api = api[:api.index("``jitbatch.uninstall()``")]
    for key in README_STATS[:-2]:
        if key != "policies":
            assert "``%s``" % key in api, key   # the list above is the README's
    xs = [nd.random.normal(shape=(1, 4)) for _ in range(4)]
    _batched_run(lambda: gluon.nn.Dense(3), xs)
    st = jitbatch.stats()
    missing = [k for k in README_STATS if k not in st]
    assert not missing, missing
    assert st["nodes"] >= 4 and st["flushes"] >= 1 and st["launches"] >= 1
    assert sum(st["policies"].values()) == st["flushes"]
    missing = [k for k in README_LAST_FLUSH if k not in st["last_flush"]]
    assert not missing, missing


def _small_workload():
    net = gluon.nn.Dense(2, in_units=3)
    net.initialize()
    net.hybridize(dynamic_batch=True)
    xs = [nd.random.normal(shape=(1, 3)) for _ in range(70)]   # > 2 * row_buckets
    return nd.concat(*[net(x) for x in xs], dim=0).asnumpy()


def _config_case(field, value):
    old = getattr(jitbatch.config, field)
    try:
        with pytest.raises(jitbatch.FlagError) as exc:
            setattr(jitbatch.config, field, value)    # refused here, or at the use
            if field == "map_threads":
                net = gluon.nn.Dense(2, in_units=3)
                net.initialize()
                net.hybridize(dynamic_batch=True)
                jitbatch.map(lambda x: net(x).asnumpy(), [nd.ones((1, 3))] * 3)
            else:
                _small_workload()
    finally:
        setattr(jitbatch.config, field, old)
        try:
            jitbatch.flush()
        except Exception:  # pylint: disable=broad-except
            pass
    msg = str(exc.value)
    assert "jitbatch.config.%s" % field in msg and repr(value) in msg, msg
    assert "expected" in msg and "Fix" in msg, msg


@pytest.mark.parametrize("value", [0, -2, 2.5])
def test_bad_map_threads_is_a_flag_error(value):
    _config_case("map_threads", value)


@pytest.mark.parametrize("value", ["10", 0])
def test_bad_max_pending_is_a_flag_error(value):
    _config_case("max_pending", value)


@pytest.mark.parametrize("value", [2.5, "16", -3])
def test_bad_row_buckets_is_a_flag_error(value):
    _config_case("row_buckets", value)


@pytest.mark.parametrize("field", ["strict", "fast_activations", "debug"])
def test_string_false_in_a_boolean_config_field_is_a_flag_error(field):
    _config_case(field, "False")


def test_uninstalled_flag_is_silently_ignored_by_mxnet():
    """Pins a known first-user trap (reported, by design of uninstall): after
    jitbatch.uninstall(), hybridize(dynamic_batch=True) reaches MXNet's own
    hybridize, which keeps unknown flags without a word; nothing is batched."""
    try:
        jitbatch.uninstall()
        net = gluon.nn.Dense(2, in_units=3)
        net.initialize()
        net.hybridize(dynamic_batch=True)
        jitbatch.reset_stats()
        y = net(nd.ones((1, 3)))
        assert not jitbatch.is_lazy(y) and type(y) is nd.NDArray
        assert jitbatch.stats()["nodes"] == 0
    finally:
        jitbatch.install()
