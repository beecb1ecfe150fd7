#!/usr/bin/env python
"""Generate a synthetic, SICK-like semantic-relatedness data set.

The output has the preprocessed SICK layout read by
``examples/tree_lstm/data.py``::

    OUT/vocab.txt                    every token of every split, sorted, one per line
    OUT/{train,dev,test}/a.toks      whitespace-tokenised sentence per line
    OUT/{train,dev,test}/b.toks
    OUT/{train,dev,test}/a.parents   1-based dependency head per token, 0 = root
    OUT/{train,dev,test}/b.parents
    OUT/{train,dev,test}/sim.txt     relatedness score in [1, 5], one decimal
    OUT/vectors.<D>d.txt             optional (--vectors-dim D; default with --full):
                                     GloVe-format "pretrained" word vectors

How the data are made
---------------------
* Lexicon: nouns (each with a plural form), "-ing" verbs, adjectives and
  "-ly" adverbs built from random syllables, plus a closed class of real
  English function words (a, the, is, in, with, not, ...).  Content words are
  drawn with Zipf-Mandelbrot frequencies.
* Sentences come from a small dependency grammar shaped like SICK captions
  ("two dogs are running through a field", "there is a man playing a guitar"),
  so trees are projective with Stanford-style heads: the verb heads subject,
  auxiliary, object, prepositions and adverbs; prepositions head their noun;
  nouns head determiners and adjectives.  Lengths are resampled into [3, 30].
* Sentence b of a pair is a perturbation of sentence a of random strength:
  synonym swaps, word replacements, added or deleted modifiers, determiner
  changes, negation, moved prepositional phrases, or (for 8% of the pairs)
  an unrelated sentence.  a and b are swapped half of the time.
* Score: every word has a hidden "meaning" vector (synonyms are close).  A
  sentence's meaning is composed bottom-up over its dependency tree with a
  fixed child-sum recursion, ``h = tanh(A x_word + B sum(h_children))``, the
  same family of functions a child-sum Tree-LSTM computes.  The score is the
  cosine c of the two root vectors squashed into [1, 5] by
  ``1 + 4 exp(-((1 - c) / 0.5) ** 0.7)``, plus Gaussian noise (sd 0.2),
  clipped to [1, 5] and rounded to one decimal.  It is thus a learnable
  function of the two trees; the summary prints the correlation of the
  noise-free score with the written one (the ceiling a model can reach) and
  that of a word-overlap baseline.
* Vectors (optional): real GloVe vectors mean nothing for synthetic words, so
  ``--vectors-dim D`` writes a stand-in: a fixed random projection of each
  word's hidden meaning plus noise, covering ~98% of the vocabulary.

Split sizes
-----------
Default (``--pairs N``): 2/3 train, 1/6 dev, 1/6 test, so the bundled
``--pairs 600`` set is 400/100/100 -- a small test split gives a quick but
still usable evaluation (``data/sick_small``, the tests' data); the trainer's
default data ``data/sick_medium`` is ``--out data/sick_medium --pairs 3000
--seed 1 --vectors-dim 50`` (2000/500/500 with word vectors).  ``--full``
writes 9927 pairs split like SICK,
4500/500/4927, to ``data/sick_full`` (not committed; regenerate it).
``--split-style sick`` applies SICK's proportions to any ``--pairs``.

Output is byte-identical for the same arguments: all randomness comes from one
``numpy.random.Generator`` seeded with ``--seed`` and nothing depends on set
or hash ordering.
"""

import argparse
import math
import os
import sys

import numpy as np
from tqdm import tqdm

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO_ROOT, "data", "sick_small")
FULL_OUT = os.path.join(REPO_ROOT, "data", "sick_full")
DEFAULT_PAIRS = 600
SICK_SPLITS = (4500, 500, 4927)
SPLIT_NAMES = ("train", "dev", "test")
MIN_LEN, MAX_LEN = 3, 30

