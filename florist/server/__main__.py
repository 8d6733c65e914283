"""`python -m florist.server [--model PATH] [--port N] ...`: the same as `florist engine-server`."""

import sys

from florist.server.cli import main

sys.exit(main())
