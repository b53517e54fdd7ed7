// Wrapper module: builds Kueue's manager at a pinned version (see hlat_testbed/build.py).
module hlat.local/testbed/kueue

go 1.26
