"""`python -m outbox_pipeline.cli`. See docs/operations.md#command-line."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
