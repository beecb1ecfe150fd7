"""The core (graph, signature, schedule, cost, execute, stats) is framework-free:
it imports with MXNet absent, and its schedulers give exact launch counts."""
import subprocess
import sys

import pytest

from jitbatch import cost, schedule
from jitbatch.execute import Backend, flush
from jitbatch.graph import Graph, Ref
from jitbatch.signature import SigInfo, SignatureTable

CORE = ["jitbatch.graph", "jitbatch.signature", "jitbatch.schedule", "jitbatch.cost",
        "jitbatch.pipeline", "jitbatch.execute", "jitbatch.stats", "jitbatch.errors", "jitbatch.config"]


def test_core_imports_without_mxnet():
    code = ("import sys; sys.modules['mxnet'] = None\n"
            "import %s\n"
            "assert not any(m == 'mxnet' or m.startswith('mxnet.') for m in sys.modules "
            "if sys.modules[m] is not None), 'mxnet got imported'\n"
            "import jitbatch; assert jitbatch.LazyArray is None\n"
            "print('ok')" % ", ".join(CORE))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=__import__("os").path.dirname(__import__("os").path.dirname(__file__)))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


class V(Ref):
    """A fake lazy value: the output of a node."""
    __slots__ = ("_node", "_k")

    def __init__(self, node):
        self._node = node
        self._k = 0


class FakeBackend(Backend):
    def __init__(self):
        self.launches = []

    def launch(self, batch):
        assert all(n.info is batch[0].info for n in batch)
        for n in batch:  # producers ran before
            for x in n.inputs:
                if isinstance(x, Ref):
                    assert x._node.batch is not None
        self.launches.append(len(batch))
        for n in batch:
            n.batch = ["out"]


def _tree_graph(n_trees, depth, table):
    g = Graph()
    cell = table.add("cell", lambda i: SigInfo(i, "cell", None, (((1, 4), "f"),), True, "cell"))

    def build(d):
        if d == 1:
            return V(g.add(cell, ("x",), None, (False, False)))
        left, right = build(d - 1), build(d - 1)
        return V(g.add(cell, ("x", left, right), None, (False, False)))
    for _ in range(n_trees):
        build(depth)
    return g


@pytest.mark.parametrize("policy,expected", [("depth", 4), ("agenda", 4), ("sequential", 5 * 15)])
def test_launch_counts_identical_trees(policy, expected):
    table = SignatureTable()
    g = _tree_graph(5, 4, table)
    be = FakeBackend()
    flush(g, be, policy=policy)
    assert len(be.launches) == expected
    assert sum(be.launches) == 5 * 15


def test_agenda_waits_for_late_peers():
    """A head after a short chain waits for the head after a long chain."""
    table = SignatureTable()
    step = table.add("s", lambda i: SigInfo(i, "s", None, (), True, "step"))
    head = table.add("h", lambda i: SigInfo(i, "h", None, (), True, "head"))
    g = Graph()
    for length in (1, 4):
        x = V(g.add(step, (), None, (False, False)))
        for _ in range(length - 1):
            x = V(g.add(step, (x,), None, (False, False)))
        g.add(head, (x,), None, (False, False))
    order = [b[0].info.name for b in schedule.by_agenda(list(g.nodes))]
    assert order.count("head") == 1
    assert len(schedule.by_depth(list(g.nodes))) == 6  # depth splits the heads


def test_signature_table_is_bounded():
    t = SignatureTable(limit=3)
    for k in range(10):
        t.add(k, lambda i: SigInfo(i, k, None, (), True, str(k)))
    assert len(t) == 3 and t.evictions == 7 and t.get(9) is not None and t.get(0) is None


