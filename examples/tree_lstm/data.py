"""Data layer for the child-sum Tree-LSTM semantic-relatedness example.

The model is the one of Tai, Socher & Manning (2015), "Improved Semantic
Representations From Tree-Structured Long Short-Term Memory Networks", trained
on SICK sentence pairs.  This module only deals with data:

* :class:`Tree` / :func:`build_tree` -- dependency trees from parent-index lists;
* :func:`read_split` / :func:`load_dataset` -- the preprocessed SICK directory
  layout used by the usual Tree-LSTM code bases::

      <data_dir>/vocab-cased.txt or vocab.txt   (optional, one token per line)
      <data_dir>/<split>/a.toks      whitespace-tokenised sentence per line
      <data_dir>/<split>/b.toks
      <data_dir>/<split>/a.parents   1-based parent index per token, 0 = root
      <data_dir>/<split>/b.parents
      <data_dir>/<split>/sim.txt     relatedness score in [1, 5] per line

* :class:`Vocab` and :func:`load_word_vectors` -- the vocabulary and GloVe-format
  word vectors (filtered to the vocabulary and cached beside the data);
* :func:`target_distribution` -- the sparse target distribution over the
  score classes used as the training target in the paper.

It needs numpy only (tqdm for the optional progress bar), not MXNet.

Conventions: token positions in error messages are 1-based (as in the
``*.parents`` files), ``Tree.idx`` is 0-based.
"""

import collections
import hashlib
import io
import itertools
import json
import math
import os
import tempfile
import time

import numpy as np

__all__ = [
    "Tree", "build_tree", "Pair", "read_split", "read_vocab_file",
    "find_vocab_file", "build_vocab", "load_dataset", "encode",
    "Vocab", "load_word_vectors", "vector_file_dim", "vector_cache_file", "find_vector_files",
    "word_overlap", "target_distribution", "SPLIT_FILES", "UNK", "PAD",
]

#: Files every split directory must contain.
SPLIT_FILES = ("a.toks", "b.toks", "a.parents", "b.parents", "sim.txt")
#: Vocabulary files looked for in the data directory, in order of preference.
VOCAB_FILES = ("vocab-cased.txt", "vocab.txt")
UNK = "<unk>"
PAD = "<pad>"
MIN_SCORE, MAX_SCORE = 1.0, 5.0


# ---------------------------------------------------------------------------
# Trees
# ---------------------------------------------------------------------------

class Tree:
    """A node of a dependency tree.

    Attributes
    ----------
    idx : int
        0-based position of the node's token in the sentence.
    children : list of Tree
        Dependents, ordered by token position when built by :func:`build_tree`.
    height : int
        Cached at construction: 0 for a leaf, otherwise 1 + the largest child
        height.  It is the bottom-up "level" of the node: every child has a
        strictly smaller height, so all nodes of equal height can be evaluated
        together.  ``depth() == height + 1``.  Trees are meant to be immutable
        after construction; mutate ``children`` and ``height`` goes stale.
    """

    __slots__ = ("idx", "children", "height")

    def __init__(self, idx, children=None):
        self.idx = int(idx)
        self.children = list(children) if children else []
        self.height = (1 + max(c.height for c in self.children)) if self.children else 0

    def postorder(self):
        """Yield every node of the subtree, children (left to right) before parents.

        Iterative, so arbitrarily deep trees are fine.
        """
        stack = [(self, False)]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                yield node
            else:
                stack.append((node, True))
                for child in reversed(node.children):
                    stack.append((child, False))

    def size(self):
        """Number of nodes in the subtree rooted here."""
        count = 0
        stack = [self]
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children)
        return count

    def depth(self):
        """Number of nodes on the longest downward path from here (a leaf has depth 1).

        Recomputed from the structure (does not trust the cached ``height``).
        """
        best = {}
        for node in self.postorder():
            best[id(node)] = 1 + max((best[id(c)] for c in node.children), default=0)
        return best[id(self)]

    def to_parents(self):
        """Inverse of :func:`build_tree`: the 1-based parent list (0 for this node).

        Requires the ``idx`` values of the subtree to be exactly ``0..size()-1``.
        """
        n = self.size()
        parents = [None] * n
        stack = [(self, 0)]
        while stack:
            node, parent = stack.pop()
            if not 0 <= node.idx < n or parents[node.idx] is not None:
                raise ValueError("tree indices are not a permutation of 0..%d" % (n - 1))
            parents[node.idx] = parent
            stack.extend((c, node.idx + 1) for c in node.children)
        return parents

    def __repr__(self):
        return "Tree(idx=%d, size=%d, height=%d)" % (self.idx, self.size(), self.height)