LATENT_DIM = 10
SCORE_NOISE = 0.2
VECTOR_NOISE = 0.3
VECTOR_OOV = 0.02
SCORE_TAU = 0.5
SCORE_POWER = 0.7

# --- closed-class words -----------------------------------------------------
DETS_SG = ("a", "the", "one", "this")
DETS_SG_P = (0.62, 0.30, 0.04, 0.04)
DETS_PL = ("two", "three", "some", "the", "several", "many", "four")
DETS_PL_P = (0.34, 0.12, 0.14, 0.22, 0.06, 0.06, 0.06)
PREPS = ("in", "on", "with", "near", "at", "into", "through", "by", "under",
         "from", "for", "of", "over", "behind", "along", "across", "around")
PREPS_P = np.array([20, 14, 12, 5, 6, 4, 4, 4, 3, 3, 3, 6, 3, 2, 2, 2, 2], dtype=float)
PREPS_P /= PREPS_P.sum()
AUX = {False: "is", True: "are"}
FUNCTION_WORDS = (DETS_SG + DETS_PL + PREPS
                  + ("is", "are", "not", "no", "and", "there"))

# --- syllables for synthetic words ------------------------------------------
ONSETS = ("b", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "z",
          "b", "d", "k", "l", "m", "n", "p", "r", "s", "t", "", "",
          "bl", "br", "ch", "cl", "cr", "dr", "fl", "fr", "gr", "pl", "pr", "sh", "sl",
          "sp", "st", "th", "tr")
VOWELS = ("a", "e", "i", "o", "u", "a", "e", "i", "o", "a", "ai", "ee", "oo", "ou")
CODAS = ("", "", "", "", "", "", "n", "r", "s", "t", "l", "m", "n", "r", "nd", "st", "ck", "ng")
ADJ_SUFFIXES = ("", "", "", "y", "ish", "ous", "ful", "en", "al", "ic")
SYLLABLE_P = {1: (1.0,), 2: (0.55, 0.45), 3: (0.3, 0.55, 0.15)}

# lexicon sizes (lemmas); nouns also get a plural form
N_NOUNS, N_VERBS, N_ADJS, N_ADVS = 1000, 450, 300, 80


class Node:
    """A word in a generated dependency tree (left/right dependents in surface order)."""

    __slots__ = ("word", "pos", "role", "lemma", "plural", "left", "right")

    def __init__(self, word, pos, role, lemma=None, plural=False):
        self.word = word
        self.pos = pos
        self.role = role
        self.lemma = lemma
        self.plural = plural
        self.left = []
        self.right = []

    def copy(self):
        new = Node(self.word, self.pos, self.role, self.lemma, self.plural)
        new.left = [c.copy() for c in self.left]
        new.right = [c.copy() for c in self.right]
        return new

    def nodes(self):
        """All nodes of the subtree (pre-order)."""
        out = [self]
        for child in self.left + self.right:
            out.extend(child.nodes())
        return out

    def children(self):
        return self.left + self.right


