"""Tests of the Tree-LSTM example's data layer and of the SICK-like generator."""
import filecmp
import importlib.util
import os

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from examples.tree_lstm import data as D

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUNDLED = os.path.join(ROOT, "data", "sick_small")
MEDIUM = os.path.join(ROOT, "data", "sick_medium")
GENERATOR = os.path.join(ROOT, "scripts", "make_sick_like.py")
WHERE = "train/a.parents line 17"


def load_generator():
    spec = importlib.util.spec_from_file_location("make_sick_like", GENERATOR)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------------------
# trees
# ---------------------------------------------------------------------------

def check_tree(root, parents):
    nodes = list(root.postorder())
    assert len(nodes) == root.size() == len(parents)
    assert sorted(n.idx for n in nodes) == list(range(len(parents)))
    seen = set()
    for node in nodes:  # children strictly before parents
        assert all(c.idx in seen for c in node.children)
        assert [c.idx for c in node.children] == sorted(c.idx for c in node.children)
        assert node.height == (1 + max(c.height for c in node.children) if node.children else 0)
        seen.add(node.idx)
    assert nodes[-1] is root
    assert root.depth() == root.height + 1
    assert root.to_parents() == list(parents)


def test_build_tree_heads_before_and_after_dependents():
    # "a man is playing a guitar": playing(4) heads man(2), is(3), guitar(6)
    parents = [2, 4, 4, 0, 6, 4]
    root = D.build_tree(parents)
    assert root.idx == 3
    assert [c.idx for c in root.children] == [1, 2, 5]
    assert root.size() == 6 and root.depth() == 3 and root.height == 2
    assert [n.idx for n in root.postorder()] == [0, 1, 2, 4, 5, 3]
    check_tree(root, parents)


def test_single_token_tree():
    root = D.build_tree([0])
    assert (root.idx, root.children, root.size(), root.depth(), root.height) == (0, [], 1, 1, 0)


@st.composite
def random_parents(draw):
    n = draw(st.integers(1, 40))
    order = draw(st.permutations(range(n)))
    parents = [0] * n
    for k in range(1, n):  # attach each node to one placed before it in a random order
        head = order[draw(st.integers(0, k - 1))]
        parents[order[k]] = head + 1
    return parents


@settings(max_examples=60, deadline=None)
@given(random_parents())
def test_build_tree_any_order(parents):
    check_tree(D.build_tree(parents), parents)


@pytest.mark.parametrize("root_first", [True, False])
def test_deep_chain(root_first):
    n = 2000
    if root_first:  # token k's head is token k - 1
        parents = [0] + list(range(1, n))
    else:  # token k's head is token k + 1
        parents = list(range(2, n + 1)) + [0]
    root = D.build_tree(parents)
    assert root.size() == n and root.depth() == n and root.height == n - 1
    order = [node.idx for node in root.postorder()]
    assert order == (list(range(n - 1, -1, -1)) if root_first else list(range(n)))
    assert root.to_parents() == parents


@pytest.mark.parametrize("parents, pattern", [
    ([], r"^train/a\.parents line 17: empty line"),
    ([2, 3, 1], r"line 17: no root: no token has parent index 0 \(tokens 1 -> 2 -> 3 -> 1 form a cycle\)"),
    ([0, 1, 0, 3, 0], r"line 17: several roots: tokens 1, 3, 5 all have parent index 0"),
    ([0, 7, 1], r"line 17: token 2 has parent index 7, which is out of range.*between 1 and 3"),
    ([0, -1], r"line 17: token 2 has parent index -1, which is out of range"),
    ([0, 2, 1], r"line 17: token 2 is its own parent"),
    ([0, 3, 4, 2, 1], r"line 17: cycle: tokens 2 -> 3 -> 4 -> 2 .*never reach the root \(token 1\)"),
    ([0, "x"], r"line 17: token 2: parent index 'x' is not an integer"),
    ([0, 1.5], r"line 17: token 2: parent index 1\.5 is not an integer"),
])
def test_build_tree_errors(parents, pattern):
    with pytest.raises(ValueError, match=pattern):
        D.build_tree(parents, where=WHERE)


