"""Cost model: which policy a flush under ``policy='auto'`` uses.

The model is fed by measurements taken as jitbatch runs (``Model.observe``):
per-node analysis seconds of each policy and per-launch seconds. A flush whose
graph has nothing to merge runs ``sequential`` (no analysis at all); otherwise
the policy with the lowest predicted total (analysis + launches) is used, and a
policy whose predicted analysis exceeds the budget is not considered."""


class Model(object):
    def __init__(self):
        # seconds per node of analysis, per policy (running means; priors are
        # only starting points and are replaced by the first measurement)
        self.analysis = {"depth": 2e-6, "agenda": 4e-6, "sequential": 2e-7}
        self.launch = 3e-4          # seconds per launch, running mean
        self.observed = 0

    def observe(self, policy, nodes, analysis_s, launches, execute_s):
        if nodes:
            a = self.analysis[policy]
            self.analysis[policy] = 0.8 * a + 0.2 * (analysis_s / nodes)
        if launches:
            self.launch = 0.8 * self.launch + 0.2 * (execute_s / launches)
        self.observed += 1

    @staticmethod
    def mergeable(nodes):
        """Whether any two nodes share (depth, signature): if none do (a chain, a
        lone node, all-distinct calls), batching cannot pay here."""
        seen = set()
        for n in nodes:
            k = (n.depth, n.info.id)
            if k in seen:
                return True
            seen.add(k)
        return False

    def choose(self, nodes, budget):
        """Return ``(policy, reason, predicted)``."""
        n = len(nodes)
        if n <= 1 or not self.mergeable(nodes):
            return "sequential", "no two nodes can run together: nothing to merge", {}
        predicted = {p: self.analysis[p] * n for p in ("depth", "agenda")}
        exec_est = self.launch * n
        if budget is not None:
            allowed = [p for p in predicted if predicted[p] <= budget * exec_est]
            if not allowed:
                return "sequential", "analysis budget %.3g too small" % budget, predicted
        else:
            allowed = list(predicted)
        # agenda merges at least as much as depth on the graphs we see (it can
        # run any ready node, not only those of equal depth); prefer it unless
        # its analysis is predicted to cost more than it could save
        pol = "agenda" if "agenda" in allowed else allowed[0]
        return pol, "cheapest allowed policy with merging", predicted


    @staticmethod
    def passthrough_after(nodes, launches):
        """Calls to run eagerly (unrecorded) after an 'auto' flush that merged
        nothing: recording would be pure overhead. Bounded, so batchable work
        that follows is recorded again soon (the next flush re-checks)."""
        if launches < nodes or nodes < 2:
            return 0
        return max(64, 4 * nodes)


MODEL = Model()
