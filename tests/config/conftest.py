"""Records which typed config fields the session's code reads (mcore_rl/config_reads.py), for test_keys_read.py.

Loaded with tests/config: the recorder's folder goes into MCORE_RL_CONFIG_READS (so every CLI run, torchrun rank
and launched server of this session records, in this process and in its children) and this process patches the
config classes at once. The keys-read tests are moved to the end of the session so they see every other test's
reads; under pytest-xdist they run in a session of their own afterwards (scripts/test.sh)."""

from __future__ import annotations

import os
import tempfile

import pytest

from mcore_rl import config_reads as reads
from tests.conftest import xdist_workers

KEYS_READ_MODULE = "test_keys_read.py"


def pytest_configure(config: pytest.Config) -> None:
    if not os.environ.get(reads.ENV):  # a folder given by the caller is kept (several sessions, one verdict)
        os.environ[reads.ENV] = tempfile.mkdtemp(prefix="mcore-rl-config-reads-")
    reads.install_from_env()


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list) -> None:
    last = [i for i in items if i.path.name == KEYS_READ_MODULE]
    items[:] = [i for i in items if i.path.name != KEYS_READ_MODULE] + last
    if xdist_workers() > 1:
        # "last" holds per worker only: another worker may still be reading keys. scripts/test.sh runs this module
        # in a second session over the same MCORE_RL_CONFIG_READS folder once the parallel one has ended.
        skip = pytest.mark.skip(reason="keys-read needs every other test done: run it after the parallel session "
                                       "with the same MCORE_RL_CONFIG_READS (scripts/test.sh does)")
        for item in last:
            item.add_marker(skip)