def test_build_tree_error_without_where():
    with pytest.raises(ValueError, match=r"^several roots"):
        D.build_tree([0, 0])


# ---------------------------------------------------------------------------
# reading a split
# ---------------------------------------------------------------------------

SPLIT = {
    "a.toks": ["a man is playing a guitar", "dogs run", "the cat sleeps"],
    "b.toks": ["a man is playing", "two dogs are running", "a cat is sleeping here"],
    "a.parents": ["2 4 4 0 6 4", "2 0", "2 3 0"],
    "b.parents": ["2 4 4 0", "2 4 4 0", "2 4 4 0 4"],
    "sim.txt": ["4.5", "3.8", "5"],
}


def write_split(split_dir, overrides=None):
    os.makedirs(split_dir, exist_ok=True)
    content = dict(SPLIT, **(overrides or {}))
    for name, lines in content.items():
        if lines is None:
            continue
        with open(os.path.join(split_dir, name), "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
    return str(split_dir)


def test_read_split_happy_path(tmp_path):
    pairs = D.read_split(write_split(tmp_path / "train"))
    assert len(pairs) == 3
    first = pairs[0]
    assert first.a_toks == ["a", "man", "is", "playing", "a", "guitar"]
    assert first.b_toks == ["a", "man", "is", "playing"]
    assert first.a_tree.idx == 3 and first.a_tree.size() == 6
    assert first.b_tree.to_parents() == [2, 4, 4, 0]
    assert [p.score for p in pairs] == [4.5, 3.8, 5.0]
    assert first.a_ids is None


def test_read_split_with_vocab_and_encode(tmp_path):
    split = write_split(tmp_path / "train")
    vocab = D.build_vocab(D.read_split(split))
    assert vocab.idx_to_token[:2] == ["<unk>", "<pad>"]
    pairs = D.read_split(split, vocab=vocab)
    a_ids, b_ids = D.encode(pairs[1], vocab)
    assert a_ids.dtype == np.int32 and b_ids.dtype == np.int32
    assert vocab.to_tokens(a_ids.tolist()) == ["dogs", "run"]
    np.testing.assert_array_equal(pairs[1].a_ids, a_ids)
    np.testing.assert_array_equal(pairs[1].b_ids, b_ids)


def test_read_split_missing_file(tmp_path):
    split = write_split(tmp_path / "dev", {"sim.txt": None})
    with pytest.raises(FileNotFoundError, match=r"missing file .*dev.sim\.txt.*must contain a\.toks, b\.toks"):
        D.read_split(split)
    with pytest.raises(FileNotFoundError, match=r"does not exist"):
        D.read_split(str(tmp_path / "nowhere"))


def test_read_split_mismatched_line_counts(tmp_path):
    split = write_split(tmp_path / "train", {"b.toks": SPLIT["b.toks"] + ["one more"]})
    with pytest.raises(ValueError, match=r"a\.toks has 3 lines but .*b\.toks has 4 lines"):
        D.read_split(split)


def test_read_split_token_parent_mismatch(tmp_path):
    split = write_split(tmp_path / "train", {"a.parents": ["2 4 4 0 6 4", "0", "2 3 0"]})
    with pytest.raises(ValueError,
                       match=r"line 2: .*a\.toks has 2 tokens but .*a\.parents has 1 parent indices"):
        D.read_split(split)


@pytest.mark.parametrize("bad, pattern", [
    ("abc", r"sim\.txt line 2: score 'abc' is not a number"),
    ("5.5", r"sim\.txt line 2: score '5\.5' is outside \[1, 5\]"),
    ("0.9", r"sim\.txt line 2: score '0\.9' is outside \[1, 5\]"),
    ("nan", r"sim\.txt line 2: score 'nan' is outside"),
])
def test_read_split_bad_score(tmp_path, bad, pattern):
    split = write_split(tmp_path / "train", {"sim.txt": ["4.5", bad, "5"]})
    with pytest.raises(ValueError, match=pattern):
        D.read_split(split)


def test_read_split_bad_tree_names_file_and_line(tmp_path):
    split = write_split(tmp_path / "train", {"b.parents": ["2 4 4 0", "2 4 4 0", "2 4 4 0 0"]})
    with pytest.raises(ValueError, match=r"train.b\.parents line 3: several roots: tokens 4, 5"):
        D.read_split(split)


def test_read_split_non_integer_parent(tmp_path):
    split = write_split(tmp_path / "train", {"a.parents": ["2 4 4 0 6 4", "2 x", "2 3 0"]})
    with pytest.raises(ValueError, match=r"a\.parents line 2: parent index 'x' is not an integer"):
        D.read_split(split)


def test_load_dataset_with_vocab_file(tmp_path):
    for name in ("train", "dev", "test"):
        write_split(tmp_path / name)
    write_split(tmp_path / "dev", {"a.toks": ["a woman is playing a flute", "dogs run", "the cat sleeps"]})
    data, vocab = D.load_dataset(str(tmp_path))
    assert vocab["woman"] == 0  # not in train, no vocabulary file: unknown
    (tmp_path / "vocab.txt").write_text("woman\nflute\nman\n\n", encoding="utf-8")
    data, vocab = D.load_dataset(str(tmp_path))
    assert set(data) == {"train", "dev", "test"}
    assert vocab["woman"] > 1 and vocab["flute"] > 1
    assert all(p.a_ids is not None and len(p.a_ids) == len(p.a_toks)
               for pairs in data.values() for p in pairs)
    assert (data["dev"][0].a_ids != 0).all()
    _, vocab_no_file = D.load_dataset(str(tmp_path), vocab_file=None)
    assert vocab_no_file["woman"] == 0
    with pytest.raises(FileNotFoundError, match="data directory"):
        D.load_dataset(str(tmp_path / "missing"))


def test_load_bundled_dataset():
    data, vocab = D.load_dataset(BUNDLED)
    assert {k: len(v) for k, v in data.items()} == {"train": 400, "dev": 100, "test": 100}
    assert len(vocab) == len(D.read_vocab_file(os.path.join(BUNDLED, "vocab.txt"))) + 2
    for pairs in data.values():
        for p in pairs:
            assert (p.a_ids != 0).all() and (p.b_ids != 0).all()
            assert 1.0 <= p.score <= 5.0


# ---------------------------------------------------------------------------
# target distribution
# ---------------------------------------------------------------------------

@st.composite
def class_count_and_score(draw):
    k = draw(st.integers(2, 10))
    y = draw(st.one_of(st.floats(1.0, float(k), allow_nan=False),
                       st.integers(1, k).map(float)))
    return k, y


@settings(max_examples=200, deadline=None)
@given(class_count_and_score())
def test_target_distribution_properties(ky):
    k, y = ky
    p = D.target_distribution(y, num_classes=k)
    assert p.shape == (k,) and p.dtype == np.float32
    assert (p >= 0).all() and np.count_nonzero(p) <= 2
    assert abs(float(p.sum()) - 1.0) < 1e-6
    assert abs(float((p.astype(np.float64) * np.arange(1, k + 1)).sum()) - y) < 1e-5 * k


def test_target_distribution_examples():
    np.testing.assert_allclose(D.target_distribution(1.0), [1, 0, 0, 0, 0])
    np.testing.assert_allclose(D.target_distribution(5.0), [0, 0, 0, 0, 1])
    np.testing.assert_allclose(D.target_distribution(3.0), [0, 0, 1, 0, 0])
    np.testing.assert_allclose(D.target_distribution(3.6), [0, 0, 0.4, 0.6, 0], atol=1e-6)
    for bad in (0.99, 5.01, float("nan")):
        with pytest.raises(ValueError, match="outside"):
            D.target_distribution(bad)


# ---------------------------------------------------------------------------
# word vectors
# ---------------------------------------------------------------------------

@pytest.fixture
def small_vocab(tmp_path):
    return D.build_vocab(D.read_split(write_split(tmp_path / "train")))


def write_vectors(path, rows, header=None):
    with open(path, "w", encoding="utf-8") as f:
        if header:
            f.write(header + "\n")
        for word, vec in rows:
            f.write(word + " " + " ".join("%g" % v for v in vec) + "\n")
    return str(path)


def test_load_word_vectors(tmp_path, small_vocab):
    rows = [("man", [0.1, 0.2, 0.3, 0.4]), ("guitar", [1, 2, 3, 4]),
            ("absent", [9, 9, 9, 9]), ("dogs", [-1, 0, 1, 0])]
    path = write_vectors(tmp_path / "glove.txt", rows)
    matrix, missing = D.load_word_vectors(path, small_vocab, 4, return_missing=True)
    assert matrix.shape == (len(small_vocab), 4) and matrix.dtype == np.float32
    for word, vec in rows:
        if word in small_vocab.token_to_idx:
            np.testing.assert_allclose(matrix[small_vocab[word]], vec, rtol=1e-6)
    assert "absent" not in small_vocab.token_to_idx
    assert set(missing) == set(small_vocab.idx_to_token) - {"man", "guitar", "dogs"}
    np.testing.assert_array_equal(matrix[small_vocab["<pad>"]], 0)
    others = [small_vocab[w] for w in missing if w != "<pad>"]
    assert np.abs(matrix[others]).max() <= 0.05 and np.abs(matrix[others]).min() > 0
    again = D.load_word_vectors(path, small_vocab, 4)
    np.testing.assert_array_equal(again, matrix)  # fixed seed


def test_load_word_vectors_word2vec_header(tmp_path, small_vocab):
    path = write_vectors(tmp_path / "w2v.txt", [("cat", [1, 2])], header="1 2")
    matrix = D.load_word_vectors(path, small_vocab, 2)
    np.testing.assert_allclose(matrix[small_vocab["cat"]], [1, 2])


def test_load_word_vectors_dimension_mismatch(tmp_path, small_vocab):
    path = write_vectors(tmp_path / "glove.txt", [("man", [0.1, 0.2, 0.3, 0.4])])
    with pytest.raises(ValueError, match=r"vectors have dimension 4 .*but dim=5 was requested"):
        D.load_word_vectors(path, small_vocab, 5)
    ragged = write_vectors(tmp_path / "ragged.txt", [("man", [1, 2, 3]), ("dogs", [1, 2])])
    with pytest.raises(ValueError, match=r"ragged\.txt line 2: word 'dogs' has 2 values, expected 3"):
        D.load_word_vectors(ragged, small_vocab, 3)
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match="contains no word vectors"):
        D.load_word_vectors(str(empty), small_vocab, 3)
    with pytest.raises(FileNotFoundError):
        D.load_word_vectors(str(tmp_path / "nope.txt"), small_vocab, 3)


