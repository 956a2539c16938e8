"""The ``dscore`` command: one module per subcommand, each with ``add_arguments`` and ``run``."""
