import os
import sys
import threading

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")

#: seconds after which a test is hung (pytest.ini's faulthandler_timeout dumps
#: every thread's stack a minute before): its process ends there, failed, rather than
#: hanging until CI's limit, as a deadlocked MXNet engine would make it
HUNG = 360
_STDERR = [2]   # the terminal's stderr, taken in pytest_configure (not captured then)


def _hung(name):
    msg = "\n%s ran %d s: hung, its test process ends here\n" % (name, HUNG)
    os.write(_STDERR[0], msg.encode())
    os._exit(3)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # pylint: disable=unused-argument
    timer = threading.Timer(HUNG, _hung, args=(item.nodeid,))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def pytest_report_header(config):  # pylint: disable=unused-argument
    import jitbatch
    mods = jitbatch.compiled_modules()
    return "jitbatch: %s" % ("compiled " + ", ".join(m.split(".")[-1] for m in mods) if mods
                             else "pure Python (no compiled module in use)")


def pytest_configure(config):  # pylint: disable=unused-argument
    _STDERR[0] = os.dup(2)
    # Pipelined flushes (config.pipeline) start where measured times say so: a
    # test that counts launches or flushes under 'auto' would depend on the
    # machine's speed. They are off here and on, with a fixed chunk size, in
    # tests/test_pipeline.py.
    import jitbatch
    jitbatch.config.pipeline = False