def _find_cycle(parents):
    """Return the 1-based tokens of one parent-pointer cycle, or None.

    ``parents`` is the validated 1-based parent list (0 = root, no self loops).
    The cycle is rotated to start at its smallest token, so the result is
    deterministic.
    """
    n = len(parents)
    state = [0] * n  # 0 = unseen, 1 = on the current walk, 2 = finished
    for start in range(n):
        if state[start]:
            continue
        path = []
        v = start
        while v >= 0 and state[v] == 0:
            state[v] = 1
            path.append(v)
            v = parents[v] - 1
        if v >= 0 and state[v] == 1:
            cycle = path[path.index(v):]
            k = cycle.index(min(cycle))
            return [t + 1 for t in cycle[k:] + cycle[:k]]
        for u in path:
            state[u] = 2
    return None


def build_tree(parents, where=""):
    """Build a dependency tree from 1-based parent indices and return its root.

    Parameters
    ----------
    parents : sequence of int
        ``parents[i]`` is the 1-based position of the head of token ``i + 1``,
        or 0 if token ``i + 1`` is the root.  Tokens may appear in any order
        relative to their heads.
    where : str
        Location used to prefix error messages, e.g. ``"train/a.parents line 17"``.

    Raises
    ------
    ValueError
        For an empty list, a non-integer or out-of-range parent index, a token
        that is its own parent, no root, several roots, or a cycle.  The
        message names ``where``, the offending (1-based) tokens and values.
    """
    prefix = "%s: " % where if where else ""
    n = len(parents)
    if n == 0:
        raise ValueError(prefix + "empty line: expected at least one parent index")

    checked = []
    for i, p in enumerate(parents):
        if isinstance(p, (bool, np.bool_)) or not isinstance(p, (int, np.integer)):
            raise ValueError("%stoken %d: parent index %r is not an integer" % (prefix, i + 1, p))
        p = int(p)
        if p < 0 or p > n:
            raise ValueError(
                "%stoken %d has parent index %d, which is out of range: it must be 0 "
                "(root) or between 1 and %d (the number of tokens)" % (prefix, i + 1, p, n))
        if p == i + 1:
            raise ValueError("%stoken %d is its own parent (parent index %d)" % (prefix, i + 1, p))
        checked.append(p)

    roots = [i + 1 for i, p in enumerate(checked) if p == 0]
    if not roots:
        cycle = _find_cycle(checked)
        raise ValueError(
            "%sno root: no token has parent index 0 (tokens %s form a cycle)"
            % (prefix, " -> ".join(map(str, cycle + cycle[:1]))))
    if len(roots) > 1:
        raise ValueError(
            "%sseveral roots: tokens %s all have parent index 0, exactly one is allowed"
            % (prefix, ", ".join(map(str, roots))))
    cycle = _find_cycle(checked)
    if cycle is not None:
        raise ValueError(
            "%scycle: tokens %s follow each other's parent links in a loop and never "
            "reach the root (token %d)"
            % (prefix, " -> ".join(map(str, cycle + cycle[:1])), roots[0]))

    child_lists = [[] for _ in range(n)]
    for i, p in enumerate(checked):
        if p:
            child_lists[p - 1].append(i)  # ascending token order
    root = roots[0] - 1
    # Pre-order walk, then build in reverse pre-order: children before parents.
    order = []
    stack = [root]
    while stack:
        v = stack.pop()
        order.append(v)
        stack.extend(child_lists[v])
    nodes = [None] * n
    for v in reversed(order):
        nodes[v] = Tree(v, [nodes[c] for c in child_lists[v]])
    return nodes[root]


# ---------------------------------------------------------------------------
# Reading the SICK layout
# ---------------------------------------------------------------------------

