"""pytest fixtures for the local Kubernetes control plane (filled in by the testbed work)."""
