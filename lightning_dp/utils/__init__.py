"""Internal helpers, not public API: ``naming``, ``import_hooks``, ``help_format``, ``plots``,
``lightning_log_filter``."""
