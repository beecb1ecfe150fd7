"""Start an MXNet parameter-server job on this machine (loopback): one scheduler,
S servers and N workers, all running the same command, and fail fast.

    python -m examples.tree_lstm.launch -n 2 [-s 1] [--timeout SEC] -- \\
        python -m examples.tree_lstm.train --kvstore dist_sync ...

MXNet's own launcher (``mxnet/tools/launch.py`` with the ``dmlc_tracker``
package, both in the pip wheel) cannot be used here as it is: on Python >= 3.9
it stops at ``Thread.isAlive`` (removed from Python) right after starting the
scheduler, which it then leaves running; patched past that, a worker that dies
leaves the others blocked in their next ``dist_sync`` push and the launcher
waits forever.  This launcher speaks the same protocol as its local mode, the
``DMLC_*`` environment variables that ``import mxnet`` and ``mx.kv.create``
read:

* ``DMLC_ROLE``: ``scheduler``, ``server`` or ``worker`` (``import mxnet``
  runs a scheduler or server to the end and exits, so every role can run the
  training command);
* ``DMLC_PS_ROOT_URI``, ``DMLC_PS_ROOT_PORT``: where the scheduler listens
  (127.0.0.1 and a port that was free a moment before);
* ``DMLC_NUM_SERVER``, ``DMLC_NUM_WORKER``: the job's size;
* ``DMLC_NODE_HOST=127.0.0.1``: servers and workers bind the loopback
  interface (by default ps-lite takes the first non-loopback one).

The scheduler assigns worker ranks (``kv.rank``), not this launcher, so the
workers are numbered here by start order only.  Every process inherits this
process's stdout and stderr.  The launcher returns 0 when every worker exited
0 and the scheduler and servers followed; when any process fails, exits before
the workers are done, or the timeout passes, it says which, stops every other
process (SIGTERM, then SIGKILL) and returns 1.  Children also get SIGKILL if
this launcher itself is killed (Linux ``PR_SET_PDEATHSIG``), so none outlives
it.
"""
import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time

POLL_SECONDS = 0.1
TERM_GRACE_SECONDS = 3.0      # SIGTERM -> SIGKILL; ps-lite's scheduler takes ~1 s to stop
FOLLOW_SECONDS = 30.0         # workers done -> the scheduler and servers must have exited


def free_port(host="127.0.0.1"):
    """A TCP port nothing listens on now (the scheduler binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent():
    """In the child before exec: SIGKILL when the launcher dies, however it dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except OSError:  # not glibc Linux: cleanup then relies on the launcher's finally/trap
        pass


class Proc(object):
    def __init__(self, name, popen):
        self.name, self.popen, self.started = name, popen, time.monotonic()

    @property
    def pid(self):
        return self.popen.pid

    def describe(self):
        return "%s (pid %d)" % (self.name, self.pid)


def _status(code):
    return "signal %s" % signal.Signals(-code).name if code < 0 else "status %d" % code


