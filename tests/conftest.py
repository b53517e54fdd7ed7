"""Suite-wide fixtures: the local control plane's fixtures come from hlat_testbed.

The order of the test files is set here for `make test`'s two workers (`--dist loadfile
--no-loadscope-reorder`: each worker takes the next whole file in this order): the two soaks
first, one to each worker, then the other files, the most tests first (what xdist's own reorder
does). The soaks are the longest files by far (about 17 minutes each): left to the end of the
queue, they used to run one after the other on whichever worker came free, the suite's tail.
"""

from __future__ import annotations

import pytest

pytest_plugins = ["hlat_testbed.pytest_plugin"]

FIRST = ("tests/operator/test_e2e_soak.py", "tests/operator/test_e2e_soak_inplace.py")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    order = sorted(files, key=lambda f: (f not in FIRST, FIRST.index(f) if f in FIRST else 0,
                                         -len(files[f])))
    items[:] = [item for f in order for item in files[f]]
