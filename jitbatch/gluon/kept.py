"""Recorded calls that a flush ran before their backward, kept for it.

A read of a recorded value (the loss printed before the backward) runs every
pending call in one flush, and a pipelined chunk runs part of them, merged
before any backward could keep tasks apart. Such a flush keeps its nodes'
inputs (``execute.keeps_inputs``), and a lazy array a read computes notes its
node here, so that a later backward from it can still be walked per sample
(``history.keep_unreached``). A backward that frees its graph ends both
(``history.put_back``)."""
import weakref

from ..graph import Graph

#: lazy arrays read while their recorded node kept its inputs: id -> (weak
#: reference, node); a backward that frees its graph drops its thread's, and
#: notes whose array is gone or whose node let go of its inputs (a release
#: past ``Graph.retire``'s bounds) go when there are more than PURGE
READ_HEADS = {}
PURGE = 256


def note_read(la, node):
    """Lazy array ``la``, just computed, came from recorded ``node``."""
    if len(READ_HEADS) >= PURGE:
        for k, (ref, n) in list(READ_HEADS.items()):
            if ref() is None or not n.inputs:
                READ_HEADS.pop(k, None)
        if len(READ_HEADS) >= 16 * PURGE:
            READ_HEADS.clear()
    READ_HEADS[id(la)] = (weakref.ref(la), node)


def read_node(la):
    """The node a read lazy array came from (``note_read``), or None."""
    e = READ_HEADS.get(id(la))
    return e[1] if e is not None and e[0]() is la else None


def kept_for_backward(nodes):
    """Whether a retired flush of ``nodes`` kept its recorded nodes' inputs."""
    return bool(nodes) and bool(nodes[-1].mode[0]) and bool(nodes[-1].inputs)


def keeps_recorded(g):
    """Whether graph ``g``'s latest flush kept its recorded nodes' inputs: a
    read then frees nothing."""
    gr: Graph = g
    return gr.sharing is None and bool(gr.retired) and kept_for_backward(gr.retired[-1])
