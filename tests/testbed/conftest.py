"""Tests of the local control plane and the process kubelet (fixtures: hlat_testbed)."""
