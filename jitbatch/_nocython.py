"""Stands in for Cython's ``cython`` module when jitbatch runs from source without
Cython installed: the sources only ask ``cython.compiled`` (local type
annotations are never evaluated)."""

compiled = False
