"""Suite-wide fixtures: the local control plane's fixtures come from hlat_testbed."""

pytest_plugins = ["hlat_testbed.pytest_plugin"]
