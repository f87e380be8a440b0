"""Versioned helper scripts that run inside containers (stdlib only, never imported locally).

A helper named `inspect-source` is the file `inspect_source.py` ('-' maps to '_'). It is
installed once per content hash as BASE/helpers/<sha256[:16]>/<file> by Container.helper().
"""