def test_auto_runs_sequential_when_nothing_repeats():
    table = SignatureTable()
    g = Graph()
    prev = None
    for k in range(4):
        info = table.add(k, lambda i: SigInfo(i, k, None, (), True, "op%d" % k))
        prev = V(g.add(info, (prev,) if prev else (), None, (False, False)))
    pol, why, _, _ = cost.MODEL.choose(list(g.nodes), None)
    assert pol == "sequential" and "nothing to merge" in why
    assert cost.MODEL.passthrough_after(4, 4) >= 64 and cost.MODEL.passthrough_after(4, 3) == 0
    assert cost.MODEL.passthrough_after(4, 4, nothing_to_merge=False) == 0
    # windows double with each such flush in a row, up to the cap
    wins = [cost.MODEL.passthrough_after(200, 200, streak=k) for k in range(6)]
    assert wins == [800, 1600, 3200, cost.PASSTHROUGH_CAP, cost.PASSTHROUGH_CAP,
                    cost.PASSTHROUGH_CAP]
    assert cost.MODEL.passthrough_after(5000, 5000, streak=3) == 20000  # never below 4x


def test_budget_steers_auto():
    table = SignatureTable()
    g = _tree_graph(4, 3, table)
    nodes = list(g.nodes)
    m = cost.Model()
    pol, _, pred, groups = m.choose(nodes, None)
    assert groups == 3 and pol in ("depth", "agenda")
    assert pred["agenda"]["execute"] < pred["sequential"]["execute"]
    pol0, why0, _, _ = m.choose(nodes, 0.0)      # no analysis allowed at all
    assert pol0 == "sequential" and "budget 0" in why0
    # analysis measured as very expensive for the agenda: auto stops using it
    m.analysis["agenda"] = 1.0
    assert m.choose(nodes, None)[0] == "depth"


def test_budget_caps_the_slowest_recent_analysis():
    """A policy is allowed under a budget only if its analysis fits even at
    the slowest per node of its last ANALYSIS_KEEP flushes: a mean under the
    budget with one recent flush over it does not do."""
    table = SignatureTable()
    nodes = list(_tree_graph(4, 3, table).nodes)
    m = cost.Model()
    m.choose(nodes, None)
    unbatched = m.unbatched
    budget = 1e-3
    fits = budget * unbatched / len(nodes)      # seconds per node the budget allows
    for a in [0.5 * fits] * 6 + [1.5 * fits]:
        m.observe("agenda", len(nodes), a * len(nodes), 3, 1e-3, 3)
        m.observe("depth", len(nodes), 0.5 * fits * len(nodes), 3, 1e-3, 3)
    assert m.analysis["agenda"] < fits          # the mean fits ...
    assert m.analysis_high("agenda") == pytest.approx(1.5 * fits)
    pol, why, pred, _ = m.choose(nodes, budget)  # ... the slowest does not
    assert pol != "agenda" and "budget" in why, (pol, why)
    # the slow flush ages out after ANALYSIS_KEEP more
    for _ in range(cost.ANALYSIS_KEEP):
        m.observe("agenda", len(nodes), 0.5 * fits * len(nodes), 3, 1e-3, 3)
    assert m.analysis_high("agenda") == pytest.approx(0.5 * fits)
    assert "agenda" in [p for p in ("agenda", "depth", "sequential")
                        if m.analysis_high(p) * len(nodes) <= budget * m.unbatched]


def test_a_budget_below_the_cost_of_looking_skips_the_look():
    """Counting what could merge costs a flush the analysis of a sequential
    one; a budget smaller than that (per node, against the last flush's
    unbatched time per node) does not look at all."""
    m = cost.Model()
    assert m.worth_looking(None) and not m.worth_looking(0)
    assert m.worth_looking(1e-6)                # nothing measured yet: look
    nodes = list(_tree_graph(4, 3, SignatureTable()).nodes)
    m.choose(nodes, None)
    per = m.unbatched_node
    assert per == pytest.approx(m.unbatched / len(nodes))
    m.observe("sequential", len(nodes), 2e-3 * per * len(nodes), len(nodes), 1e-3, 0)
    assert not m.worth_looking(1e-3) and m.worth_looking(3e-3)


