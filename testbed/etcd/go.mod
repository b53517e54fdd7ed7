// Wrapper module: builds etcd's server at a pinned version (see hlat_testbed/build.py).
module hlat.local/testbed/etcd

go 1.24

require go.etcd.io/etcd/server/v3 v3.6.6
