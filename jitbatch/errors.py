"""Exceptions raised by jitbatch (framework-free)."""


class JitBatchError(RuntimeError):
    """Base class of every error jitbatch raises on purpose."""


class FlagError(JitBatchError, ValueError):
    """A ``hybridize(dynamic_batch=...)`` flag has a bad value."""


class BatchingError(JitBatchError, ValueError):
    """A recorded call cannot be batched with its group (shape, dtype, context...)."""


class ExecutionError(JitBatchError):
    """A merged execution failed; the message names the per-sample call site."""


class StaleValueError(JitBatchError):
    """A lazy array whose graph failed, was recorded in another thread, or outlived
    ``jitbatch.uninstall()``."""


class ContractWarning(UserWarning):
    """A flagged block's graph mixes rows of different samples (or has an operator
    jitbatch has no rule for): its calls run one per sample, unbatched. Raised as
    a BatchingError instead under ``jitbatch.config.strict``."""


class BudgetWarning(UserWarning):
    """An ``analysis_budget`` keeps policy 'auto' from batching work that could
    merge (said once per budget, with the smallest budget that would batch)."""


def first_line(error):
    """The first line of an error's text (its type's name if it has none),
    for a message of jitbatch's own around a framework's error."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