def test_launch_cost_is_a_line_in_rows():
    info = SigInfo(0, "k", None, (), True, "op")
    m = cost.Model()
    assert m.launch_cost(info, 10) == m.launch          # nothing measured: the prior
    for rows in (1, 2, 4, 8):                           # measured 1 ms + 0.1 ms per row
        dt = 1e-3 + 1e-4 * rows
        info.launches += 1
        info.launch_cost += dt
        info.launch_rows += rows
        info.launch_rr += rows * rows
        info.launch_cr += dt * rows
    assert abs(m.launch_cost(info, 20) - 3e-3) < 1e-9
    assert abs(m.launch_cost(info, 1) - 1.1e-3) < 1e-9


def test_a_policy_never_run_is_measured_at_the_second_choice():
    """A prior alone must not keep a merging policy from ever running (the
    agenda's prior analysis, 8 us per node, kept 'auto' on depth grouping for
    a whole zoo run where the agenda measured 1.4 us per node and a third of
    the launches): the first choice pays first-call costs, the second runs
    a policy never run, and then the measurements decide."""
    nodes = list(_tree_graph(4, 3, SignatureTable()).nodes)
    m = cost.Model()
    m.analysis["agenda"] = 1.0                       # a hopeless prior
    assert m.choose(nodes, None)[:2] == ("depth", "cheapest predicted (analysis + execution)")
    assert m.choose(nodes, None)[:2] == ("agenda", "measured for the first time")
    m.observe("agenda", len(nodes), 1e-6 * len(nodes), 3, 0.01, 3)
    m.observe("depth", len(nodes), 5e-6 * len(nodes), 3, 0.01, 3)
    assert m.choose(nodes, None)[:2] == ("agenda", "cheapest predicted (analysis + execution)")
    slow = cost.Model()
    slow.analysis["agenda"] = 1.0
    assert slow.choose(nodes, 1e-9)[0] == "sequential"    # not allowed: never forced
    assert slow.choose(nodes, 1e-9)[0] == "sequential"


def test_a_policy_not_chosen_for_a_while_is_measured_again():
    """Estimates move only when a policy runs: one slow flush of the agenda
    must not keep 'auto' on depth for good. The prediction takes the median of
    the last flushes, and a merging policy not chosen for REPROBE flushes runs
    once."""
    table = SignatureTable()
    nodes = list(_tree_graph(4, 3, table).nodes)
    m = cost.Model()
    for t in (2e-6, 2e-6, 2e-6, 2e-6, 1.0):       # one flush of the agenda was slow
        m.observe("agenda", len(nodes), t * len(nodes), 3, 0.01, 3)
    for t in (5e-6,) * 4:
        m.observe("depth", len(nodes), t * len(nodes), 3, 0.01, 3)
    assert m.analysis_typical("agenda") == 2e-6 and m.analysis["agenda"] > 0.1
    m.agenda_ratio = 1.0                          # no launch saved: analysis decides
    assert m.choose(nodes, None)[0] == "agenda"   # the median, not the mean
    m.analysis_recent["agenda"] = [1.0] * 3       # now it is slow every time
    got = [m.choose(nodes, None)[:2] for _ in range(cost.REPROBE + 2)]
    assert [p for p, _ in got[:cost.REPROBE]] == ["depth"] * cost.REPROBE
    assert got[cost.REPROBE] == ("agenda", "measured again (not run for %d flushes)"
                                 % cost.REPROBE)
    assert got[cost.REPROBE + 1][0] == "depth"