def test_vocab_order_and_lookup():
    vocab = D.Vocab({"b": 2, "a": 2, "c": 5, "<unk>": 9, "d": 1})
    # specials first, then by decreasing count, ties alphabetical; a counted
    # special token keeps its special place
    assert vocab.idx_to_token == ["<unk>", "<pad>", "c", "a", "b", "d"]
    assert vocab.token_to_idx == {t: i for i, t in enumerate(vocab.idx_to_token)}
    assert len(vocab) == 6 and "a" in vocab and "zzz" not in vocab
    assert vocab["c"] == 2 and vocab["zzz"] == 0
    assert vocab[["d", "zzz", "a"]] == [5, 0, 3]
    assert vocab.to_tokens([2, 0]) == ["c", "<unk>"] and vocab.to_tokens(3) == "a"
    same = D.Vocab({"c": 3, "a": 1, "b": 1, "d": 0})
    other = D.Vocab({"c": 3, "b": 2, "a": 1, "d": 0})
    assert same.digest() == vocab.digest() and other.digest() != vocab.digest()


def test_build_vocab_counts_vocab_file_once(tmp_path):
    split = write_split(tmp_path / "train")
    vocab_file = tmp_path / "vocab.txt"
    vocab_file.write_text("zebra\nman\nzebra\n", encoding="utf-8")
    vocab = D.build_vocab(D.read_split(split), str(vocab_file))
    # counts: 'a' 4, 'is' 3, 'man' 2 + 1 from the file, then the count-2 words, then
    # the count-1 words ('zebra' too: a file's repeated line counts once)
    assert vocab.idx_to_token == [
        "<unk>", "<pad>", "a", "is", "man", "cat", "dogs", "playing", "are", "guitar", "here",
        "run", "running", "sleeping", "sleeps", "the", "two", "zebra"]


