//go:build tools

// Package tools records the command this module builds, so that go.sum
// covers every module it needs.
package tools

import (
	_ "helm.sh/helm/v3/cmd/helm"
)