class Pair:
    """One sentence pair.

    ``a_ids`` / ``b_ids`` are int32 index arrays filled in by :func:`read_split`
    when it is given a vocabulary (and by :func:`load_dataset`); otherwise None.
    """

    __slots__ = ("a_toks", "b_toks", "a_tree", "b_tree", "score", "a_ids", "b_ids")

    def __init__(self, a_toks, b_toks, a_tree, b_tree, score, a_ids=None, b_ids=None):
        self.a_toks = a_toks
        self.b_toks = b_toks
        self.a_tree = a_tree
        self.b_tree = b_tree
        self.score = score
        self.a_ids = a_ids
        self.b_ids = b_ids

    def __repr__(self):
        return "Pair(a=%r, b=%r, score=%g)" % (" ".join(self.a_toks), " ".join(self.b_toks),
                                                self.score)


def _read_lines(path):
    with io.open(path, encoding="utf-8") as f:
        text = f.read()
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # trailing newline of the last line
    return [line.rstrip("\r") for line in lines]


def _parse_parents(line, where):
    values = []
    for field in line.split():
        try:
            values.append(int(field))
        except ValueError:
            raise ValueError("%s: parent index %r is not an integer" % (where, field)) from None
    return values


def _parse_score(line, where):
    text = line.strip()
    try:
        value = float(text)
    except ValueError:
        raise ValueError("%s: score %r is not a number" % (where, text)) from None
    if not MIN_SCORE <= value <= MAX_SCORE:  # also rejects nan
        raise ValueError("%s: score %r is outside [%g, %g]" % (where, text, MIN_SCORE, MAX_SCORE))
    return value


def read_split(split_dir, vocab=None):
    """Read one split directory (``train``, ``dev`` or ``test``) into a list of :class:`Pair`.

    If ``vocab`` (a :class:`Vocab`) is given, each pair's ``a_ids`` and
    ``b_ids`` are filled in with :func:`encode`.

    Raises
    ------
    FileNotFoundError
        If one of :data:`SPLIT_FILES` is missing.
    ValueError
        For files with different numbers of lines, a sentence whose token count
        differs from its parent count, a malformed tree (see :func:`build_tree`)
        or a score that is not a number in [1, 5].
    """
    paths = {name: os.path.join(split_dir, name) for name in SPLIT_FILES}
    for name in SPLIT_FILES:
        if not os.path.isfile(paths[name]):
            problem = "" if os.path.isdir(split_dir) else " (the directory %s does not exist)" % split_dir
            raise FileNotFoundError(
                "missing file %s%s: a SICK split directory must contain %s"
                % (paths[name], problem, ", ".join(SPLIT_FILES)))
    lines = {name: _read_lines(paths[name]) for name in SPLIT_FILES}

    first = SPLIT_FILES[0]
    for name in SPLIT_FILES[1:]:
        if len(lines[name]) != len(lines[first]):
            raise ValueError(
                "line counts differ: %s has %d lines but %s has %d lines"
                % (paths[first], len(lines[first]), paths[name], len(lines[name])))

    pairs = []
    for k in range(len(lines[first])):
        lineno = k + 1
        sides = []
        for side in ("a", "b"):
            toks_name, par_name = side + ".toks", side + ".parents"
            toks = lines[toks_name][k].split()
            where = "%s line %d" % (paths[par_name], lineno)
            parents = _parse_parents(lines[par_name][k], where)
            if len(toks) != len(parents):
                raise ValueError(
                    "line %d: %s has %d tokens but %s has %d parent indices"
                    % (lineno, paths[toks_name], len(toks), paths[par_name], len(parents)))
            sides.append((toks, build_tree(parents, where=where)))
        score = _parse_score(lines["sim.txt"][k], "%s line %d" % (paths["sim.txt"], lineno))
        pair = Pair(sides[0][0], sides[1][0], sides[0][1], sides[1][1], score)
        if vocab is not None:
            pair.a_ids, pair.b_ids = encode(pair, vocab)
        pairs.append(pair)
    return pairs


# ---------------------------------------------------------------------------
# Vocabulary
# ---------------------------------------------------------------------------

def read_vocab_file(path):
    """Tokens of a vocabulary file (one per line; blank lines skipped, first occurrence kept)."""
    seen = set()
    tokens = []
    for line in _read_lines(path):
        token = line.strip()
        if token and token not in seen:
            seen.add(token)
            tokens.append(token)
    return tokens


