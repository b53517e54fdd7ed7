"""A real local Kubernetes cluster for HLAT's tests and demo.

The control plane (etcd, kube-apiserver, kube-scheduler, kube-controller-manager, CoreDNS) is
built from upstream Go modules and run as local processes; a small process kubelet registers
trn1-like Nodes and runs pods as processes in their own network namespaces; faults (killed or
hung processes, lost nodes) are injected on demand. Entry points: ``hlat-cluster`` (cli.py),
``Cluster`` (cluster.py) and the pytest fixtures (pytest_plugin.py). See docs/testbed.md.
"""