def test_glove_tokens_with_spaces(tmp_path):
    # glove.840B.300d has tokens with spaces: the last dim fields are the vector
    vocab = D.Vocab({". . .": 1, "at home": 1, "man": 1, "home": 1})
    rows = [(". . .", [1, 2, 3]), ("man", [4, 5, 6]), ("at home", [7, 8, 9]),
            ("the man", [9, 9, 9]), ("home", [0.5, 0.25, -1])]
    path = write_vectors(tmp_path / "glove.txt", rows)
    matrix, missing = D.load_word_vectors(path, vocab, 3, return_missing=True)
    for word, vec in rows:
        if word in vocab:
            np.testing.assert_allclose(matrix[vocab[word]], vec)
    assert set(missing) == {"<unk>", "<pad>"}   # 'the man' is its own token, not 'man'
    # a file whose first line has a spaced token still has dimension 3
    assert D.vector_file_dim(path) == 3
    with pytest.raises(ValueError, match=r"vectors have dimension 3 .*but dim=4"):
        D.load_word_vectors(path, vocab, 4)


def test_word_vector_value_errors(tmp_path, small_vocab):
    path = tmp_path / "bad.txt"
    path.write_text("man 1 2 x\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"bad\.txt line 1: word 'man' has the value 'x', which "
                                         r"is not a number"):
        D.load_word_vectors(str(path), small_vocab, 3)