class Lexicon:
    """Synthetic words, their frequencies and hidden meaning vectors."""

    def __init__(self, rng):
        self.rng = rng
        used = set(FUNCTION_WORDS)
        self.lemmas = {
            "NOUN": [self._new_word(used, 1, 3, "") for _ in range(N_NOUNS)],
            "VERB": [self._new_word(used, 1, 2, "ing") for _ in range(N_VERBS)],
            "ADJ": [self._new_word(used, 1, 2, None) for _ in range(N_ADJS)],
            "ADV": [self._new_word(used, 1, 2, "ly") for _ in range(N_ADVS)],
        }
        self.plural_of = {}
        for noun in self.lemmas["NOUN"]:
            plural = noun + ("es" if noun.endswith(("s", "sh", "ch", "x", "z")) else "s")
            while plural in used:
                plural += "s"
            used.add(plural)
            self.plural_of[noun] = plural
        # Zipf-Mandelbrot sampling probabilities per part of speech
        self.probs = {}
        for pos, words in self.lemmas.items():
            ranks = np.arange(1, len(words) + 1, dtype=float)
            weights = 1.0 / (ranks + 2.7) ** 1.07
            self.probs[pos] = weights / weights.sum()
        # hidden meanings: synonym clusters ("concepts") share a centre
        self.vec = {}
        self.synonyms = {}
        for pos in ("NOUN", "VERB", "ADJ", "ADV"):
            words = self.lemmas[pos]
            order = rng.permutation(len(words))
            i = 0
            while i < len(words):
                size = int(rng.choice((1, 2, 3), p=(0.45, 0.38, 0.17)))
                members = [words[j] for j in order[i:i + size]]
                i += size
                centre = rng.normal(size=LATENT_DIM)
                for word in members:
                    self.vec[word] = centre + 0.3 * rng.normal(size=LATENT_DIM)
                    self.synonyms[word] = [w for w in members if w != word]
        plural_vec = 0.35 * rng.normal(size=LATENT_DIM)
        for noun, plural in self.plural_of.items():
            self.vec[plural] = self.vec[noun] + plural_vec
        negation = 2.5 * rng.normal(size=LATENT_DIM)
        scales = {"is": 0.1, "are": 0.1, "and": 0.2, "there": 0.1, "a": 0.15, "the": 0.15,
                  "one": 0.3, "this": 0.2, "some": 0.3, "several": 0.4, "many": 0.4}
        for word in FUNCTION_WORDS:
            if word == "not":
                self.vec[word] = negation
            elif word == "no":
                self.vec[word] = negation + 0.3 * rng.normal(size=LATENT_DIM)
            else:
                scale = scales.get(word, 0.6 if word in PREPS else 0.5)
                self.vec[word] = scale * rng.normal(size=LATENT_DIM)
        # composition h = tanh(A x + B sum(children))
        noise = rng.normal(size=(LATENT_DIM, LATENT_DIM)) / math.sqrt(LATENT_DIM)
        self.comp_a = 0.5 * (np.eye(LATENT_DIM) + 0.3 * noise)
        self.comp_b, _ = np.linalg.qr(rng.normal(size=(LATENT_DIM, LATENT_DIM)))

    def _syllable(self):
        rng = self.rng
        return (ONSETS[rng.integers(len(ONSETS))] + VOWELS[rng.integers(len(VOWELS))]
                + CODAS[rng.integers(len(CODAS))])

    def _new_word(self, used, lo, hi, suffix):
        while True:
            n = lo + int(self.rng.choice(hi - lo + 1, p=SYLLABLE_P[hi - lo + 1]))
            stem = "".join(self._syllable() for _ in range(n))
            if suffix is None:
                word = stem + ADJ_SUFFIXES[self.rng.integers(len(ADJ_SUFFIXES))]
            else:
                word = stem + suffix
            if len(word) >= 3 and word not in used:
                used.add(word)
                return word

    def sample(self, pos):
        words = self.lemmas[pos]
        return words[int(self.rng.choice(len(words), p=self.probs[pos]))]

    def uniform_other(self, pos, avoid):
        words = self.lemmas[pos]
        while True:
            word = words[int(self.rng.integers(len(words)))]
            if word != avoid:
                return word

    def meaning(self, node):
        """Child-sum composition of hidden meaning vectors (recursive; trees are shallow)."""
        child_sum = np.zeros(LATENT_DIM)
        for child in node.children():
            child_sum += self.meaning(child)
        return np.tanh(self.comp_a @ self.vec[node.word] + self.comp_b @ child_sum)


# --- grammar -------------------------------------------------------------------

def content_node(lex, pos, role, lemma=None, plural=False):
    lemma = lemma or lex.sample(pos)
    word = lex.plural_of[lemma] if plural else lemma
    return Node(word, pos, role, lemma=lemma, plural=plural)


def make_adj(lex):
    return content_node(lex, "ADJ", "amod")