def test_a_policy_measured_once_is_measured_again_soon():
    """Until 2026-11-26 a policy measured on one flush kept that flush's price
    for REPROBE (32) flushes: a first flush that paid one-time costs made the
    zoo's attention model run 'depth' on every inference flush after it, 1.6x
    slower per minibatch than the agenda it never tried again. A policy
    measured on fewer than three flushes runs again after REPROBE_FEW."""
    table = SignatureTable()
    nodes = list(_tree_graph(4, 3, table).nodes)
    m = cost.Model()
    m.agenda_ratio = 1.0                               # no launch saved: analysis decides
    m.observe("agenda", len(nodes), 1.0 * len(nodes), 3, 0.01, 3)   # one slow first flush
    m.observe("depth", len(nodes), 5e-6 * len(nodes), 3, 0.01, 3)
    m.ran["agenda"] = 0
    got = [m.choose(nodes, None)[:2] for _ in range(cost.REPROBE_FEW + 2)]
    assert [p for p, _ in got[:cost.REPROBE_FEW]] == ["depth"] * cost.REPROBE_FEW
    assert got[cost.REPROBE_FEW] == ("agenda", "measured again (not run for %d flushes)"
                                     % cost.REPROBE_FEW)
    for _ in range(2):                                 # fast from now on
        m.observe("agenda", len(nodes), 1e-6 * len(nodes), 3, 0.01, 3)
    assert m.choose(nodes, None)[0] == "agenda"        # the median of three


def test_a_policy_that_cannot_be_the_cheapest_is_not_measured_again():
    """Until 2026-11-26 a merging policy not chosen for REPROBE_FEW flushes ran
    once even where its predicted execution alone was more than the chosen
    policy's whole predicted cost: running it measures only its analysis, so
    the zoo's attention model paid a 'depth' inference minibatch 3x as slow
    as the agenda's (124 against 36 ms) every few minibatches of a run, for
    nothing. Once its execution could be beaten by a cheaper analysis
    (no launch saved by the agenda here), it runs again as before."""
    nodes = list(_tree_graph(4, 3, SignatureTable()).nodes)
    m = cost.Model()
    m.observe("agenda", len(nodes), 1e-6 * len(nodes), 3, 0.01, 3)
    m.observe("depth", len(nodes), 5e-6 * len(nodes), 3, 0.01, 3)
    m.ran["depth"] = m.ran["agenda"] = 0
    m.agenda_ratio = 0.1                  # the agenda saves most of the launches
    got = [m.choose(nodes, None) for _ in range(cost.REPROBE + 2)]
    assert [g[:2] for g in got] == \
        [("agenda", "cheapest predicted (analysis + execution)")] * (cost.REPROBE + 2)
    pred = got[-1][2]
    assert pred["depth"]["execute"] >= pred["agenda"]["analysis"] + pred["agenda"]["execute"]
    m.agenda_ratio = 1.0                  # no launch saved: the analysis decides
    assert m.choose(nodes, None)[:2] == \
        ("depth", "measured again (not run for %d flushes)" % cost.REPROBE_FEW)


class _SlowPlans(FakeBackend):
    """A backend whose stage plan of a signature takes 50 ms the first time it
    is asked (once per signature, as the Gluon backend's), and finds none."""

    def __init__(self):
        super().__init__()
        self.asked = set()

    def stages(self, info, nodes):
        if info not in self.asked:
            self.asked.add(info)
            __import__("time").sleep(0.05)
        return None


def test_a_stage_plan_made_once_is_not_priced_per_node(monkeypatch):
    """Until 2026-11-26 the seconds a flush spent making its signatures' stage
    plans (once per signature: 35 ms on the attention model's first flush)
    counted as the policy's analysis per node, 20x its cost; they are left out
    of what the cost model learns (the flush's stats still show them)."""
    monkeypatch.setattr(cost, "MODEL", cost.Model())
    table = SignatureTable()
    g = _tree_graph(5, 4, table)
    n = len(g.nodes)
    be = _SlowPlans()
    flush(g, be, policy="auto")
    assert be.asked                         # the plan was asked for (at two or more depths)
    (policy, per_node), = [(p, r[-1]) for p, r in cost.MODEL.analysis_recent.items()]
    assert per_node * n < 0.025, (policy, per_node * n)
    from jitbatch.stats import STATS
    assert STATS.snapshot()["last_flush"]["analysis_seconds"] >= 0.05
