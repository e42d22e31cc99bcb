// A stand-in for sigs.k8s.io/iptables-wrappers v1.0.0, which the Kubernetes 1.38 kubelet imports and the Go
// module proxy refuses (403 "not available"); see README.md. Its requirements are the ones the real module's
// go.mod names that this code uses, at the versions k8s.io/kubernetes v1.38.0-beta.0 pins, so the build list of
// the wrapper module is the one the real module would give.
module sigs.k8s.io/iptables-wrappers

go 1.26

require k8s.io/klog/v2 v2.140.0

require github.com/go-logr/logr v1.4.4 // indirect
