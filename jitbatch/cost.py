"""Cost model: which policy a flush under ``policy='auto'`` uses, and why.

Everything is measured as jitbatch runs, nothing is a constant tuned to one
machine (the starting values are only priors, replaced by the first
measurements):

* per signature, launch time as a function of its rows: a least-squares line
  ``a + b * rows`` over the launches of *calibrating* flushes (the 2nd and 3rd
  flush under 'auto', then every 64th), which wait for each launch's kernels
  and so time gathers, call, kernels and bookkeeping (a calibrating flush costs
  ~20% more: Python no longer runs ahead of the kernels); the mean per launch
  until rows have varied, and the mean over all timed launches for a signature
  not timed yet. Other flushes do not wait: MXNet computes asynchronously, so
  timing them on the Python side would leave out the kernels (it did, and
  'auto' then preferred cheaper analysis over fewer launches where the fewer
  launches were measured 10% faster);
* per policy, analysis seconds per node (scheduling and gather planning);
* how many launches the agenda saves over depth grouping, learned from every
  flush that ran the agenda (depth groups are counted on every flush: O(N)).

A flush predicts, for each policy, analysis + execution time, drops the
policies whose analysis at its slowest per node of their last 8 flushes
exceeds ``analysis_budget`` x the predicted UNBATCHED execution time (one
launch per node: the time batching is there to save; the budget is a cap, so
the mean would let half the flushes over it), and runs the cheapest that is
left (``sequential``, which needs no analysis, is always allowed). The agenda is predicted to save, per launch it
merges away, that signature's fixed cost ``a``. If no two nodes share (depth,
signature), nothing can merge and ``sequential`` runs without further
analysis."""
try:
    import cython   # compiled: the local type annotations below are C declarations
except ImportError:  # running from source without Cython installed
    from . import _nocython as cython

from .graph import Node


