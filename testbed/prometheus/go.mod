// Wrapper module: builds Prometheus and promtool at a pinned version (see hlat_testbed/build.py).
module hlat.local/testbed/prometheus

go 1.24.0
