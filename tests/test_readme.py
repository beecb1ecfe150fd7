"""The README's Python examples run (and batch)."""
import os
import re

import jitbatch

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "README.rst")


def _python_blocks():
    text = open(README).read()
    blocks = []
    for m in re.finditer(r"\.\. code-block:: python\n\n((?:    .*\n|\n)+)", text):
        blocks.append("\n".join(line[4:] for line in m.group(1).splitlines()))
    return blocks


def test_readme_examples_run_and_merge():
    blocks = _python_blocks()
    assert blocks, "README has no python example"
    for code in blocks:
        jitbatch.reset_stats()
        exec(compile(code, README, "exec"), {"__name__": "readme"})
        st = jitbatch.stats()
        assert 0 < st["launches"] < st["nodes"]