class Job(object):
    """The scheduler, servers and workers of one job; see the module docstring."""

    def __init__(self, command, num_workers, num_servers=1, host="127.0.0.1", env=None,
                 log=None):
        self.command = list(command)
        self.num_workers, self.num_servers, self.host = num_workers, num_servers, host
        self.base_env = dict(os.environ if env is None else env)
        self.log = log or (lambda msg: print("launch: " + msg, file=sys.stderr, flush=True))
        self.procs = []

    def _spawn(self, name, role, port):
        env = dict(self.base_env)
        env.update({"DMLC_ROLE": role, "DMLC_PS_ROOT_URI": self.host,
                    "DMLC_PS_ROOT_PORT": str(port), "DMLC_NODE_HOST": self.host,
                    "DMLC_NUM_SERVER": str(self.num_servers),
                    "DMLC_NUM_WORKER": str(self.num_workers)})
        # own process group: stop() reaches whatever the command starts
        popen = subprocess.Popen(self.command, env=env, start_new_session=True,
                                 preexec_fn=_die_with_parent)
        self.procs.append(Proc(name, popen))

    def start(self):
        port = free_port(self.host)
        self._spawn("scheduler", "scheduler", port)
        for i in range(self.num_servers):
            self._spawn("server %d" % (i + 1), "server", port)
        for i in range(self.num_workers):
            self._spawn("worker %d of %d" % (i + 1, self.num_workers), "worker", port)
        self.log("scheduler on %s:%d, %d server(s), %d worker(s): %s"
                 % (self.host, port, self.num_servers, self.num_workers,
                    ", ".join(p.describe() for p in self.procs)))

    def wait(self, timeout=None):
        """Watch the job; return 0 or 1 (see the module docstring)."""
        t0 = time.monotonic()
        workers = [p for p in self.procs if p.name.startswith("worker")]
        others = [p for p in self.procs if p not in workers]
        workers_done_at = others_done_at = None
        while True:
            now = time.monotonic()
            for p in self.procs:
                code = p.popen.poll()
                if code is not None and code != 0:
                    return self._fail("%s exited with %s after %.1f s"
                                      % (p.describe(), _status(code), now - p.started))
            running = [p for p in workers if p.popen.poll() is None]
            # a server or the scheduler exits 0 only after every worker reached the
            # kvstore's exit barrier, so workers may still be tearing down then: both
            # sides get FOLLOW_SECONDS to catch up before that counts as a failure
            if not running:
                workers_done_at = workers_done_at or now
                if all(p.popen.poll() is not None for p in others):
                    self.log("all %d workers finished (%.1f s)" % (len(workers), now - t0))
                    return 0
                if now - workers_done_at > FOLLOW_SECONDS:
                    left = [p.describe() for p in others if p.popen.poll() is None]
                    return self._fail("the workers finished but %s did not exit within %.0f s"
                                      % (", ".join(left), FOLLOW_SECONDS))
            elif any(p.popen.poll() is not None for p in others):
                others_done_at = others_done_at or now
                if now - others_done_at > FOLLOW_SECONDS:
                    gone = [p.describe() for p in others if p.popen.poll() is not None]
                    return self._fail("%s exited while %s kept running for %.0f s"
                                      % (", ".join(gone), ", ".join(p.describe() for p in running),
                                         FOLLOW_SECONDS))
            if timeout is not None and now - t0 > timeout:
                left = [p.describe() for p in self.procs if p.popen.poll() is None]
                return self._fail("timeout: the job ran %.0f s, its limit; still running: %s "
                                  "(a worker may be stuck, e.g. in a dist_sync push that another "
                                  "worker never matched; raise the limit if the job is just long)"
                                  % (timeout, ", ".join(left)))
            time.sleep(POLL_SECONDS)

    def _fail(self, why):
        left = [p for p in self.procs if p.popen.poll() is None]
        self.log("FAILED: %s; stopping %s" % (
            why, ", ".join(p.describe() for p in left) if left else "nothing (all exited)"))
        return 1

    def stop(self):
        """SIGTERM every process group still running, SIGKILL what is left after a grace."""
        for sig, grace in ((signal.SIGTERM, TERM_GRACE_SECONDS), (signal.SIGKILL, 5.0)):
            left = [p for p in self.procs if p.popen.poll() is None]
            for p in left:
                try:
                    os.killpg(p.pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace
            while left and time.monotonic() < deadline:
                time.sleep(POLL_SECONDS)
                left = [p for p in left if p.popen.poll() is None]
            if not left:
                return
        self.log("could not stop: %s" % ", ".join(p.describe() for p in left))


def run(command, num_workers, num_servers=1, timeout=None, env=None, log=None):
    """Start the job, watch it, always stop what is left; 0 on success, 1 on failure."""
    job = Job(command, num_workers, num_servers, env=env, log=log)

    def on_signal(signum, frame):  # turn SIGTERM (e.g. from the script's trap) into cleanup
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, on_signal)
    try:
        job.start()
        return job.wait(timeout)
    finally:
        job.stop()
        signal.signal(signal.SIGTERM, previous)


def main(argv=None):
    p = argparse.ArgumentParser(
        prog="python -m examples.tree_lstm.launch",
        description="Run COMMAND as an MXNet parameter-server job on this machine: one "
                    "scheduler, S servers, N workers (DMLC_* environment, loopback).")
    p.add_argument("-n", "--num-workers", type=int, required=True)
    p.add_argument("-s", "--num-servers", type=int, default=1)
    p.add_argument("--timeout", type=float, default=None, metavar="SEC",
                   help="stop the job and fail after SEC seconds (default: no limit)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the command every process runs (after --)")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("no command given: put it after --")
    if args.num_workers < 1 or args.num_servers < 1:
        p.error("need at least 1 worker and 1 server, got -n %d -s %d"
                % (args.num_workers, args.num_servers))
    if args.timeout is not None and not args.timeout > 0:
        p.error("argument --timeout: must be > 0, got %r" % args.timeout)
    return run(command, args.num_workers, args.num_servers, timeout=args.timeout)


if __name__ == "__main__":
    sys.exit(main())