def make_np(lex, rng, role, level=0, allow_pp=True, allow_clause=True):
    plural = bool(rng.random() < 0.3)
    noun = content_node(lex, "NOUN", role, plural=plural)
    if plural:
        if rng.random() < 0.8:
            noun.left.append(Node(DETS_PL[rng.choice(len(DETS_PL), p=DETS_PL_P)], "DET", "det"))
    else:
        noun.left.append(Node(DETS_SG[rng.choice(len(DETS_SG), p=DETS_SG_P)], "DET", "det"))
    r = rng.random()
    n_adj = 2 if r < 0.06 else (1 if r < 0.34 else 0)
    noun.left.extend(make_adj(lex) for _ in range(n_adj))
    if allow_pp and level < 2 and rng.random() < (0.19 if level == 0 else 0.12):
        noun.right.append(make_pp(lex, rng, level + 1))
    elif allow_clause and level == 0 and rng.random() < 0.07:
        noun.right.append(make_participle(lex, rng, level + 1))
    return noun


def make_pp(lex, rng, level):
    prep = Node(PREPS[rng.choice(len(PREPS), p=PREPS_P)], "ADP", "prep")
    prep.right.append(make_np(lex, rng, "pobj", level, allow_clause=False))
    return prep


def make_participle(lex, rng, level):
    """'... wearing a hat', '... playing in the park' attached to a noun."""
    verb = content_node(lex, "VERB", "partmod")
    if rng.random() < 0.6:
        verb.right.append(make_np(lex, rng, "dobj", level + 1, allow_clause=False))
    elif rng.random() < 0.6:
        verb.right.append(make_pp(lex, rng, level + 1))
    return verb


def make_sentence(lex, rng):
    if rng.random() < 0.12:
        # there is/are NP VERB-ing ...
        subj = make_np(lex, rng, "nsubj", allow_pp=False, allow_clause=False)
        root = Node(AUX[subj.plural], "AUX", "root")
        root.left.append(Node("there", "EXPL", "expl"))
        root.right.append(subj)
        subj.right.append(make_participle(lex, rng, 1))
        if rng.random() < 0.35:
            subj.right[-1].right.append(make_pp(lex, rng, 1))
        return root
    subj = make_np(lex, rng, "nsubj")
    plural = subj.plural
    if rng.random() < 0.08:
        subj.right.append(Node("and", "CC", "cc"))
        subj.right.append(make_np(lex, rng, "conj", level=1, allow_pp=False, allow_clause=False))
        plural = True
    verb = content_node(lex, "VERB", "root")
    verb.left.append(subj)
    verb.left.append(Node(AUX[plural], "AUX", "aux"))
    if rng.random() < 0.03:
        verb.left.append(Node("not", "PART", "neg"))
    if rng.random() < 0.6:
        verb.right.append(make_np(lex, rng, "dobj"))
    if rng.random() < 0.47:
        verb.right.append(make_pp(lex, rng, 1))
        if rng.random() < 0.2:
            verb.right.append(make_pp(lex, rng, 1))
    if rng.random() < 0.1:
        adv = content_node(lex, "ADV", "advmod")
        if rng.random() < 0.5:
            verb.right.insert(0, adv)
        else:
            verb.right.append(adv)
    if rng.random() < 0.04:
        move_pp_to_front(verb)
    return verb


def linearize(root):
    """(tokens, parents) with 1-based parent positions, 0 for the root."""
    order, heads = [], []

    def visit(node, head):
        for child in node.left:
            visit(child, node)
        order.append(node)
        heads.append(head)
        for child in node.right:
            visit(child, node)

    visit(root, None)
    position = {id(node): i + 1 for i, node in enumerate(order)}
    tokens = [node.word for node in order]
    parents = [0 if head is None else position[id(head)] for head in heads]
    return tokens, parents


def sentence_length(root):
    return len(root.nodes())


def make_good_sentence(lex, rng):
    while True:
        root = make_sentence(lex, rng)
        if MIN_LEN <= sentence_length(root) <= MAX_LEN:
            return root


# --- perturbations ---------------------------------------------------------------
# Each takes (lex, rng, root) and returns True when it changed something.

