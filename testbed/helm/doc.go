// Package helm is empty: the module exists only to pin helm.sh/helm/v3 so that
// `go build helm.sh/helm/v3/cmd/helm` builds the Helm CLI at that version.
package helm
