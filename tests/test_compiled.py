"""The optional compiled modules (jitbatch/_compiled.py): a build that matches its
sources is used, a stale one is not (with a warning: then no build is used, they
share C layouts), compiled code reads and makes lazy arrays as Python does, and
the pure-Python sources pass the behavioural suites too."""
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest

import jitbatch
from jitbatch import _compiled

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUILT = [m for m in _compiled.MODULES if _compiled.extension_of(m)]
needs_build = pytest.mark.skipif(not BUILT, reason="no compiled module here (pure-Python install)")


def _run(code, env=None, cwd=ROOT):
    e = dict(os.environ, **(env or {}))
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=e, capture_output=True,
                          text=True, timeout=300)


def _fresh():
    """The built modules whose build record matches their source."""
    out = []
    for m in BUILT:
        with open(_compiled.source_of(m)[:-3] + ".built") as f:
            if f.read().strip() == _compiled.digest(_compiled.source_of(m)):
                out.append(m)
    return out


def test_every_current_build_is_used_and_nothing_else():
    fresh = _fresh()
    assert jitbatch.compiled_modules() == \
        ([] if _compiled.pure() or len(fresh) < len(BUILT) else fresh)


def _run_edited(tmp_path, name, addition, code):
    """Run ``code`` on a copy of the package whose file ``name`` has ``addition``
    appended (its build is then stale), with warnings shown."""
    shutil.copytree(os.path.join(ROOT, "jitbatch"), tmp_path / "jitbatch")
    edited = tmp_path / "jitbatch" / name
    edited.write_text(edited.read_text() + addition)
    return _run("import warnings; warnings.simplefilter('always')\n" + code,
                cwd=str(tmp_path), env={"PYTHONPATH": str(tmp_path), "JITBATCH_PURE": ""})


@needs_build
def test_a_stale_build_runs_from_source_with_a_warning(tmp_path):
    r = _run_edited(tmp_path, "schedule.py", "\nEDITED = True\n",
                    "import jitbatch, jitbatch.schedule as s\n"
                    "print(jitbatch.compiled_modules(), s.EDITED, s.__file__)")
    assert r.returncode == 0, r.stderr
    assert re.search(r"jitbatch: [^\n]*jitbatch/schedule\.py[^\n]* changed since", r.stderr)
    assert "pip install -e ." in r.stderr
    assert "True" in r.stdout and r.stdout.strip().endswith("schedule.py")
    # the compiled modules share C layouts: one stale build runs them all from source
    assert r.stdout.startswith("[]")


