"""``python -m gr.export RUN_DIR EXPORT_DIR`` and ``python -m gr.export check EXPORT_DIR`` (``gr export``,
``gr check``): the command lives in ``gr.commands.export``."""

import sys

from gr.commands.export import main

if __name__ == "__main__":
    sys.exit(main())