def test_vector_file_dim_and_discovery(tmp_path):
    assert D.vector_file_dim(write_vectors(tmp_path / "glove.a.txt", [("x", [1, 2])])) == 2
    assert D.vector_file_dim(write_vectors(tmp_path / "vectors.5d.txt", [], header="10 5")) == 5
    (tmp_path / "empty.txt").write_text("\n")
    assert D.vector_file_dim(str(tmp_path / "empty.txt")) is None
    (tmp_path / "notes.txt").write_text("x 1 2\n")
    assert D.find_vector_files(str(tmp_path)) == [str(tmp_path / "glove.a.txt"),
                                                  str(tmp_path / "vectors.5d.txt")]
    assert D.find_vector_files(str(tmp_path / "missing")) == []


def test_word_vector_cache(tmp_path, small_vocab, monkeypatch):
    rows = [("man", [0.1, 0.2, 0.3]), ("dogs", [1, 2, 3])]
    path = write_vectors(tmp_path / "glove.txt", rows)
    cache_dir = tmp_path / "data"
    cache_dir.mkdir()
    lines = []
    first = D.load_word_vectors(path, small_vocab, 3, cache_dir=str(cache_dir), log=lines.append)
    cache = D.vector_cache_file(path, str(cache_dir))
    assert os.path.isfile(cache) and os.path.dirname(cache) == str(cache_dir / ".vectors_cache")
    assert "read" in lines[-1] and "cached in " + cache in lines[-1]

    scans = []
    real_scan = D._scan_vectors

    def counting_scan(*args, **kwargs):
        scans.append(args[0])
        return real_scan(*args, **kwargs)
    monkeypatch.setattr(D, "_scan_vectors", counting_scan)
    again = D.load_word_vectors(path, small_vocab, 3, cache_dir=str(cache_dir), log=lines.append)
    np.testing.assert_array_equal(again, first)
    assert scans == [] and "from the cache" in lines[-1]     # the source was not read

    # a changed source (size and mtime), another vocabulary, another dim: read again
    write_vectors(tmp_path / "glove.txt", rows + [("cat", [7, 7, 7])])
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10 ** 9))
    changed = D.load_word_vectors(path, small_vocab, 3, cache_dir=str(cache_dir))
    np.testing.assert_allclose(changed[small_vocab["cat"]], [7, 7, 7])
    assert len(scans) == 1
    D.load_word_vectors(path, small_vocab, 3, cache_dir=str(cache_dir))
    assert len(scans) == 1                                    # the new cache is used
    bigger = D.Vocab(dict.fromkeys(small_vocab.idx_to_token[2:] + ["zebra"], 1))
    D.load_word_vectors(path, bigger, 3, cache_dir=str(cache_dir))
    assert len(scans) == 2
    # one cache file per source file, whatever the vocabulary
    assert os.listdir(cache_dir / ".vectors_cache") == [os.path.basename(cache)]


