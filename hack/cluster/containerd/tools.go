//go:build tools

// The containerd of the single-node cluster, pinned in go.mod: the daemon and its runc shim.
package tools

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
)
