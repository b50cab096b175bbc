"""The .beton lifecycle in one place: write (write.py), inspect (inspect.py), the manifest of the tree it
was written from (manifest.py), rewriting only when not current (cache.py) and the audit of a tree before
it is written (audit.py).
"""