def _parent_map(root):
    parent = {}
    for node in root.nodes():
        for child in node.children():
            parent[id(child)] = node
    return parent


def _pick(rng, items):
    return items[int(rng.integers(len(items)))] if items else None


def op_synonym(lex, rng, root):
    cands = [n for n in root.nodes() if n.lemma and lex.synonyms[n.lemma]]
    node = _pick(rng, cands)
    if node is None:
        return False
    lemma = _pick(rng, lex.synonyms[node.lemma])
    node.lemma = lemma
    node.word = lex.plural_of[lemma] if node.plural else lemma
    return True


def op_replace(lex, rng, root):
    node = _pick(rng, [n for n in root.nodes() if n.lemma])
    if node is None:
        return False
    lemma = lex.uniform_other(node.pos, node.lemma) if rng.random() < 0.5 else lex.sample(node.pos)
    if lemma == node.lemma:
        return False
    node.lemma = lemma
    node.word = lex.plural_of[lemma] if node.plural else lemma
    return True


def op_add_modifier(lex, rng, root):
    nodes = root.nodes()
    choice = rng.random()
    if choice < 0.5:
        nouns = [n for n in nodes if n.pos == "NOUN"
                 and sum(c.pos == "ADJ" for c in n.left) < 2]
        noun = _pick(rng, nouns)
        if noun is None:
            return False
        noun.left.append(make_adj(lex))
        return True
    verbs = [n for n in nodes if n.pos == "VERB"]
    verb = _pick(rng, verbs)
    if verb is None:
        return False
    if choice < 0.75:
        verb.right.append(content_node(lex, "ADV", "advmod"))
    else:
        verb.right.append(make_pp(lex, rng, 1))
    return True


def op_delete_modifier(lex, rng, root):
    parent = _parent_map(root)
    cands = [n for n in root.nodes()
             if n.role in ("amod", "advmod") or (n.role == "prep" and id(n) in parent)]
    node = _pick(rng, cands)
    if node is None:
        return False
    head = parent[id(node)]
    if node in head.left:
        head.left = [c for c in head.left if c is not node]
    else:
        head.right = [c for c in head.right if c is not node]
    return True


def op_determiner(lex, rng, root):
    parent = _parent_map(root)
    dets = [n for n in root.nodes() if n.pos == "DET" and n.word != "no"]
    det = _pick(rng, dets)
    if det is None:
        return False
    pool = DETS_PL if parent[id(det)].plural else DETS_SG
    det.word = _pick(rng, [w for w in pool if w != det.word])
    return True


def op_negate(lex, rng, root):
    """Add or remove 'not' on a verb, or turn a subject's article into 'no'."""
    nodes = root.nodes()
    negs = [n for n in nodes if n.word in ("not", "no")]
    if negs:
        neg = _pick(rng, negs)
        if neg.word == "no":
            neg.word = "a" if neg.role == "det" and not _parent_map(root)[id(neg)].plural else "some"
            return True
        head = _parent_map(root)[id(neg)]
        head.left = [c for c in head.left if c is not neg]
        return True
    subjects = [n for n in nodes if n.role == "nsubj" and n.left and n.left[0].pos == "DET"]
    if subjects and (root.pos == "AUX" or rng.random() < 0.3):
        _pick(rng, subjects).left[0].word = "no"
        return True
    if root.pos == "VERB":
        aux = [i for i, c in enumerate(root.left) if c.role == "aux"]
        at = aux[0] + 1 if aux else len(root.left)
        root.left.insert(at, Node("not", "PART", "neg"))
        return True
    return False


def move_pp_to_front(verb):
    pps = [c for c in verb.right if c.role == "prep"]
    if not pps:
        return False
    pp = pps[-1]
    verb.right = [c for c in verb.right if c is not pp]
    verb.left.insert(0, pp)
    return True


