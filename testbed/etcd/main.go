// Command etcd is etcd's own server entry point, built from its published module because
// Debian's etcd-server is too old (3.4) for Kubernetes v1.35.
package main

import (
	"os"

	"go.etcd.io/etcd/server/v3/etcdmain"
)

func main() {
	etcdmain.Main(os.Args)
}