def test_word_vector_cache_not_writable(tmp_path, small_vocab):
    path = write_vectors(tmp_path / "glove.txt", [("man", [1, 2])])
    blocker = tmp_path / "data"
    blocker.write_text("a file where the cache directory would go")
    lines = []
    matrix = D.load_word_vectors(path, small_vocab, 2, cache_dir=str(blocker), log=lines.append)
    np.testing.assert_allclose(matrix[small_vocab["man"]], [1, 2])
    assert "not cached" in lines[-1]


def test_word_overlap():
    pair = D.Pair("a man is here".split(), "a man runs".split(), None, None, 3.0)
    assert D.word_overlap(pair) == pytest.approx(2 / 5)


# ---------------------------------------------------------------------------
# generator
# ---------------------------------------------------------------------------

def generated_files(out):
    names = ["vocab.txt"] + [os.path.join(s, f) for s in ("train", "dev", "test") for f in D.SPLIT_FILES]
    assert all(os.path.isfile(os.path.join(out, n)) for n in names)
    return names


def test_generator_is_deterministic(tmp_path):
    gen = load_generator()
    outs = {}
    for label, seed in (("first", 1), ("second", 1), ("other", 2)):
        outs[label] = str(tmp_path / label)
        gen.main(["--out", outs[label], "--pairs", "40", "--seed", str(seed), "--quiet"])
    names = generated_files(outs["first"])
    _, mismatch, errors = filecmp.cmpfiles(outs["first"], outs["second"], names, shallow=False)
    assert mismatch == [] and errors == []
    _, mismatch, _ = filecmp.cmpfiles(outs["first"], outs["other"], names, shallow=False)
    assert len(mismatch) == len(names)


def test_generator_vectors(tmp_path):
    gen = load_generator()
    plain, with_vectors = str(tmp_path / "plain"), str(tmp_path / "vectors")
    gen.main(["--out", plain, "--pairs", "40", "--seed", "3", "--quiet"])
    gen.main(["--out", with_vectors, "--pairs", "40", "--seed", "3", "--vectors-dim", "8", "--quiet"])
    names = generated_files(plain)
    _, mismatch, errors = filecmp.cmpfiles(plain, with_vectors, names, shallow=False)
    assert mismatch == [] and errors == []  # vectors use their own random stream
    assert not os.path.exists(os.path.join(plain, "vectors.8d.txt"))
    _, vocab = D.load_dataset(with_vectors)
    matrix, missing = D.load_word_vectors(os.path.join(with_vectors, "vectors.8d.txt"), vocab, 8,
                                          return_missing=True)
    assert matrix.shape == (len(vocab), 8)
    assert len(set(missing) - {"<unk>", "<pad>"}) <= 0.1 * len(vocab)


