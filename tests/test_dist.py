"""Data-parallel training over MXNet's dist_sync kvstore: examples/tree_lstm/dist.py
(sharding, broadcast, agreement), examples/tree_lstm/launch.py (the job on
loopback) and scripts/dist_train.sh.

Every job runs in subprocesses under a time limit; each test checks afterwards
that no process of its job is left (the launcher prints their pids)."""
import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from examples.tree_lstm import dist, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PY = sys.executable
BUNDLED = os.path.join(ROOT, "data", "sick_small")
SMALL = ["--data", BUNDLED, "--embed-size", "16", "--hidden-size", "8", "--sim-hidden", "6",
         "--quiet", "--no-plot"]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=PY,
           PYTHONPATH=os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
for _k in [k for k in ENV if k.startswith("DMLC_")]:  # this process is no job's member
    del ENV[_k]
LAUNCH = [PY, "-m", "examples.tree_lstm.launch"]
TRAIN = [PY, "-m", "examples.tree_lstm.train"]
JOB = os.path.join(ROOT, "tests", "dist_job.py")


def job_pids(stderr):
    """The scheduler's, servers' and workers' pids from the launcher's first line."""
    m = re.search(r"launch: scheduler on .*", stderr)
    assert m, "the launcher did not report its processes; stderr:\n" + stderr
    return [int(p) for p in re.findall(r"\(pid (\d+)\)", m.group(0))]


def assert_all_gone(pids, within=10.0):
    deadline = time.monotonic() + within
    left = pids
    while time.monotonic() < deadline:
        left = [p for p in pids if os.path.exists("/proc/%d" % p)
                and _state(p) not in ("Z", "X")]  # zombies of a reaped group count as gone
        if not left:
            return
        time.sleep(0.1)
    for p in left:  # do not leave them to the next test
        os.kill(p, signal.SIGKILL)
    pytest.fail("processes of the job still running after it ended: %s" % left)


