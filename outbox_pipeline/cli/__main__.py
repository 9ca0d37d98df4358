"""Engine room (CLI): ``python -m outbox_pipeline.cli``."""

import sys

from . import main

if __name__ == "__main__":
    sys.exit(main())
