"""``python -m gr COMMAND ...`` is the ``gr`` console command."""

import sys

from gr.commands.cli import main

sys.exit(main())
