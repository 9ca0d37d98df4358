"""Runs a tests/kit/worker.py relay worker with its log at INFO (the kit's script leaves logging unconfigured, so
only warnings would reach its output): the harness scans every line a worker writes for the password."""

from __future__ import annotations

import json
import logging
import sys

from tests.kit.worker import main

if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    main(json.loads(sys.argv[1]))