class Model(object):
    def __init__(self):
        self.analysis = {"depth": 3e-6, "agenda": 8e-6, "sequential": 1e-7}
        self.analysis_recent = {}    # policy -> its last ANALYSIS_KEEP per-node analysis times
        self.launch = 3e-4           # mean seconds per launch, all signatures
        self.agenda_ratio = 0.7      # agenda launches / depth groups
        self._measured = set()       # which priors a measurement has replaced
        self.flushes = 0             # 'auto' flushes so far (calibrate_now counts them)
        self.unbatched = None        # predicted one-launch-per-node seconds of this flush
        self.unbatched_node = None   # and per node
        self.last_groups = {}        # its depth groups (see depth_groups)
        self.fixed_launch = None     # mean fixed seconds of a launch of the last flush chosen
        self.issue = None            # seconds to issue a launch (flushes that do not wait)
        self.choices = 0             # choose() calls so far, and at which one each policy
        self.ran = {}                # was chosen last (see REPROBE)

    def launch_price(self):
        """What one more launch costs: its mean fixed kernel seconds (of the last
        flush's depth groups) plus the Python seconds to issue it; None while
        either is unmeasured (``pipeline.Pipe.choose``)."""
        if self.fixed_launch is None or self.issue is None:
            return None
        return self.fixed_launch + self.issue

    def calibrate_now(self):
        """Whether this 'auto' flush waits for and times every launch: the 2nd
        and 3rd (the 1st pays first-call costs), then every 64th. A signature
        not timed yet is predicted by the mean over the timed launches."""
        self.flushes += 1
        return self.flushes in (2, 3) or self.flushes % 64 == 0

    def _update(self, name, old, new):
        if name not in self._measured:
            self._measured.add(name)
            return new
        return 0.8 * old + 0.2 * new

    def observe(self, policy, nodes, analysis_s, launches, execute_s, depth_groups,
                calibrated=True, staged=False):
        if nodes:
            # a flush that split calls into stages is its own analysis entry:
            # the split's extra nodes and gathers are what 'auto' weighs
            key = policy + "+split" if staged else policy
            self.analysis[key] = self._update(key, self.analysis.get(key, 0.0),
                                              analysis_s / nodes)
            recent = self.analysis_recent.setdefault(key, [])
            recent.append(analysis_s / nodes)
            del recent[:-ANALYSIS_KEEP]
        if launches and calibrated:
            self.launch = self._update("launch", self.launch, execute_s / launches)
        elif launches:
            # not waiting for kernels: the Python time to issue a launch
            self.issue = self._update("issue", self.issue or 0.0, execute_s / launches)
        if policy == "agenda" and depth_groups:
            self.agenda_ratio = self._update("ratio", self.agenda_ratio,
                                             launches / depth_groups)

    def worth_looking(self, budget):
        """Whether a flush under ``budget`` (not None) may look at its graph at
        all: even counting what could merge costs a flush the analysis of a
        sequential one per node, and the budget (a fraction of the unbatched
        execution, per node as on the last flush) may be smaller than that.
        True until both are measured."""
        if budget is None:
            return True
        if not budget:
            return False
        per = self.unbatched_node
        if per is None or "sequential" not in self.analysis_recent:
            return True
        return self.analysis_high("sequential") <= budget * per

    def smallest_budget(self, looked, nodes):
        """The smallest analysis budget under which a flush of ``nodes`` would
        have batched: what the cheapest merging policy's analysis costs, and,
        where the flush did not even look at its graph (``looked`` False), what
        looking costs if that is more, each at its slowest of the last flushes
        (a prior while unmeasured), as a fraction of the nodes' unbatched time
        per node. None while a node's signature has no timed launch: a budget
        advised from the prior launch cost (300 us) was ten times too small
        for launches that took 22 us; so was one that only paid for looking,
        refused again by the analysis it then let run."""
        if not nodes:
            return None
        n: Node
        for n in nodes:
            if not n.info.launches:
                return None
        per = sum([self.launch_cost(n.info, 1) for n in nodes]) / len(nodes)
        if not per:
            return None
        merging = min(self.analysis_high(p) for p in ("depth", "agenda"))
        if not looked:
            return max(self.analysis_high("sequential"), merging) / per
        return merging / per

    def analysis_high(self, key):
        """Seconds per node of ``key``'s analysis at its slowest of the last
        :data:`ANALYSIS_KEEP` flushes (the prior while none was measured)."""
        recent = self.analysis_recent.get(key)
        return max(recent) if recent else self.analysis[key]

    def launch_cost(self, info, rows=1):
        """Predicted seconds of one launch of ``info`` over ``rows`` nodes
        (``rows=0``: the fixed cost of a launch)."""
        n = info.launches
        if not n:
            return self.launch
        sr, sc = info.launch_rows, info.launch_cost
        den = n * info.launch_rr - sr * sr
        if n < 3 or den <= 0:
            return sc / n
        b = max((n * info.launch_cr - sc * sr) / den, 0.0)
        a = max((sc - b * sr) / n, 0.0)
        return a + b * rows

    @staticmethod
    def observe_padded(info, rows, units, seconds):
        """One timed launch of a zero-padded signature: ``rows`` nodes padded to
        ``units`` = rows x the largest size (sums for a least-squares plane)."""
        f = info.pad_fit
        if f is None:
            f = info.pad_fit = [0.0] * 9
        f[0] += 1
        f[1] += rows
        f[2] += units
        f[3] += seconds
        f[4] += rows * rows
        f[5] += rows * units
        f[6] += units * units
        f[7] += seconds * rows
        f[8] += seconds * units

    def pad_costs(self, info):
        """(fixed seconds per launch, seconds per padded unit) of a zero-padded
        signature: the plane ``a + b * rows + c * units`` fitted to its timed
        launches (units: rows x the launch's largest size), or None while the
        launches timed so far cannot tell ``c`` apart (then nothing is split:
        padding all into one launch is what ran before). ``b`` is the same for
        every split of a batch and drops out."""
        f = info.pad_fit
        if f is None or f[0] < 4:
            return None
        m = [[f[0], f[1], f[2], f[3]],
             [f[1], f[4], f[5], f[7]],
             [f[2], f[5], f[6], f[8]]]
        det = (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1])
               - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
               + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))
        if det <= 1e-9 * m[0][0] * m[1][1] * m[2][2]:
            return None     # rows and units moved together: no padding cost seen
        for col in range(3):                 # Gaussian elimination, partial pivoting
            piv = max(range(col, 3), key=lambda r: abs(m[r][col]))
            m[col], m[piv] = m[piv], m[col]
            for r in range(3):
                if r != col:
                    q = m[r][col] / m[col][col]
                    for c in range(col, 4):
                        m[r][c] -= q * m[col][c]
        a = m[0][3] / m[0][0]
        c = m[2][3] / m[2][2]
        if c <= 0:
            return None
        return max(a, 0.0), c

    @staticmethod
    def depth_groups(nodes):
        """{(depth, signature): [first node, node count]} - the launches of
        depth grouping and their sizes."""
        groups = {}
        n: Node
        for n in nodes:
            k = (n.depth, n.info)
            g = groups.get(k)
            if g is None:
                groups[k] = [n, 1]
            else:
                g[1] += 1
        return groups

    def choose(self, nodes, budget):
        """Return ``(policy, reason, predictions, depth group count)``."""
        n = len(nodes)
        groups = self.last_groups = self.depth_groups(nodes)
        if n <= 1 or len(groups) == n:
            return "sequential", "no two nodes can run together: nothing to merge", {}, len(groups)
        lc = self.launch_cost
        exec_seq = exec_depth = fixed = 0.0
        for first, count in groups.values():
            exec_seq += lc(first.info, 1) * count
            exec_depth += lc(first.info, count)
            fixed += lc(first.info, 0)
        an = self.analysis_typical
        pred = {
            "sequential": (an("sequential") * n, exec_seq),
            "depth": (an("depth") * n, exec_depth),
            # the same rows in fewer launches: each merged-away launch saves its fixed cost
            "agenda": (an("agenda") * n,
                       exec_depth - (1.0 - min(self.agenda_ratio, 1.0)) * fixed),
        }
        self.unbatched = exec_seq
        self.unbatched_node = exec_seq / n
        self.fixed_launch = fixed / len(groups)
        # the budget is a cap: a policy is allowed if its analysis stays within
        # it even at the slowest per node of its last flushes (the mean predicts
        # the cost; flushes vary around it)
        allowed = [p for p in pred if p == "sequential" or budget is None
                   or self.analysis_high(p) * n <= budget * exec_seq]
        best = min(allowed, key=lambda p: sum(pred[p]))
        if len(allowed) < len(pred):
            why = "cheapest predicted within analysis budget %g" % budget
        else:
            why = "cheapest predicted (analysis + execution)"
        # a merging policy's estimates change only when it runs: one never run
        # runs once early (from the second choice: the first flush pays
        # first-call costs), so a prior cannot exclude it, and one not run for
        # REPROBE flushes (REPROBE_FEW while measured on fewer than three) runs
        # once, so one slow flush cannot exclude it for long. Not one whose
        # predicted execution alone is the best's whole cost: running it
        # measures only its analysis, which cannot make it the cheapest
        self.choices += 1
        for p in ("agenda", "depth"):
            if p == best or p not in allowed or pred[p][1] >= sum(pred[best]):
                continue
            if p not in self.ran and self.choices >= 2:
                best, why = p, "measured for the first time"
                break
            # an estimate from fewer than three flushes (the median needs three)
            # may be one flush's outlier: re-measured sooner
            wait = REPROBE if len(self.analysis_recent.get(p, ())) >= 3 else REPROBE_FEW
            if self.choices - self.ran.get(p, 0) > wait:
                best, why = p, "measured again (not run for %d flushes)" % wait
                break
        self.ran[best] = self.choices
        return best, why, {p: {"analysis": a, "execute": e} for p, (a, e) in pred.items()}, len(groups)

    def analysis_typical(self, key):
        """Predicted seconds per node of ``key``'s analysis: the median of its
        last flushes (one slow flush, a first trace or a busy machine, moves a
        mean a long way), the prior while fewer than three were measured."""
        recent = self.analysis_recent.get(key)
        if recent and len(recent) >= 3:
            return sorted(recent)[len(recent) // 2]
        return self.analysis[key]

    def split_gain(self, info, plan, depths, nodes, policy, budget, calibrate):
        """Whether the calls of block signature ``info`` (``depths``: their count
        per depth, in a flush of ``nodes`` nodes scheduled by ``policy``) run
        their input stage as one
        launch of its own. Predicted per depth group: the block's launches
        against one input-stage launch over all of them plus the main stage's
        launches, plus the measured extra analysis per node of flushes that
        split. Until both stages are timed, a calibrating flush splits (once
        the block itself is timed) to time them. Returns (split?, why,
        predictions)."""
        a_info, b_info = plan.a_info, plan.b_info
        if not info.launches:
            return False, "block launches not timed yet", None
        if not a_info.launches or not b_info.launches:
            if calibrate:
                return True, "timing the split (calibrating flush)", None
            return False, "split not timed yet (next calibrating flush)", None
        lc = self.launch_cost
        block = split = 0.0
        for c in depths.values():
            block += lc(info, c)
            split += lc(b_info, c)
        split += lc(a_info, sum(depths.values()))
        an = self.analysis
        key = policy + "+split"
        extra = max(an.get(key, an[policy]) - an[policy], 0.0) * nodes
        pred = {"block": {"execute": block},
                "split": {"execute": split, "extra_analysis": extra}}
        if budget is not None and self.unbatched is not None and \
                (self.analysis_high(key) if key in an else self.analysis_high(policy)) \
                * nodes > budget * self.unbatched:
            return False, "split analysis over budget %g" % budget, pred
        if split + extra < block:
            return True, "cheaper predicted (input stage merged across %d depths)" \
                % len(depths), pred
        return False, "block cheaper predicted", pred

    @staticmethod
    def passthrough_after(nodes, launches, nothing_to_merge=True, streak=0):
        """Calls to run eagerly (unrecorded) after an 'auto' flush in which no
        two nodes could run together: recording would be pure overhead. Bounded,
        so batchable work that follows is recorded again soon (the next flush
        re-checks): 4x the flush's nodes, at least 64, doubled for each flush
        before it in a row that found the same (``streak``) up to 4096 calls, so
        a long run of unmergeable work records ever less of itself. Not after a
        flush the budget kept sequential."""
        if not nothing_to_merge or launches < nodes or nodes < 2:
            return 0
        base = max(64, 4 * nodes)
        return max(base, min(base << min(streak, 8), PASSTHROUGH_CAP))


#: flushes whose analysis per node the budget check takes the slowest of
ANALYSIS_KEEP = 8
#: choices after which a merging policy not chosen meanwhile runs once again
REPROBE = 32
#: the same for a policy measured on fewer than three flushes
REPROBE_FEW = 4
PASSTHROUGH_CAP = 4096   # most calls run eagerly between two re-checks (grown windows)
MODEL = Model()
