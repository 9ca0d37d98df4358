"""Engine room (CLI): ``python -m outbox_pipeline.cli``."""

import sys

from . import main

sys.exit(main())