def find_vocab_file(data_dir):
    """Path of ``vocab-cased.txt`` or else ``vocab.txt`` in ``data_dir``, or None."""
    for name in VOCAB_FILES:
        path = os.path.join(data_dir, name)
        if os.path.isfile(path):
            return path
    return None


class Vocab:
    """Token <-> index mapping of the example (what the trainer needs of a vocabulary).

    Index 0 is ``<unk>`` (every unknown token maps to it), index 1 ``<pad>``; the
    other tokens follow by decreasing count, ties in alphabetical order, so the
    same corpus always gives the same indices.

    ``vocab[token]`` is an index, ``vocab[list_of_tokens]`` a list of indices;
    :meth:`to_tokens` maps back; ``idx_to_token`` (list) and ``token_to_idx``
    (dict) are the two directions.
    """

    def __init__(self, counts, unknown_token=UNK, padding_token=PAD):
        self.unknown_token = unknown_token
        self.padding_token = padding_token
        specials = [unknown_token, padding_token]
        rest = sorted((t for t in counts if t not in specials), key=lambda t: (-counts[t], t))
        self.idx_to_token = specials + rest
        self.token_to_idx = {t: i for i, t in enumerate(self.idx_to_token)}

    def __len__(self):
        return len(self.idx_to_token)

    def __contains__(self, token):
        return token in self.token_to_idx

    def __getitem__(self, tokens):
        if isinstance(tokens, str):
            return self.token_to_idx.get(tokens, 0)
        return [self.token_to_idx.get(t, 0) for t in tokens]

    def to_tokens(self, indices):
        """Tokens of ``indices`` (an int or a sequence of ints)."""
        if isinstance(indices, (int, np.integer)):
            return self.idx_to_token[indices]
        return [self.idx_to_token[i] for i in indices]

    def digest(self):
        """SHA-256 of the index -> token list: equal digests, equal vocabularies
        (it keys the word-vector cache)."""
        return hashlib.sha256("\n".join(self.idx_to_token).encode("utf-8")).hexdigest()

    def __repr__(self):
        return "Vocab(%d tokens)" % len(self)


def build_vocab(pairs, vocab_file=None):
    """A :class:`Vocab` over the tokens of ``pairs`` (normally the train split).

    Tokens listed in ``vocab_file`` are added with one extra count each, so
    dev/test words present in the standard vocabulary file do not become
    ``<unk>``.  Special tokens: ``<unk>`` (index 0) and ``<pad>`` (index 1).
    """
    counts = collections.Counter(tok for p in pairs for tok in p.a_toks + p.b_toks)
    if vocab_file is not None:
        counts.update(read_vocab_file(vocab_file))
    return Vocab(counts)


def word_overlap(pair):
    """Jaccard overlap of the two sentences' token sets: the baseline a model
    should beat (scripts/make_sick_like.py prints its Pearson r with the scores)."""
    a, b = set(pair.a_toks), set(pair.b_toks)
    return len(a & b) / len(a | b) if a or b else 0.0


def encode(pair, vocab):
    """``(a_ids, b_ids)``: numpy int32 index arrays of the pair's tokens (unknown -> ``<unk>``)."""
    a_ids = np.asarray(vocab[list(pair.a_toks)], dtype=np.int32).reshape(-1)
    b_ids = np.asarray(vocab[list(pair.b_toks)], dtype=np.int32).reshape(-1)
    return a_ids, b_ids


def load_dataset(data_dir, splits=("train", "dev", "test"), vocab_file="auto"):
    """Read every split of ``data_dir`` and build the vocabulary.

    Parameters
    ----------
    data_dir : str
        Directory holding one sub-directory per split.
    splits : sequence of str
        Split names; the vocabulary is built from ``"train"`` (or from the
        first split when there is no ``"train"``).
    vocab_file : "auto", None or str
        ``"auto"``: use ``vocab-cased.txt`` / ``vocab.txt`` from ``data_dir`` if
        present; None: ignore any vocabulary file; a path: use that file.

    Returns
    -------
    (dict, Vocab)
        ``{split: [Pair, ...]}`` with ``a_ids``/``b_ids`` filled in, and the vocabulary.
    """
    if not os.path.isdir(data_dir):
        raise FileNotFoundError(
            "data directory %s does not exist: it must contain one sub-directory per split "
            "(%s), each with %s" % (data_dir, ", ".join(splits), ", ".join(SPLIT_FILES)))
    if vocab_file == "auto":
        vocab_file = find_vocab_file(data_dir)
    elif vocab_file is not None and not os.path.isfile(vocab_file):
        raise FileNotFoundError("vocabulary file %s does not exist" % vocab_file)
    data = {name: read_split(os.path.join(data_dir, name)) for name in splits}
    vocab_split = "train" if "train" in data else splits[0]
    vocab = build_vocab(data[vocab_split], vocab_file)
    for pairs in data.values():
        for pair in pairs:
            pair.a_ids, pair.b_ids = encode(pair, vocab)
    return data, vocab


