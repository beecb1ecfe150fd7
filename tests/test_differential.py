"""Batched vs plain per-sample Gluon: outputs and all parameter gradients, for every
model family, policy, and autograd mode."""
import zlib

import numpy as np
import pytest

from harness import check_model
from models import MODELS

POLICIES = ["auto", "depth", "agenda", "sequential"]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("train", [True, False], ids=["train", "infer"])
@pytest.mark.parametrize("model", sorted(MODELS))
def test_batched_equals_plain(model, train, policy):
    make, gen, apply = MODELS[model]
    rng = np.random.default_rng(zlib.crc32(("%s/%s/%s" % (model, train, policy)).encode()))
    st = check_model(make, gen, apply, rng, 6, train, policy)
    assert st["nodes"] > 0
    if policy != "sequential":
        # merging really happened: fewer launches than recorded nodes
        assert st["launches"] < st["nodes"], st
    else:
        assert st["launches"] == st["nodes"]
