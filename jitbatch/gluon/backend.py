"""The MXNet backend of the core's flush: ``jitbatch.execute.Backend`` on Gluon.

Thin by design: gathers are planned by ``gather``, batches run by their
signature's executor (``executors``), input stages found by ``stages``."""
from ..execute import Backend
from . import _mxapi, gather, stages


class GluonBackend(Backend):
    """The object every graph recorded on MXNet is flushed with."""
    can_wait = True

    def prepare(self, batches):
        gather.prepare(batches)

    def launch(self, batch):
        with _mxapi.PUSHING:
            if _mxapi.np_array_mode():   # recorded in legacy mode: flushed in it too
                with _mxapi.legacy_np():
                    batch[0].info.op.launch(batch)
                return
            batch[0].info.op.launch(batch)

    def wait(self, batch):
        """Block until a launched batch's outputs are computed (MXNet runs
        kernels asynchronously)."""
        for o in batch[0].group.outs:
            o.wait_to_read()

    def stages(self, info, nodes):
        if info.op.stages is False or not info.batchable:   # none, or nothing merges
            return None
        if _mxapi.np_array_mode():
            with _mxapi.legacy_np():
                return stages.plan_for(info, nodes)
        return stages.plan_for(info, nodes)


BACKEND = GluonBackend()
