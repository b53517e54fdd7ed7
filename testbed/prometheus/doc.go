// Package prometheus is empty: the module exists only to pin github.com/prometheus/prometheus
// so that `go build` builds Prometheus (with Kubernetes service discovery) and promtool.
package prometheus
