// Package coredns is empty: the module exists only to pin github.com/coredns/coredns, whose
// root package is the coredns command with the standard plugin set (kubernetes included).
package coredns