def _state(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "X"


def run(cmd, timeout, env=ENV):
    """Run ``cmd`` in its own process group; kill the group if it outlives
    ``timeout`` (a hang fails the test instead of stalling the suite)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    t0 = time.monotonic()
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail("%s did not finish within %d s (hang?)\nstdout:\n%s\nstderr:\n%s"
                    % (" ".join(cmd), timeout, out, err))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    seconds = time.monotonic() - t0
    assert_group_gone(proc.pid)  # e.g. MXNet's launcher's processes
    if "launch: scheduler on" in err:
        assert_all_gone(job_pids(err))  # ours start each in its own group
    return proc.returncode, out, err, seconds


def assert_group_gone(pgid, within=10.0):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.killpg(pgid, signal.SIGKILL)
    pytest.fail("processes of process group %d still running after its command ended" % pgid)


# ---------------------------------------------------------------------------
# sharding and the command line, in-process
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("size", [0, 1, 2, 5, 7, 25])
@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_shards_cover_the_minibatch_once_in_order(size, workers):
    bounds = [dist.shard_bounds(size, r, workers) for r in range(workers)]
    assert bounds[0][0] == 0 and bounds[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))  # contiguous, in rank order
    sizes = [b - a for a, b in bounds]
    assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1, sizes


def test_dist_kvstore_without_a_launcher_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("DMLC_ROLE", raising=False)
    with pytest.raises(SystemExit) as exc:
        train.main(SMALL + ["--out", str(tmp_path), "--kvstore", "dist_sync"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "DMLC_ROLE=worker" in err and "scripts/dist_train.sh" in err, err


# ---------------------------------------------------------------------------
# the mechanisms, on a small program (tests/dist_job.py)
# ---------------------------------------------------------------------------

def test_workers_start_from_rank0_parameters_and_stay_identical(tmp_path):
    rc, out, err, _ = run(LAUNCH + ["-n", "2", "--timeout", "60", "--", PY, JOB, "broadcast",
                                    str(tmp_path)], timeout=90)
    assert rc == 0, out + err
    r0, r1 = [json.load(open(tmp_path / ("rank%d.json" % r))) for r in (0, 1)]
    # the workers were initialised differently, and the agreement check saw it
    assert r0["before"] != r1["before"]
    assert r0["agreed_before"] is False and r1["agreed_before"] is False
    # Worker.trainer made both hold rank 0's initial values before any step
    assert r0["after"] == r1["after"] == r0["before"]
    # two steps (rank 1's second shard empty): trained, and still identical
    assert r0["final"] == r1["final"] and r0["final"] != r0["after"]
    assert "all 2 workers finished" in err


def test_a_worker_that_fails_ends_the_job_at_once(tmp_path):
    rc, out, err, seconds = run(LAUNCH + ["-n", "2", "--timeout", "60", "--", PY, JOB, "die",
                                          str(tmp_path)], timeout=90)
    assert rc == 1, out + err
    assert "ValueError: rank 1 fails on purpose" in err
    # named, with its status, long before the launcher's own time limit
    assert re.search(r"FAILED: worker \d of 2 \(pid \d+\) exited with status 1 after", err), err
    assert seconds < 45, seconds
    assert not list(tmp_path.glob("rank*.done")), "a worker finished though its peer had died"


# ---------------------------------------------------------------------------
# the Tree-LSTM trainer
# ---------------------------------------------------------------------------

def test_two_workers_match_one_process_with_the_same_global_minibatch(tmp_path):
    """41 pairs in minibatches of 5 over 2 workers: shards of 3 and 2, and a last
    minibatch of ONE pair, where rank 1's shard is empty."""
    args = SMALL + ["--max-pairs", "41", "--batch-size", "5", "--epochs", "2", "--seed", "3"]
    rc, out, err, _ = run(TRAIN + args + ["--out", str(tmp_path / "one"),
                                          "--dist-dir", str(tmp_path / "one" / "params")],
                          timeout=120)
    assert rc == 0, out + err
    rc, out, err, _ = run(LAUNCH + ["-n", "2", "--timeout", "100", "--"] + TRAIN + args
                          + ["--out", str(tmp_path / "two"), "--kvstore", "dist_sync",
                             "--dist-dir", str(tmp_path / "two" / "params")], timeout=120)
    assert rc == 0, out + err
    one, two = [json.load(open(tmp_path / d / "metrics.json")) for d in ("one", "two")]
    assert "data-parallel: dist_sync, 2 workers" in two["execution"]
    assert len(one["step_losses"]) == len(two["step_losses"]) == 2 * 9
    np.testing.assert_allclose(two["step_losses"], one["step_losses"], rtol=1e-5)
    np.testing.assert_allclose(two["train_loss"], one["train_loss"], rtol=1e-5)

    import mxnet as mx  # pylint: disable=import-outside-toplevel
    ref = mx.nd.load(str(tmp_path / "one" / "params" / "worker0.params"))
    for rank in (0, 1):
        got = mx.nd.load(str(tmp_path / "two" / "params" / ("worker%d.params" % rank)))
        assert sorted(got) == sorted(ref)
        for name in ref:
            np.testing.assert_allclose(got[name].asnumpy(), ref[name].asnumpy(), rtol=0,
                                       atol=1e-5, err_msg="rank %d, %s" % (rank, name))


def script(*args):
    return ["bash", os.path.join(ROOT, "scripts", "dist_train.sh")] + [str(a) for a in args]


def test_dist_train_script_two_workers(tmp_path):
    """The CI check: 2 workers + 1 server, identical parameters, loss decreasing."""
    env = dict(ENV, DIST_DIR=str(tmp_path / "dist"), DIST_TIMEOUT="100")
    rc, out, err, seconds = run(script(2, *SMALL, "--max-pairs", 40, "--batch-size", 5,
                                       "--epochs", 3, "--out", tmp_path / "out"),
                                timeout=120, env=env)
    assert rc == 0, out + err
    assert "dist check: parameters identical on all 2 workers" in out, out
    assert re.search(r"^dev r .* \| train .* pairs/s.*2 workers", out, re.M), out  # rank 0's summary
    # rank 1 kept quiet: its output is in its log
    assert len(re.findall(r"^dev r ", out, re.M)) == 1 and out.count("epoch 0 (untrained)") == 1
    assert "dist: rank 1 of 2" in open(tmp_path / "dist" / "worker1.log").read()
    metrics = json.load(open(tmp_path / "out" / "metrics.json"))
    losses = metrics["train_loss"]
    assert len(losses) == 3 and all(b < a for a, b in zip(losses, losses[1:])), losses
    print("dist_train.sh 2 workers, 3 epochs of 40 pairs: %.1f s" % seconds)


def test_dist_train_script_fails_clearly_when_workers_die(tmp_path):
    env = dict(ENV, DIST_DIR=str(tmp_path / "dist"), DIST_TIMEOUT="60")
    rc, out, err, _ = run(script(2, "--data", tmp_path / "missing", "--out", tmp_path),
                          timeout=90, env=env)
    assert rc == 1, out + err
    assert "does not exist" in err  # the worker's own message
    assert re.search(r"FAILED: worker \d of 2 \(pid \d+\) exited with status 2", err), err
    assert "dist_train.sh: FAILED: the distributed job did not complete" in err


def test_dist_train_script_stops_every_process_when_terminated(tmp_path):
    env = dict(ENV, DIST_DIR=str(tmp_path / "dist"), DIST_TIMEOUT="100")
    cmd = script(2, *SMALL, "--max-pairs", 40, "--batch-size", 5, "--epochs", 200,
                 "--out", tmp_path / "out")
    with open(tmp_path / "stdout", "w") as stdout:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=stdout, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        try:
            line, deadline = "", time.monotonic() + 60
            while "launch: scheduler on" not in line and time.monotonic() < deadline:
                line = proc.stderr.readline()
            pids = job_pids(line)
            deadline = time.monotonic() + 60  # until rank 0 trains
            while "epoch 0" not in open(tmp_path / "stdout").read():
                assert time.monotonic() < deadline and proc.poll() is None, "no training"
                time.sleep(0.2)
            proc.send_signal(signal.SIGTERM)  # the script's own pid, not its group
            rc = proc.wait(timeout=30)
            err = proc.stderr.read()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    assert rc == 143, err
    assert "terminated, stopping the job" in err
    assert_all_gone(pids)


def test_mxnet_ssh_launcher_form_for_real_hosts(tmp_path):
    """The README's form for real hosts: MXNet's own launcher (through
    scripts/mxnet_launch.py) with --launcher ssh and a host file. ``ssh`` is a
    stand-in on PATH that runs the remote command here, so this checks the
    launcher, the environment it passes and the trainer under it, not ssh."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "ssh").write_text('#!/bin/bash\n# ssh [options] HOST -p PORT COMMAND: run COMMAND here\n'
                                'exec bash -c "${@: -1}"\n')
    (bindir / "ssh").chmod(0o755)
    (tmp_path / "hosts").write_text("127.0.0.1\n")
    env = dict(ENV, PATH=str(bindir) + os.pathsep + ENV.get("PATH", ""))
    rc, out, err, _ = run([PY, os.path.join(ROOT, "scripts", "mxnet_launch.py"), "--launcher", "ssh",
                           "-H", str(tmp_path / "hosts"), "-n", "2", "-s", "1"]
                          + TRAIN + SMALL + ["--max-pairs", "20", "--batch-size", "5",
                                             "--epochs", "1", "--kvstore", "dist_sync",
                                             "--out", str(tmp_path / "out")],
                          timeout=120, env=env)
    assert rc == 0, out + err
    assert "data-parallel: dist_sync, 2 workers" in out
    assert "parameters after training identical on all workers" in out
    rc, out, err, _ = run([PY, "-m", "examples.tree_lstm.dist", "check",
                           str(tmp_path / "out" / "dist"), "2"], timeout=60)
    assert rc == 0 and "parameters identical on all 2 workers" in out, out + err
