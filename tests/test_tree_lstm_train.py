"""Tests of the Tree-LSTM training script (examples/tree_lstm/train.py)."""
import argparse
import json
import math
import os

import mxnet as mx
import numpy as np
import pytest

from examples.tree_lstm import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLED = os.path.join(ROOT, "data", "sick_small")
SMALL = ["--data", BUNDLED, "--embed-size", "16", "--hidden-size", "8", "--sim-hidden", "6",
         "--embed-update", "dense",
         "--quiet", "--no-plot"]


def run(tmp_path, name, *extra):
    return train.main(SMALL + ["--out", str(tmp_path / name)] + list(extra))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Plain per-sample Gluon: 8 pairs, batches of 4, one epoch (2 updates)."""
    out = tmp_path_factory.mktemp("plain")
    return train.main(SMALL + ["--out", str(out), "--max-pairs", "8", "--batch-size", "4",
                               "--epochs", "1", "--no-dynamic-batch"])


@pytest.mark.parametrize("policy,granularity", [("depth", "auto"), ("agenda", "auto"),
                                                ("auto", "auto"), ("agenda", "split")])
def test_dynamic_batching_matches_per_sample(tmp_path, reference, policy, granularity):
    got = run(tmp_path, policy, "--max-pairs", "8", "--batch-size", "4", "--epochs", "1",
              "--dynamic-batch", "--policy", policy, "--granularity", granularity)
    ref_losses, got_losses = reference["step_losses"], got["step_losses"]
    assert len(ref_losses) == len(got_losses) == 2
    np.testing.assert_allclose(got_losses, ref_losses, rtol=1e-4)
    # after the updates the parameters agree only to float32 rounding, which AdaGrad's
    # first step (about lr * sign(grad)) can amplify: compare the metrics loosely
    for split in ("dev", "test"):
        for key in ("pearson", "spearman", "mse"):
            np.testing.assert_allclose(got[split][key], reference[split][key], atol=2e-3)
    assert got["jitbatch"]["launches"] < got["jitbatch"]["nodes"]  # something was merged
    if granularity == "split":
        (g,) = got["jitbatch"]["last_flush"]["granularity"].values()
        assert g["granularity"] == "split" and g["nodes"] > 0
    assert reference["jitbatch"]["nodes"] == 0


def test_smoke_writes_metrics_and_plot(tmp_path):
    out = tmp_path / "smoke"
    metrics = train.main(["--data", BUNDLED, "--embed-size", "16", "--hidden-size", "8",
                          "--max-pairs", "20", "--batch-size", "5", "--epochs", "1",
                          "--quiet", "--out", str(out)])
    assert (out / "learning_curve.png").stat().st_size > 0
    with open(out / "metrics.json") as f:
        saved = json.load(f)
    assert saved["test"] == metrics["test"]
    assert [e["epoch"] for e in saved["epochs"]] == [0, 1]
    assert len(saved["step_losses"]) == 4
    values = [saved["epochs"][1]["train_loss"], saved["throughput"]["train_pairs_per_s"],
              saved["throughput"]["eval_pairs_per_s"]] + saved["step_losses"]
    for split in ("dev", "test"):
        values += [saved[split][k] for k in ("pearson", "spearman", "mse")]
    assert all(isinstance(v, float) and math.isfinite(v) for v in values), values
    assert saved["args"]["epochs"] == 1 and saved["jitbatch"]["flushes"] > 0


def test_save_then_load_reproduces_test_metrics(tmp_path):
    # policy 'agenda' in both runs: the same launches whatever the machine's
    # timings ('auto' chooses by measured times; other groupings round the 12
    # nearly equal predictions of a barely trained model apart by 1e-4 in r)
    params = str(tmp_path / "best.params")
    first = run(tmp_path, "a", "--max-pairs", "12", "--batch-size", "4", "--epochs", "2",
                "--save", params, "--policy", "agenda")
    assert os.path.isfile(params)
    again = run(tmp_path, "b", "--max-pairs", "12", "--epochs", "0", "--load", params,
                "--policy", "agenda")
    assert again["step_losses"] == []
    for key in ("pearson", "spearman", "mse"):
        np.testing.assert_allclose(again["test"][key], first["test"][key], rtol=1e-5)
    np.testing.assert_allclose(again["epochs"][0]["dev"]["pearson"],
                               first["dev"]["pearson"], rtol=1e-5)


@pytest.mark.parametrize("argv, flag, value", [
    (["--ctx", "tpu(0)"], "--ctx", "tpu(0)"),
    (["--ctx", "gpu(99)"], "--ctx", "gpu(99)"),
    (["--data", "no/such/dir"], "--data", "no/such/dir"),
])
def test_bad_arguments_give_clear_errors(tmp_path, capsys, argv, flag, value):
    with pytest.raises(SystemExit) as exc:
        train.main(argv + ["--out", str(tmp_path), "--quiet"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and value in err


# ---------------------------------------------------------------------------
# metrics without scipy
# ---------------------------------------------------------------------------

def test_correlations_pearson_and_spearman_with_ties():
    pred = [1.0, 2.0, 2.0, 3.0, 10.0]
    gold = [1.5, 1.0, 3.0, 4.0, 5.0]
    got = train.correlations(pred, gold)
    assert got["pearson"] == pytest.approx(np.corrcoef(pred, gold)[0, 1])
    # ranks of pred with the tie averaged: 1, 2.5, 2.5, 4, 5; gold: 2, 1, 3, 4, 5
    assert got["spearman"] == pytest.approx(np.corrcoef([1, 2.5, 2.5, 4, 5], [2, 1, 3, 4, 5])[0, 1])
    assert got["mse"] == pytest.approx(np.mean((np.array(pred) - gold) ** 2))
    # a monotone transform keeps rho at 1 but not r
    mono = train.correlations(np.exp(gold), gold)
    assert mono["spearman"] == pytest.approx(1.0) and mono["pearson"] < 0.99
    flat = train.correlations([2.0, 2.0, 2.0], [1.0, 2.0, 3.0])
    assert math.isnan(flat["pearson"]) and math.isnan(flat["spearman"])


def test_overlap_baseline_of_bundled_data():
    from examples.tree_lstm import data as D
    splits, _ = D.load_dataset(MEDIUM)
    r = train.overlap_baseline(splits["test"])
    overlaps = [D.word_overlap(p) for p in splits["test"]]
    assert r == pytest.approx(np.corrcoef(overlaps, [p.score for p in splits["test"]])[0, 1])
    assert 0.5 < r < 0.8   # a real but beatable baseline (the generator prints ~0.69)


# ---------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------

MEDIUM = os.path.join(ROOT, "data", "sick_medium")


def parsed(*argv):
    return train.build_parser().parse_args(list(argv))


def test_defaults_are_the_bundled_job():
    _, args = train.parse_args(["--data", MEDIUM])
    assert args.word_embed == "auto" and args.word_embed_file == os.path.join(MEDIUM,
                                                                              "vectors.50d.txt")
    assert args.embed_size == 50 and args.embed_update == "frozen"
    assert train.build_parser().get_default("data") == "data/sick_medium"
    _, none = train.parse_args(["--data", MEDIUM, "--word-embed", "none"])
    assert none.word_embed_file is None and none.embed_size == train.DEFAULT_EMBED_SIZE
    _, sized = train.parse_args(["--data", MEDIUM, "--embed-size", "16", "--word-embed", "none"])
    assert sized.embed_size == 16


@pytest.mark.parametrize("argv, dest, value", [
    (["--freeze-embed"], "embed_update", "frozen"),
    (["--freeze_embed"], "embed_update", "frozen"),
    (["--sparse-embed"], "embed_update", "sparse"),
    (["--sparse"], "embed_update", "sparse"),
    (["--dense-embed"], "embed_update", "dense"),
    (["--embed-update", "dense"], "embed_update", "dense"),
    (["--sparse", "--embed_update", "frozen"], "embed_update", "frozen"),  # the last one wins
    (["--word_embed", "v.txt"], "word_embed", "v.txt"),
    (["--glove", "glove_dir"], "word_embed", "glove_dir"),
    (["--batch_size", "7"], "batch_size", 7),
    (["--batchsize", "7"], "batch_size", 7),
    (["--hidden_size", "32"], "hidden_size", 32),
    (["--mem_dim", "32"], "hidden_size", 32),       # treelstm.pytorch: the Tree-LSTM state
    (["--hidden_dim", "20"], "sim_hidden", 20),     # treelstm.pytorch: the similarity layer
    (["--input_dim", "64"], "embed_size", 64),
    (["--embed_size", "64"], "embed_size", 64),
    (["--optim", "adam"], "optimizer", "adam"),
    (["--use-gpu"], "ctx", "gpu"),
    (["--cuda"], "ctx", "gpu"),
    (["--use-gpu", "--no-cuda"], "ctx", "cpu"),
    (["--max_pairs", "3"], "max_pairs", 3),
    (["--analysis_budget", "0.1"], "analysis_budget", 0.1),
])
def test_classic_spellings(argv, dest, value):
    assert getattr(parsed(*argv), dest) == value


def test_use_gpu_without_a_gpu_names_the_flag(tmp_path, capsys):
    if mx.context.num_gpus() > 0:
        pytest.skip("this machine has a GPU")
    with pytest.raises(SystemExit):
        train.main(["--use-gpu", "--data", BUNDLED, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert "--use-gpu" in err and "'gpu'" in err and "0 GPU" in err


def test_help_shows_every_default():
    parser = train.build_parser()
    text = " ".join(parser.format_help().split())
    for action in parser._actions:  # pylint: disable=protected-access
        if not action.option_strings or action.default in (None, False, argparse.SUPPRESS):
            continue
        if action.dest in ("help", "embed_size"):
            continue
        assert "(default: %s)" % action.default in text, action.option_strings
    assert "(default: the vectors' dimension, else 300)" in text
    assert "(default: unbounded)" in text and "default: all" in text


def test_word_embed_directory_and_auto(tmp_path, capsys):
    from examples.tree_lstm import data as D
    assert train.resolve_word_embed("auto", BUNDLED) is None        # no vectors there
    assert train.resolve_word_embed(MEDIUM, BUNDLED) == os.path.join(MEDIUM, "vectors.50d.txt")
    assert train.resolve_word_embed("none", MEDIUM) is None
    (tmp_path / "glove.a.txt").write_text("x 1\n")
    (tmp_path / "glove.b.txt").write_text("x 1\n")
    with pytest.raises(ValueError, match=r"several vector files .*glove\.a\.txt, glove\.b\.txt"):
        train.resolve_word_embed("auto", str(tmp_path))
    with pytest.raises(SystemExit):
        train.main(["--data", BUNDLED, "--word-embed", str(tmp_path), "--out", str(tmp_path)])
    assert "holds 2 glove*.txt / vectors*.txt files" in capsys.readouterr().err
    assert D.find_vector_files(str(tmp_path)) != []


# ---------------------------------------------------------------------------
# what the output says
# ---------------------------------------------------------------------------

def test_hybridize_with_dynamic_batching_is_reported(tmp_path, capsys):
    metrics = run(tmp_path, "hyb", "--max-pairs", "4", "--epochs", "0", "--hybridize")
    out = capsys.readouterr().out
    assert "note: --hybridize changes nothing with dynamic batching" in out
    assert metrics["notes"] == [train.HYBRIDIZE_NOTE]
    plain = run(tmp_path, "hyb2", "--max-pairs", "4", "--epochs", "0", "--hybridize",
                "--no-dynamic-batch")
    assert plain["execution"] == "per-sample hybridized" and plain["notes"] == []


def test_loaded_parameters_are_not_called_untrained(tmp_path, capsys):
    params = str(tmp_path / "p.params")
    run(tmp_path, "a", "--max-pairs", "6", "--epochs", "0", "--save", params)
    assert "epoch 0 (untrained)" in capsys.readouterr().out
    metrics = run(tmp_path, "b", "--max-pairs", "6", "--epochs", "0", "--load", params)
    out = capsys.readouterr().out
    assert "untrained" not in out
    assert "epoch 0 (loaded %s)" % params in out
    assert "(loaded %s, not trained further)" % params in out
    assert metrics["start"] == "loaded " + params


def test_summary_prints_the_word_overlap_baseline(tmp_path, capsys):
    metrics = run(tmp_path, "base", "--max-pairs", "10", "--epochs", "0")
    out = capsys.readouterr().out
    test_r = metrics["baseline_word_overlap"]["test"]
    assert "word-overlap baseline test r %.4f" % test_r in out.splitlines()[-1]
    assert "dev r %.4f" % metrics["baseline_word_overlap"]["dev"] in out


# ---------------------------------------------------------------------------
# embedding updates
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dynamic", [True, False])
@pytest.mark.parametrize("mode", ["frozen", "sparse", "dense"])
def test_embed_update_modes(mode, dynamic):
    from mxnet import autograd, gluon, nd
    from examples.tree_lstm.model import SimilarityTreeLSTM, kl_loss
    from models import random_tree
    mx.random.seed(0)
    net = SimilarityTreeLSTM(30, embed_size=4, hidden_size=5, sim_hidden=3, embed_update=mode)
    net.initialize(mx.init.Uniform(0.5))
    if dynamic:
        net.hybridize(dynamic_batch=True)
    trainer = gluon.Trainer(net.collect_params(), "adagrad", {"learning_rate": 0.1, "wd": 1e-3})
    before = net.encoder.embed.weight.data().asnumpy().copy()
    rng = np.random.default_rng(0)
    used = set()
    with autograd.record():
        losses = []
        for _ in range(3):
            a, b = rng.integers(0, 10, 4), rng.integers(0, 10, 3)   # only rows 0..9 are used
            used.update(a.tolist() + b.tolist())
            out = net(nd.array(a), random_tree(rng, 4), nd.array(b), random_tree(rng, 3))
            losses.append(kl_loss()(out, nd.array([[0, 0, 1, 0, 0]])))
        loss = nd.add_n(*losses)
    loss.backward()
    trainer.step(3)
    after = net.encoder.embed.weight.data().asnumpy()
    changed = set(np.flatnonzero(np.abs(after - before).max(axis=1) > 0).tolist())
    if mode == "frozen":
        assert changed == set()
    elif mode == "sparse":
        assert changed == used       # only the rows looked up, no weight decay elsewhere
    else:
        assert changed == set(range(30))   # every row (weight decay reaches all of them)


# ---------------------------------------------------------------------------
# learning curve
# ---------------------------------------------------------------------------

def curve(*dev_r):
    return [{"epoch": k, "train_loss": None if k == 0 else 1.0 / (k + 1), "dev": {"pearson": r}}
            for k, r in enumerate(dev_r)]


def test_plot_marks_best_epoch_baseline_and_test(tmp_path):
    path = tmp_path / "curve.png"
    drawn = train.plot_curve(str(path), curve(-0.6, 0.80, 0.86, 0.84), "t", best_epoch=2,
                             test={"pearson": 0.873}, baselines={"dev": 0.70, "test": 0.69})
    assert path.stat().st_size > 0
    labels = drawn["legend"]
    assert "train loss (KL)" in labels and "dev Pearson r" in labels
    assert "best dev epoch 2: r 0.860" in labels
    assert "word-overlap baseline (dev): r 0.700" in labels
    assert "test r 0.873 with epoch 2's parameters (word-overlap baseline 0.690)" in drawn["title"]
    # the untrained point would stretch the axis to -0.6: it is drawn at the edge instead
    lo, hi = drawn["dev_ylim"]
    assert drawn["start_clipped"] and any("epoch 0 (untrained): dev r -0.600" in x for x in labels)
    assert -0.6 < lo < 0.70 and hi > 0.86 and hi - lo < 0.3


def test_plot_keeps_a_close_start_on_the_axis(tmp_path):
    drawn = train.plot_curve(str(tmp_path / "c.png"), curve(0.78, 0.80, 0.86), "t", best_epoch=2,
                             start_label="loaded x.params")
    lo, hi = drawn["dev_ylim"]
    assert not drawn["start_clipped"] and lo < 0.78 and hi > 0.86
    assert not any("epoch 0" in x for x in drawn["legend"])


def test_dev_axis_without_training_covers_the_start():
    (lo, hi), clipped = train.dev_axis_limits(curve(0.5))
    assert not clipped and lo < 0.5 < hi


def test_vectors_of_another_size_name_the_fix(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train.main(["--data", MEDIUM, "--embed-size", "300", "--max-pairs", "2",
                    "--out", str(tmp_path), "--quiet"])
    err = capsys.readouterr().err
    assert "vectors.50d.txt" in err and "dimension 50" in err and "dim=300" in err
    assert "--embed-size 50" in err and "--word-embed none" in err