def test_bundled_set_is_reproducible(tmp_path):
    gen = load_generator()
    out = str(tmp_path / "regen")
    gen.main(["--out", out, "--pairs", "600", "--seed", "0", "--quiet"])
    names = generated_files(BUNDLED)
    match, mismatch, errors = filecmp.cmpfiles(BUNDLED, out, names, shallow=False)
    assert mismatch == [] and errors == [], "regenerate with: python scripts/make_sick_like.py"


#: how data/sick_medium (the trainer's default data) was made
MEDIUM_ARGS = ["--pairs", "3000", "--seed", "1", "--vectors-dim", "50"]


def test_bundled_medium_set_is_reproducible(tmp_path):
    out = str(tmp_path / "regen")
    load_generator().main(["--out", out, "--quiet"] + MEDIUM_ARGS)
    names = generated_files(MEDIUM) + ["vectors.50d.txt"]
    match, mismatch, errors = filecmp.cmpfiles(MEDIUM, out, names, shallow=False)
    assert mismatch == [] and errors == [], \
        "regenerate with: python scripts/make_sick_like.py --out data/sick_medium " + \
        " ".join(MEDIUM_ARGS)


def test_split_sizes():
    gen = load_generator()
    assert gen.split_sizes(600, "small") == [400, 100, 100]
    assert gen.split_sizes(9927, "sick") == [4500, 500, 4927]
    assert sum(gen.split_sizes(1000, "sick")) == 1000
    assert all(n >= 1 for n in gen.split_sizes(3, "small"))


def test_cli_defaults():
    gen = load_generator()
    small = gen.parse_args([])
    assert (small.out, small.pairs, small.seed, small.split_style) == (gen.DEFAULT_OUT, 600, 0, "small")
    assert small.out.endswith(os.path.join("data", "sick_small"))
    full = gen.parse_args(["--full"])
    assert (full.out, full.pairs, full.split_style) == (gen.FULL_OUT, 9927, "sick")
    assert (small.vectors_dim, full.vectors_dim) == (0, 50)
    assert full.out.endswith(os.path.join("data", "sick_full"))


def sick_like_stats(data_dir):
    data, vocab = D.load_dataset(data_dir)
    lengths, depths, max_children, scores = [], [], [], []
    for pairs in data.values():
        for p in pairs:
            for toks, tree in ((p.a_toks, p.a_tree), (p.b_toks, p.b_tree)):
                lengths.append(len(toks))
                depths.append(tree.depth())
                max_children.append(max(len(n.children) for n in tree.postorder()))
            scores.append(p.score)
    return np.array(lengths), np.array(depths), np.array(max_children), np.array(scores), vocab


@pytest.mark.parametrize("which", ["generated", "bundled"])
def test_generated_statistics_are_sick_like(tmp_path, which):
    if which == "generated":
        out = str(tmp_path / "gen")
        stats = load_generator().main(["--out", out, "--pairs", "300", "--seed", "7", "--quiet"])
        assert stats["splits"] == {"train": 200, "dev": 50, "test": 50}
    else:
        out = BUNDLED
    lengths, depths, max_children, scores, vocab = sick_like_stats(out)
    assert 8 <= lengths.mean() <= 11
    assert lengths.min() >= 3 and lengths.max() <= 30
    assert max_children.max() >= 4
    assert 3 <= np.median(depths) <= 7
    assert np.mean((depths >= 3) & (depths <= 7)) > 0.9
    assert 3.0 <= scores.mean() <= 4.2 and 0.7 <= scores.std() <= 1.4
    assert ((scores >= 1) & (scores <= 5)).all()
    assert len(vocab) > 300
    if which == "generated":
        assert stats["length_mean"] == pytest.approx(lengths.mean())
        assert stats["max_children"] == max_children.max()
