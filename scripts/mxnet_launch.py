"""MXNet's own job launcher (``mxnet/tools/launch.py`` with its ``dmlc_tracker``
package, both in the pip wheel), made to run on Python >= 3.9: the tracker
still calls ``Thread.isAlive``, which Python 3.9 removed (it fails right after
starting the scheduler). Same arguments as MXNet's, e.g. for real hosts::

    python scripts/mxnet_launch.py --launcher ssh -H hosts -n 4 -s 2 \\
        python -m examples.tree_lstm.train --kvstore dist_sync --batch-size 100

Unlike ``examples/tree_lstm/launch.py`` it does not notice a worker that dies
(the others then wait for it forever): run it under ``timeout``.
"""
import runpy
import sys
import threading

if not hasattr(threading.Thread, "isAlive"):
    threading.Thread.isAlive = threading.Thread.is_alive

if __name__ == "__main__":
    sys.argv[0] = "launch.py"
    runpy.run_module("mxnet.tools.launch", run_name="__main__")
