"""Tests of the Tree-LSTM training script (examples/tree_lstm/train.py)."""
import json
import math
import os

import numpy as np
import pytest

from examples.tree_lstm import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLED = os.path.join(ROOT, "data", "sick_small")
SMALL = ["--data", BUNDLED, "--embed-size", "16", "--hidden-size", "8", "--sim-hidden", "6",
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
    params = str(tmp_path / "best.params")
    first = run(tmp_path, "a", "--max-pairs", "12", "--batch-size", "4", "--epochs", "2",
                "--save", params)
    assert os.path.isfile(params)
    again = run(tmp_path, "b", "--max-pairs", "12", "--epochs", "0", "--load", params)
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
