"""``python -m gr.serving serve | rank | generate ...`` (``gr serve | rank | generate``): the command
lives in ``gr.commands.serve``."""

import sys

from gr.commands.serve import main

if __name__ == "__main__":
    sys.exit(main())
