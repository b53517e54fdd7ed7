// Wrapper module: builds CoreDNS at a pinned version (see hlat_testbed/build.py).
module hlat.local/testbed/coredns

go 1.24.0

require github.com/coredns/coredns v1.13.1
