"""``python -m gr COMMAND ...`` is the ``gr`` console command."""

import sys

from gr.cli import main

sys.exit(main())
