// Package iptables is this repository's stand-in for sigs.k8s.io/iptables-wrappers/pkg/iptables, the package
// the Kubernetes 1.38 kubelet (pkg/kubelet/kubelet_network_linux.go) sets up its iptables chains with. The Go
// module proxy refuses the real module (sigs.k8s.io/iptables-wrappers v1.0.0: 403 "not available"), so the
// test rig's 1.38 wrapper module (hack/testbin/kube/1.38) replaces it with this directory. See ../../README.md
// for why it exists and when it goes away.
//
// It has exactly what the 1.38 kubelet calls: NewBestEffort with UseInstalledMode, and on each Interface
// EnsureChain, EnsureRule, IsIPv6, Protocol and Monitor, with the tables, chains and rule positions the kubelet
// names. A Kubernetes command that needs more of the real package (kube-proxy's DetectHostMode, its
// save/restore calls) fails to compile against it rather than behave differently.
//
// UseInstalledMode runs the node's own iptables and ip6tables commands as installed (found on PATH), so the
// backend, iptables-legacy or iptables-nft, is the one the node's distribution or alternatives chose, as the
// 1.37 kubelet's k8s.io/kubernetes/pkg/util/iptables did: every command is `iptables -w 5 <op> <chain> -t
// <table> [rule...]`, the same command lines, exit codes and retries that package used. A family whose
// command is missing, or whose nat table's POSTROUTING chain cannot be listed, is left out of NewBestEffort's
// map; with neither, the map is empty and the kubelet logs that it creates no KUBE-IPTABLES-HINT chain.
package iptables