@needs_build
def test_pure_python_sources_pass_the_behavioural_suites():
    # the same differential (outputs and gradients vs plain Gluon), property and
    # Gluon-behaviour tests, with every module run from its .py source
    r = _run("import jitbatch; assert jitbatch.compiled_modules() == []",
             env={"JITBATCH_PURE": "1"})
    assert r.returncode == 0, r.stderr
    p = subprocess.run(
        [sys.executable, "-m", "pytest", "-x", "-p", "no:cacheprovider",
         "tests/test_differential.py", "tests/test_properties.py", "tests/test_gluon.py",
         "tests/test_robustness.py", "tests/test_granularity.py", "tests/test_pipeline.py",
         "tests/test_contract.py",
         # the memory-residency checks (run compiled too) are left out: they are about
         # the heap, not about what the sources compute
         "-k", "not resident_memory and not host_copies_of_constants"],
        cwd=ROOT, env=dict(os.environ, JITBATCH_PURE="1"), capture_output=True, text=True,
        timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    assert "jitbatch: pure Python" in p.stdout


@needs_build
def test_an_edited_pxd_makes_its_build_stale(tmp_path):
    # a .pxd gives compiled code its C layouts: a build from an older one is stale
    r = _run_edited(tmp_path, "graph.pxd", "\n# edited\n",
                    "import jitbatch\nprint(jitbatch.compiled_modules())")
    assert r.returncode == 0, r.stderr
    assert re.search(r"jitbatch: [^\n]*jitbatch/graph\.py[^\n]* changed since", r.stderr)
    assert r.stdout.strip() == "[]"


def _slots(a):
    return {name: getattr(a, name) for name in ("_node", "_k", "_shape", "_dtype", "_ctx",
                                                 "_view", "_value", "writable")}


def test_lazy_arrays_read_and_made_by_compiled_code_match_python():
    # compiled modules read LazyArray's fields at C offsets (gluon/_lazy.pxd) and
    # make lazy arrays in C: every field must be the one Python sees
    from mxnet import nd
    from jitbatch.gluon import lazy, meta
    from jitbatch.gluon.lazy import LazyArray

    class Producer(object):    # stands in for a pending node
        batch = None
        error = None

    node, ctx = Producer(), meta.device(nd.zeros((1,)).context)
    made = lazy.new_lazy(node, 1, (3, 4), np.float32, ctx, (1, 2, False))
    ref = LazyArray(node, 1, (3, 4), np.float32, ctx, (1, 2, False))
    assert type(made) is LazyArray and _slots(made) == _slots(ref)
    assert made.shape == (3, 4) and made.dtype is np.float32 and made.context is ctx
    assert meta.meta(made) == ((3, 4), np.float32, ctx)
    # a view of a view: row ranges of the producer, read through the C layout
    view = lazy.row_view(ref, slice(1, 2))
    assert type(view) is LazyArray and view._node is node and view._k == 1
    assert view._view == (2, 1, False) and view.shape == (1, 4)
    row = lazy.row_view(ref, -1)
    assert row._view == (3, 1, True) and row.shape == (4,)
    # the slot readers the records and gathers use, on arrays made both ways
    for a in (made, ref, view):
        assert lazy.node_of(a) is a._node and lazy.k_of(a) == a._k
        assert lazy.shape_of(a) == a._shape and lazy.view_of(a) == a._view
        assert lazy.value_of(a) is None and lazy.meta_of(a) == (a._shape, a._dtype, a._ctx)
    value = nd.ones((3, 4))
    ref._value = value
    assert lazy.value_of(ref) is value


def test_a_dropped_pending_lazy_array_computes_nothing():
    # MXNet's NDArray.__del__ frees the handle, which on a lazy array would force
    # the graph; LazyArray has no finalizer of its own (compiled: none at all)
    import mxnet as mx
    from mxnet import nd
    net = mx.gluon.nn.Dense(3, in_units=4)
    net.initialize()
    net.hybridize(dynamic_batch=True)
    jitbatch.flush()
    xs = [nd.ones((1, 4)) for _ in range(5)]     # made before recording: concrete
    jitbatch.reset_stats()
    kept = [net(x) for x in xs[:4]]
    dropped = net(xs[4])
    del dropped
    assert jitbatch.stats()["flushes"] == 0 and jitbatch.stats()["pending"] == 5
    assert np.allclose(kept[0].asnumpy(), kept[3].asnumpy())
    net.hybridize(active=False)


def test_gather_calls_match_mxnets_own():
    # compiled, the gathers' take/Concat/slice/reshape and the concrete-metadata
    # reads call MXNet's C API directly (gluon/_mxapi.pxd): the same arrays and
    # the same errors as MXNet's Python wrappers
    import mxnet as mx
    from mxnet import nd
    from jitbatch.gluon import _mxapi
    a = nd.array(np.arange(24, dtype=np.float32).reshape(6, 4))
    idx = nd.array([5, 0, 2], dtype="int64")
    cases = [(_mxapi.take(a, idx), nd.take(a, idx)),
             (_mxapi.concat([a, a[1:3]]), nd.concat(a, a[1:3], dim=0)),
             (_mxapi.rows(a, 2, 5), a[2:5]),
             (_mxapi.reshape(a, (3, 8)), a.reshape((3, 8)))]
    for got, want in cases:
        assert type(got) is nd.NDArray and got.writable
        assert got.shape == want.shape and got.dtype == want.dtype
        np.testing.assert_array_equal(got.asnumpy(), want.asnumpy())
    view = _mxapi.rows(a, 0, 2)
    view[:] = 7                                  # a view: writes reach the source
    assert (a[:2].asnumpy() == 7).all()
    assert _mxapi.concrete_meta(a) == ((6, 4), np.float32, (1, 0))
    assert _mxapi.concrete_shape(nd.zeros((5,))) == (5,)
    with pytest.raises(mx.base.MXNetError, match="Concat|concat|shape"):
        _mxapi.concat([a, nd.zeros((2, 5))]).asnumpy()


def test_the_sources_run_without_cython_installed():
    # Cython is a build requirement only: from source, without it, jitbatch
    # imports and merges as usual (the sources only ask cython.compiled)
    r = _run("import sys; sys.modules['cython'] = None\n"
             "import jitbatch, numpy as np\n"
             "from mxnet import nd, gluon\n"
             "assert jitbatch.compiled_modules() == []\n"
             "net = gluon.nn.Dense(2, in_units=3); net.initialize()\n"
             "net.hybridize(dynamic_batch=True, policy='agenda')\n"
             "xs = [nd.ones((1, 3)) * i for i in range(4)]\n"
             "ys = [net(x) for x in xs]\n"
             "got = np.concatenate([y.asnumpy() for y in ys])\n"
             "assert jitbatch.stats()['launches'] == 1, jitbatch.stats()\n"
             "net.hybridize(active=False)\n"
             "want = np.concatenate([net(x).asnumpy() for x in xs])\n"
             "assert np.allclose(got, want), (got, want)\n"
             "print('ok')", env={"JITBATCH_PURE": "1"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "ok"
