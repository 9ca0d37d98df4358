"""The test kit, loaded as pytest plugins for every test folder (tests/kit: servers, schemas, writers, worker
processes, probes); each folder's own conftest adds only what its room needs."""

pytest_plugins = ["tests.kit.servers", "tests.kit.schema", "tests.kit.workers"]