def op_reorder(lex, rng, root):
    """Meaning-preserving reordering of sibling subtrees."""
    if root.pos == "VERB" and rng.random() < 0.5 and move_pp_to_front(root):
        return True
    def swappable(node):  # keep "X and Y" intact
        return [i for i, c in enumerate(node.right) if c.role not in ("cc", "conj")]

    heads = [n for n in root.nodes() if len(swappable(n)) >= 2]
    head = _pick(rng, heads)
    if head is None:
        return move_pp_to_front(root) if root.pos == "VERB" else False
    slots = swappable(head)
    i, j = (slots[int(k)] for k in rng.choice(len(slots), size=2, replace=False))
    head.right[i], head.right[j] = head.right[j], head.right[i]
    return True


LIGHT_OPS = (op_synonym, op_reorder, op_determiner, op_add_modifier, op_delete_modifier)
LIGHT_P = (0.38, 0.18, 0.14, 0.15, 0.15)
ALL_OPS = (op_synonym, op_replace, op_add_modifier, op_delete_modifier, op_determiner,
           op_negate, op_reorder)
MEDIUM_P = (0.18, 0.32, 0.12, 0.12, 0.06, 0.10, 0.10)
HEAVY_P = (0.05, 0.60, 0.10, 0.10, 0.03, 0.07, 0.05)


def perturb(lex, rng, a_root):
    """Sentence b for sentence a, at a random strength."""
    level = rng.random()
    if level < 0.08:
        return make_good_sentence(lex, rng)
    if level < 0.25:
        ops, probs, n_ops = ALL_OPS, HEAVY_P, int(rng.integers(2, 5))
    elif level < 0.62:
        ops, probs, n_ops = ALL_OPS, MEDIUM_P, int(rng.integers(1, 4))
    else:
        ops, probs, n_ops = LIGHT_OPS, LIGHT_P, int(rng.integers(1, 3))
    for _attempt in range(20):
        b_root = a_root.copy()
        done = 0
        for _ in range(4 * n_ops):
            if done == n_ops:
                break
            op = ops[int(rng.choice(len(ops), p=probs))]
            done += bool(op(lex, rng, b_root))
        if MIN_LEN <= sentence_length(b_root) <= MAX_LEN:
            return b_root
    return a_root.copy()


def squash(cosine):
    """Map the cosine of the two meaning vectors to [1, 5] (fixed, monotone, 5 at cosine 1)."""
    distance = max(1.0 - cosine, 0.0)
    return 1.0 + 4.0 * math.exp(-(distance / SCORE_TAU) ** SCORE_POWER)


def make_pair(lex, rng):
    a_root = make_good_sentence(lex, rng)
    b_root = perturb(lex, rng, a_root)
    if rng.random() < 0.5:
        a_root, b_root = b_root, a_root
    ha, hb = lex.meaning(a_root), lex.meaning(b_root)
    cosine = float(ha @ hb / (np.linalg.norm(ha) * np.linalg.norm(hb) + 1e-12))
    clean = squash(cosine)
    score = min(max(clean + SCORE_NOISE * rng.normal(), 1.0), 5.0)
    return linearize(a_root), linearize(b_root), clean, float("%.1f" % score)


# --- statistics --------------------------------------------------------------------

def tree_shape(parents):
    """(depth with leaf = 1, max number of children) of a parent list."""
    n = len(parents)
    kids = [0] * n
    for p in parents:
        if p:
            kids[p - 1] += 1
    depth = 0
    for i in range(n):
        d, v = 1, i
        while parents[v]:
            v = parents[v] - 1
            d += 1
        depth = max(depth, d)
    return depth, max(kids)


def pearson(x, y):
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    x, y = x - x.mean(), y - y.mean()
    denom = math.sqrt(float(x @ x) * float(y @ y))
    return float(x @ y) / denom if denom else 0.0


