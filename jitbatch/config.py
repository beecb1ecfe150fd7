"""Process-wide settings (plain module attributes; read on the hot path)."""

#: the pending graph flushes itself when it holds this many nodes (bounded memory)
max_pending = 200000

#: store a full stack per recorded node (slow) instead of one ``file:line`` call site
debug = False