# ---------------------------------------------------------------------------
# Word vectors
# ---------------------------------------------------------------------------

#: sub-directory of the cache directory (normally the data directory) holding
#: word vectors already filtered to a vocabulary
VECTOR_CACHE_DIR = ".vectors_cache"
#: lines read ahead to tell the file's vector dimension (see :func:`_file_dim`)
_DIM_PROBE_LINES = 20


def _is_int(text):
    try:
        int(text)
        return True
    except ValueError:
        return False


def _vector_lines(f):
    """``(line number, line)`` of the non-blank lines of a binary file, without
    line ends and trailing spaces."""
    for lineno, raw in enumerate(f, start=1):
        line = raw.rstrip(b"\r\n").rstrip(b" ")
        if line:
            yield lineno, line


def _file_dim(probe, path, dim):
    """The vector dimension of a GloVe-format file from its first lines
    ``probe`` (header excluded): the most common number of fields after the
    first, the first line's on a tie.  A token with spaces in it (as in
    glove.840B.300d) adds fields to its own line only, so it cannot decide it."""
    counts = collections.Counter(line.count(b" ") for _, line in probe)
    top = max(counts.values())
    for lineno, line in probe:
        if counts[line.count(b" ")] == top:
            file_dim = line.count(b" ")
            if file_dim != dim:
                word = line.split(b" ", 1)[0].decode("utf-8", "replace")
                raise ValueError(
                    "%s: vectors have dimension %d (line %d, word %r), but dim=%d was "
                    "requested; pass the file's dimension (--embed-size %d) or another file"
                    % (path, file_dim, lineno, word, dim, file_dim))
            return file_dim
    raise AssertionError("unreachable: probe is not empty")


def vector_file_dim(path):
    """Dimension of the vectors in a GloVe-format text file (a word2vec-style
    ``count dim`` header line is read as such), or None for a file without vectors."""
    with io.open(path, "rb") as f:
        probe = []
        for lineno, line in _vector_lines(f):
            fields = line.split(b" ")
            if not probe and lineno == 1 and len(fields) == 2 and all(_is_int(x) for x in fields):
                return int(fields[1])
            probe.append((lineno, line))
            if len(probe) == _DIM_PROBE_LINES:
                break
    if not probe:
        return None
    counts = collections.Counter(line.count(b" ") for _, line in probe)
    top = max(counts.values())
    return next(line.count(b" ") for _, line in probe if counts[line.count(b" ")] == top)


