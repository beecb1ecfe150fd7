import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_report_header(config):  # pylint: disable=unused-argument
    import jitbatch
    mods = jitbatch.compiled_modules()
    return "jitbatch: %s" % ("compiled " + ", ".join(m.split(".")[-1] for m in mods) if mods
                             else "pure Python (no compiled module in use)")


def pytest_configure(config):  # pylint: disable=unused-argument
    # Pipelined flushes (config.pipeline) start where measured times say so: a
    # test that counts launches or flushes under 'auto' would depend on the
    # machine's speed. They are off here and on, with a fixed chunk size, in
    # tests/test_pipeline.py.
    import jitbatch
    jitbatch.config.pipeline = False
