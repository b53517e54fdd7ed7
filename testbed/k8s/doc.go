// Package k8s is empty: the module exists only to pin k8s.io/kubernetes and map its staging
// modules to their published versions, so `go build k8s.io/kubernetes/cmd/...` resolves.
package k8s