def _scan_vectors(path, wanted, dim, progress=False):
    """``{token: float32 vector}`` for the tokens of ``wanted`` found in the
    GloVe-format file ``path`` (the first line of a token counts).

    A line's LAST ``dim`` fields are its vector and everything before them,
    spaces included, its token: glove.840B.300d has tokens such as ``". . ."``.
    """
    found = {}
    size = os.path.getsize(path)
    bar = None
    if progress:
        from tqdm import tqdm  # pylint: disable=import-outside-toplevel
        bar = tqdm(total=size, desc="word vectors", unit="B", unit_scale=True, leave=False,
                   dynamic_ncols=True)
    try:
        with io.open(path, "rb") as f:
            lines = _vector_lines(f)
            probe = []
            for lineno, line in lines:
                fields = line.split(b" ")
                if not probe and lineno == 1 and len(fields) == 2 and all(_is_int(x) for x in fields):
                    if int(fields[1]) != dim:
                        raise ValueError(
                            "%s: header line says the vectors have dimension %s, but dim=%d "
                            "was requested" % (path, fields[1].decode(), dim))
                    continue
                probe.append((lineno, line))
                if len(probe) == _DIM_PROBE_LINES:
                    break
            if not probe:
                raise ValueError("%s contains no word vectors" % path)
            _file_dim(probe, path, dim)
            done = 0
            for k, (lineno, line) in enumerate(itertools.chain(probe, lines)):
                n_values = line.count(b" ")
                if n_values == dim:   # the common case: a token without spaces
                    token = line[:line.index(b" ")].decode("utf-8", "replace")
                elif n_values > dim:
                    token = line.rsplit(b" ", dim)[0].decode("utf-8", "replace")
                else:
                    token = line.split(b" ", 1)[0].decode("utf-8", "replace")
                    if token in wanted:
                        raise ValueError("%s line %d: word %r has %d values, expected %d"
                                         % (path, lineno, token, n_values, dim))
                    continue  # a short line of a word we do not need: not our problem
                if token in wanted and token not in found:
                    values = line.rsplit(b" ", dim)[1:]
                    try:
                        found[token] = np.array(values, dtype=np.float32)
                    except ValueError:
                        bad = next(v for v in values if not _is_float(v))
                        raise ValueError("%s line %d: word %r has the value %r, which is not "
                                         "a number" % (path, lineno, token,
                                                       bad.decode("utf-8", "replace"))) from None
                    if not np.isfinite(found[token]).all():
                        bad = values[int(np.argmin(np.isfinite(found[token])))]
                        raise ValueError("%s line %d: word %r has the value %r, which is not "
                                         "a finite number" % (path, lineno, token,
                                                              bad.decode("utf-8", "replace")))
                if bar is not None and k % 4096 == 0:
                    pos = f.tell()
                    bar.update(pos - done)
                    done = pos
    finally:
        if bar is not None:
            bar.close()
    return found


def _is_float(text):
    try:
        float(text)
        return True
    except ValueError:
        return False


def find_vector_files(directory):
    """GloVe-format files in ``directory``: ``glove*.txt`` and ``vectors*.txt``
    (what scripts/make_sick_like.py writes), sorted."""
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    return sorted(os.path.join(directory, n) for n in names
                  if n.endswith(".txt") and n.startswith(("glove", "vectors"))
                  and os.path.isfile(os.path.join(directory, n)))


def vector_cache_file(path, cache_dir):
    """Where :func:`load_word_vectors` caches the vectors of ``path``: one file
    per source file in ``cache_dir/.vectors_cache`` (a new vocabulary or a
    changed source replaces it)."""
    source = os.path.abspath(path)
    tag = hashlib.sha256(source.encode("utf-8")).hexdigest()[:12]
    return os.path.join(cache_dir, VECTOR_CACHE_DIR, "%s.%s.npz" % (os.path.basename(source), tag))


def _cache_key(path, vocab, dim):
    st = os.stat(path)
    return json.dumps({"source": os.path.abspath(path), "size": st.st_size,
                       "mtime_ns": st.st_mtime_ns, "vocab": vocab.digest(), "dim": dim},
                      sort_keys=True)


def _read_cache(cache_file, key, vocab):
    """``{token: vector}`` from ``cache_file`` if it was written for ``key``, else None."""
    try:
        with np.load(cache_file, allow_pickle=False) as z:
            if str(z["key"]) != key:
                return None
            rows, vectors = z["rows"], z["vectors"]
    except (OSError, KeyError, ValueError):
        return None  # absent or unreadable: scan the source again
    return {vocab.idx_to_token[int(r)]: vectors[i] for i, r in enumerate(rows)}


