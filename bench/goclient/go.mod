// The Go side of the Allocate floor benchmark: a client that calls a device plugin as the kubelet does, and
// a minimal Go device-plugin server. It uses the kubelet's own API package and the grpc-go version the
// kubelet v1.34.4 modules pin (tests/kubelet/go.mod), so the module cache of the test rig serves it.
module gpu-node-agent/bench/goclient

go 1.24.0

require (
	google.golang.org/grpc v1.72.1
	k8s.io/kubelet v0.34.4
)

require (
	golang.org/x/net v0.38.0 // indirect
	golang.org/x/sys v0.31.0 // indirect
	golang.org/x/text v0.23.0 // indirect
	google.golang.org/genproto/googleapis/rpc v0.0.0-20250303144028-a0af3efb3deb // indirect
	google.golang.org/protobuf v1.36.5 // indirect
)
