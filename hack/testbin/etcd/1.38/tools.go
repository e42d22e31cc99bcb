//go:build tools

// Package tools records the command this module builds, so that go.sum
// covers every module it needs.
package tools

import (
	_ "go.etcd.io/etcd/server/v3"
)
