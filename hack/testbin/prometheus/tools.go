//go:build tools

// Package tools records the commands this module builds (the Prometheus
// server and promtool), so that go.sum covers every module they need.
package tools

import (
	_ "github.com/prometheus/prometheus/cmd/prometheus"
	_ "github.com/prometheus/prometheus/cmd/promtool"
)