def _write_cache(cache_file, key, vocab, found):
    rows = np.array(sorted(vocab.token_to_idx[t] for t in found), dtype=np.int64)
    vectors = np.stack([found[vocab.idx_to_token[r]] for r in rows]) if len(rows) else \
        np.zeros((0, 0), np.float32)
    os.makedirs(os.path.dirname(cache_file), exist_ok=True)
    # written whole under a temporary name, then renamed: a reader never sees half a file
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(cache_file), suffix=".npz.tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, key=np.array(key), rows=rows, vectors=vectors)
        os.replace(tmp, cache_file)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def load_word_vectors(path, vocab, dim, seed=0, init_scale=0.05, return_missing=False,
                      cache_dir=None, progress=False, log=None):
    """Load GloVe-format vectors for the words of ``vocab``.

    The text file has one ``word v1 ... v<dim>`` line per word (an optional
    word2vec-style ``count dim`` header line is accepted).  The last ``dim``
    fields of a line are the vector and the fields before them, joined by
    spaces, the word (glove.840B.300d has words with spaces in them).  Only
    the lines of words in ``vocab`` are kept, so multi-GB files need not fit
    in memory.

    With ``cache_dir`` (the trainer passes the data directory) the kept
    vectors are saved to :func:`vector_cache_file`, keyed by the source's
    path, size and modification time, the vocabulary's :meth:`Vocab.digest`
    and ``dim``; a later call with the same key reads that instead of the
    source.  A cache that cannot be written is reported through ``log`` and
    skipped.

    Words missing from the file get vectors drawn uniformly from
    ``[-init_scale, init_scale]`` with ``numpy.random.default_rng(seed)``
    (row ``i`` always gets the ``i``-th draw, so the result does not depend on
    which other words are missing); the padding token's row is zero.

    ``progress``: a tqdm bar over the bytes read; ``log``: a callable given one
    line saying where the vectors came from.

    Returns
    -------
    numpy.ndarray of float32, shape ``(len(vocab), dim)``; with
    ``return_missing=True`` a tuple ``(matrix, missing_tokens)``.

    Raises
    ------
    FileNotFoundError
        If ``path`` does not exist.
    ValueError
        If the file's vectors are not ``dim``-dimensional (or a kept line has
        fewer values), a kept value is not a number, or the file holds no
        vectors at all.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError("word vector file %s does not exist" % path)
    found = None
    cache_file = key = None
    if cache_dir is not None:
        cache_file = vector_cache_file(path, cache_dir)
        key = _cache_key(path, vocab, dim)
        found = _read_cache(cache_file, key, vocab)
        if found is not None and log is not None:
            log("word vectors: %d of %d words from the cache %s (%s unchanged)"
                % (len(found), len(vocab), cache_file, path))
    if found is None:
        t0 = time.perf_counter()
        found = _scan_vectors(path, set(vocab.idx_to_token), dim, progress=progress)
        where = ""
        if cache_file is not None:
            try:
                _write_cache(cache_file, key, vocab, found)
                where = "; cached in %s" % cache_file
            except OSError as err:
                where = "; not cached (%s: %s)" % (cache_file, err)
        if log is not None:
            log("word vectors: read %s (%.1f MB) in %.1f s, %d of %d words found%s"
                % (path, os.path.getsize(path) / 1e6, time.perf_counter() - t0, len(found),
                   len(vocab), where))

    rng = np.random.default_rng(seed)
    matrix = rng.uniform(-init_scale, init_scale, size=(len(vocab), dim)).astype(np.float32)
    for token, vec in found.items():
        matrix[vocab.token_to_idx[token]] = vec
    pad = getattr(vocab, "padding_token", None)
    if pad is not None and pad in vocab.token_to_idx and pad not in found:
        matrix[vocab.token_to_idx[pad]] = 0.0
    if return_missing:
        missing = [tok for tok in vocab.idx_to_token if tok not in found]
        return matrix, missing
    return matrix


# ---------------------------------------------------------------------------
# Targets
# ---------------------------------------------------------------------------

def target_distribution(score, num_classes=5):
    """Sparse target distribution ``p`` over classes 1..K for a score in [1, K].

    With ``y = score`` and ``f = floor(y)`` (Tai et al. 2015, section 5.2), the
    1-based class ``f + 1`` gets ``y - f`` and class ``f`` gets ``f - y + 1``;
    at ``y == K`` class K gets 1.  Returned 0-based: ``p[f] = y - f``,
    ``p[f - 1] = f - y + 1``.  ``p`` sums to 1 and ``sum(p * [1..K]) == y``.

    Returns numpy float32 of shape ``(num_classes,)``.
    """
    k = int(num_classes)
    if k < 2:
        raise ValueError("num_classes must be at least 2, got %r" % (num_classes,))
    y = float(score)
    if not 1.0 <= y <= k:  # also rejects nan
        raise ValueError("score %r is outside [1, %d]" % (score, k))
    p = np.zeros(k, dtype=np.float32)
    f = int(math.floor(y))
    if f == k:
        p[k - 1] = 1.0
    else:
        p[f] = y - f
        p[f - 1] = f - y + 1.0
    return p
