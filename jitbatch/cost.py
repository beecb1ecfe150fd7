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

    def groups(self, nodes):
        """Cheap upper bound of launches under depth grouping, and whether any
        signature repeats at all (if none does, batching cannot pay)."""
        seen = set()
        repeats = False
        for n in nodes:
            k = n.info.id
            if k in seen:
                repeats = True
            else:
                seen.add(k)
        return repeats

    def choose(self, nodes, budget):
        """Return ``(policy, reason, predicted)``."""
        n = len(nodes)
        if n <= 1 or not self.groups(nodes):
            return "sequential", "no signature repeats: nothing to merge", {}
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


MODEL = Model()
