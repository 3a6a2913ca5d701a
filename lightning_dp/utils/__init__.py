"""Internal helpers of the package, not part of its public API (names and behaviour may change without notice).

- ``naming``: "did you mean" suggestions for misspelt names.
- ``import_hooks``: run code once a third-party module is imported, without importing it.
- ``help_format``: the ``--help`` layout of the command line, the examples and the benches.
- ``plots``: privacy curves as matplotlib figures.
- ``lightning_log_filter``: drops two lines of Lightning's own log output.
"""
