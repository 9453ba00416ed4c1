"""The ``kvport`` command line: one module per command group, wired together in :mod:`main`."""
