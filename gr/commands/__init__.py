"""The commands: the ``gr`` dispatcher (``cli.py``) and each subcommand's argument parsing and printing,
one module each (``train``, ``export``, ``serve``, ``evaluate``, ``predict``, ``plan``, ``data``).

The top layer of docs/design.md §3: nothing in ``gr`` imports these modules but the ``__main__``
modules that run them (``python -m gr``, ``python -m gr.serving``, ``python -m gr.export``) and
``train.py``. This package imports nothing itself, so ``gr --help`` loads only the dispatcher.
"""