def compute_stats(splits, vocab, clean_scores):
    lengths, depths, max_kids = [], [], []
    scores, overlaps = [], []
    for pairs in splits.values():
        for (a_toks, a_par), (b_toks, b_par), score in pairs:
            for toks, par in ((a_toks, a_par), (b_toks, b_par)):
                lengths.append(len(toks))
                d, k = tree_shape(par)
                depths.append(d)
                max_kids.append(k)
            scores.append(score)
            sa, sb = set(a_toks), set(b_toks)
            overlaps.append(len(sa & sb) / len(sa | sb))
    lengths = np.array(lengths)
    depth_hist = {}
    for d in depths:
        depth_hist[d] = depth_hist.get(d, 0) + 1
    scores = np.array(scores)
    return {
        "splits": {name: len(pairs) for name, pairs in splits.items()},
        "sentences": int(lengths.size),
        "length_mean": float(lengths.mean()),
        "length_min": int(lengths.min()),
        "length_max": int(lengths.max()),
        "vocab_size": len(vocab),
        "depth_hist": dict(sorted(depth_hist.items())),
        "depth_median": float(np.median(depths)),
        "max_children": int(max(max_kids)),
        "frac_trees_4plus_children": float(np.mean(np.array(max_kids) >= 4)),
        "score_mean": float(scores.mean()),
        "score_std": float(scores.std()),
        "score_hist": [int(((scores >= lo) & ((scores < lo + 1) if lo < 4 else (scores <= 5))).sum())
                       for lo in (1, 2, 3, 4)],
        "pearson_clean_vs_score": pearson(clean_scores, scores),
        "pearson_overlap_vs_score": pearson(overlaps, scores),
    }


def print_stats(stats, out, file=sys.stdout):
    pr = lambda *a: print(*a, file=file)  # noqa: E731
    pr("wrote %s" % out)
    pr("  pairs per split : %s" % ", ".join("%s %d" % kv for kv in stats["splits"].items()))
    pr("  sentence length : mean %.2f, min %d, max %d (%d sentences)"
       % (stats["length_mean"], stats["length_min"], stats["length_max"], stats["sentences"]))
    pr("  vocabulary      : %d tokens" % stats["vocab_size"])
    pr("  tree depth      : median %g, histogram %s"
       % (stats["depth_median"], " ".join("%d:%d" % kv for kv in stats["depth_hist"].items())))
    pr("  max children    : %d (%.0f%% of trees have a node with >= 4 children)"
       % (stats["max_children"], 100 * stats["frac_trees_4plus_children"]))
    pr("  score           : mean %.3f, std %.3f, counts in [1,2) [2,3) [3,4) [4,5]: %s"
       % (stats["score_mean"], stats["score_std"], stats["score_hist"]))
    pr("  pearson r       : noise-free score %.3f (ceiling), word-overlap baseline %.3f"
       % (stats["pearson_clean_vs_score"], stats["pearson_overlap_vs_score"]))


# --- main --------------------------------------------------------------------------

def split_sizes(n_pairs, style):
    if style == "sick":
        fractions = [s / sum(SICK_SPLITS) for s in SICK_SPLITS]
    else:
        fractions = [4 / 6, 1 / 6, 1 / 6]
    if n_pairs == sum(SICK_SPLITS) and style == "sick":
        return list(SICK_SPLITS)
    train = int(round(n_pairs * fractions[0]))
    dev = int(round(n_pairs * fractions[1]))
    if n_pairs >= 3:
        dev = max(dev, 1)
        train = max(min(train, n_pairs - dev - 1), 1)
    test = n_pairs - train - dev
    return [train, dev, test]


