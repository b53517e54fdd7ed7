// Package volcano is empty: the module exists only to pin volcano.sh/volcano and carry the
// `replace` block of Volcano's own go.mod (its k8s.io staging modules at v0.30.2), without
// which the Go toolchain cannot resolve `volcano.sh/volcano/cmd/scheduler`.
package volcano
