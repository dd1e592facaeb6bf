"""Utilities, the bottom layer of docs/design.md §3: atomic writes (``atomic``), file checksums (``checksums``),
run locks (``run_lock``), crash points for the reliability tests (``crash_points``), lazy package attributes
(``lazy``), finiteness checks (``finite``), devices and backend autoload (``devices``), console quieting
(``console``), the commands' one-line errors (``cli_errors``), config value checks (``config_checks``) and the
host's available memory and this process's resident set (``host``).

They import nothing of ``gr`` but each other (the contract in pyproject.toml); this package imports
nothing itself.
"""