def write_lines(path, lines):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for line in lines:
            f.write(line + "\n")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=None,
                        help="output directory (default data/sick_small, or data/sick_full "
                             "with --full; relative to the repository root)")
    parser.add_argument("--pairs", type=int, default=None,
                        help="number of sentence pairs (default %d, 9927 with --full)"
                        % DEFAULT_PAIRS)
    parser.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    parser.add_argument("--full", action="store_true",
                        help="SICK-sized set (9927 pairs, 4500/500/4927) in data/sick_full")
    parser.add_argument("--split-style", choices=("small", "sick"), default=None,
                        help="'small': 2/3, 1/6, 1/6 (default); 'sick': 4500/500/4927 "
                             "proportions (default with --full)")
    parser.add_argument("--vectors-dim", type=int, default=None,
                        help="also write OUT/vectors.<D>d.txt, GloVe-format vectors derived "
                             "from the hidden word meanings (default: 50 with --full, else none)")
    parser.add_argument("--quiet", action="store_true", help="do not print the summary")
    args = parser.parse_args(argv)
    if args.out is None:
        args.out = FULL_OUT if args.full else DEFAULT_OUT
    if args.pairs is None:
        args.pairs = sum(SICK_SPLITS) if args.full else DEFAULT_PAIRS
    if args.vectors_dim is None:
        args.vectors_dim = 50 if args.full else 0
    if args.vectors_dim < 0:
        parser.error("--vectors-dim must be >= 0")
    if args.split_style is None:
        args.split_style = "sick" if args.full else "small"
    if args.pairs < 1:
        parser.error("--pairs must be positive")
    return args


def generate(n_pairs, seed, split_style="small", progress=False):
    """Return ({split: [((a_toks, a_par), (b_toks, b_par), score), ...]}, vocab, clean_scores)."""
    rng = np.random.default_rng(seed)
    lex = Lexicon(rng)
    sizes = split_sizes(n_pairs, split_style)
    pairs, clean_scores = [], []
    for _ in tqdm(range(n_pairs), desc="pairs", unit="pair", disable=not progress):
        a, b, clean, score = make_pair(lex, rng)
        pairs.append((a, b, score))
        clean_scores.append(clean)
    splits, start = {}, 0
    for name, size in zip(SPLIT_NAMES, sizes):
        splits[name] = pairs[start:start + size]
        start += size
    vocab = sorted({tok for a, b, _ in pairs for tok in a[0] + b[0]})
    return splits, vocab, clean_scores, lex


def make_vectors(lex, vocab, dim, seed):
    """GloVe-style pretrained vectors for ``vocab``: a fixed random projection of
    each word's hidden meaning plus noise; about 2% of the words are left out,
    like real out-of-vocabulary words.  Uses its own random stream, so asking
    for vectors does not change the pairs.  Returns a list of text lines."""
    rng = np.random.default_rng([seed, 1])
    projection = rng.normal(size=(dim, LATENT_DIM)) / math.sqrt(LATENT_DIM)
    lines = []
    for token in vocab:
        noise = rng.normal(size=dim)
        if rng.random() < VECTOR_OOV:
            continue
        vec = 0.4 * (projection @ lex.vec[token] + VECTOR_NOISE * noise)
        lines.append(token + " " + " ".join("%.4f" % v for v in vec))
    return lines


def main(argv=None):
    """Command-line entry point; returns the statistics dict."""
    args = parse_args(argv)
    splits, vocab, clean_scores, lex = generate(args.pairs, args.seed, args.split_style,
                                                progress=args.full or args.pairs >= 2000)
    out = args.out
    for name, pairs in splits.items():
        split_dir = os.path.join(out, name)
        os.makedirs(split_dir, exist_ok=True)
        write_lines(os.path.join(split_dir, "a.toks"), [" ".join(a[0]) for a, _, _ in pairs])
        write_lines(os.path.join(split_dir, "b.toks"), [" ".join(b[0]) for _, b, _ in pairs])
        write_lines(os.path.join(split_dir, "a.parents"),
                    [" ".join(map(str, a[1])) for a, _, _ in pairs])
        write_lines(os.path.join(split_dir, "b.parents"),
                    [" ".join(map(str, b[1])) for _, b, _ in pairs])
        write_lines(os.path.join(split_dir, "sim.txt"), ["%.1f" % s for _, _, s in pairs])
    write_lines(os.path.join(out, "vocab.txt"), vocab)
    if args.vectors_dim:
        write_lines(os.path.join(out, "vectors.%dd.txt" % args.vectors_dim),
                    make_vectors(lex, vocab, args.vectors_dim, args.seed))
    stats = compute_stats(splits, vocab, clean_scores)
    if not args.quiet:
        print_stats(stats, out)
    return stats


if __name__ == "__main__":
    main()
