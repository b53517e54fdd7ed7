// Package kueue is empty: the module exists only to pin sigs.k8s.io/kueue so that
// `go build sigs.k8s.io/kueue/cmd/kueue` builds Kueue's manager at that version.
package kueue
