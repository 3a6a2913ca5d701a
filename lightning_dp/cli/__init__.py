"""The ``lightning-dp`` command line, one module per subcommand: ``main``, ``args``, ``demo``, ``fit`` (with
``jsonargparse_errors``), ``privacy`` (``epsilon``, ``calibrate``), ``audit``. Nothing is imported here.
"""
