// Command stubplugin is a small stand-in device plugin for the harness's
// self-test: it keeps the contract the harness checks (eight GPUs split over
// two NUMA nodes, NUMA-aware preferred allocation, re-registration when
// kubelet.sock is recreated, clean exit on SIGTERM), and with -fault it
// breaks one part of it, so the self-test can show each check is able to fail.
//
// With -replicas N it advertises N time-sliced replicas <uuid>::<n> of each
// GPU, and Allocate names each GPU once. While the file DIR/stub-unhealthy
// exists, the GPU whose index it holds is Unhealthy.
//
// usage: stubplugin -kubelet-dir DIR [-resource NAME] [-replicas N] [-fault NAME]
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/fsnotify/fsnotify"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// The ways the stub can break its contract, each caught by one check.
var faults = map[string]string{
	"":                "none",
	"split-numa":      "prefer devices on different NUMA nodes",
	"wrong-env":       "list every device in NVIDIA_VISIBLE_DEVICES",
	"slow-reregister": "wait 2 s before registering again after a kubelet restart",
	"leave-socket":    "leave the socket behind on SIGTERM",
	"repeat-uuid":     "name a GPU once per allocated replica in NVIDIA_VISIBLE_DEVICES",
	"no-recovery":     "keep a GPU unhealthy after DIR/stub-unhealthy is removed",
	"ignore-health":   "never mark a GPU unhealthy",
}

// healthFile names the GPU (its index) that is unhealthy while it exists.
const healthFile = "stub-unhealthy"

func main() {
	dir := flag.String("kubelet-dir", "", "directory holding kubelet.sock")
	resource := flag.String("resource", "nvidia.com/gpu", "resource name to register")
	fault := flag.String("fault", "", "contract to break: split-numa, wrong-env, slow-reregister, leave-socket, "+
		"repeat-uuid, no-recovery, ignore-health")
	replicas := flag.Int("replicas", 0, "advertise this many replicas of each GPU (0: the GPUs themselves)")
	flag.Parse()
	if *dir == "" {
		log.Fatal("-kubelet-dir is required")
	}
	if _, ok := faults[*fault]; !ok {
		log.Fatalf("unknown -fault %q", *fault)
	}
	p := &stub{dir: *dir, resource: *resource, fault: *fault, devices: gpus(8, *replicas),
		changed: make(chan struct{}), unhealthyGPU: -1}
	if err := p.run(); err != nil {
		log.Fatal(err)
	}
}

// gpus returns the devices of n GPUs with GPU-UUID-shaped IDs, or with
// replicas > 0 that many replicas <uuid>::<k> of each; the first half of the
// GPUs sits on NUMA node 0, the rest on node 1.
func gpus(n, replicas int) []*pluginapi.Device {
	var devs []*pluginapi.Device
	for i := 0; i < n; i++ {
		uuid := fmt.Sprintf("GPU-%08x-0000-4000-8000-%012x", 0x5eed0000+i, i)
		ids := []string{uuid}
		if replicas > 0 {
			ids = nil
			for k := 0; k < replicas; k++ {
				ids = append(ids, fmt.Sprintf("%s::%d", uuid, k))
			}
		}
		for _, id := range ids {
			devs = append(devs, &pluginapi.Device{
				ID:       id,
				Health:   pluginapi.Healthy,
				Topology: &pluginapi.TopologyInfo{Nodes: []*pluginapi.NUMANode{{ID: int64(i / (n / 2))}}},
			})
		}
	}
	return devs
}

// gpuOf is the GPU UUID behind a device ID (a replica's GPU, or the ID).
func gpuOf(id string) string {
	uuid, _, _ := strings.Cut(id, "::")
	return uuid
}

type stub struct {
	dir, resource, fault string
	devices              []*pluginapi.Device

	mu           sync.Mutex
	server       *grpc.Server
	socket       string
	serial       int
	unhealthyGPU int           // index of the GPU named in healthFile, -1 for none
	changed      chan struct{} // closed and replaced when the devices' health changes
}

// current is the device list as ListAndWatch sends it now, and a channel
// closed at the next change.
func (p *stub) current() ([]*pluginapi.Device, <-chan struct{}) {
	p.mu.Lock()
	defer p.mu.Unlock()
	unhealthy := ""
	if p.unhealthyGPU >= 0 {
		unhealthy = fmt.Sprintf("GPU-%08x-", 0x5eed0000+p.unhealthyGPU)
	}
	devs := make([]*pluginapi.Device, len(p.devices))
	for i, d := range p.devices {
		health := d.Health
		if unhealthy != "" && strings.HasPrefix(d.ID, unhealthy) {
			health = pluginapi.Unhealthy
		}
		devs[i] = &pluginapi.Device{ID: d.ID, Health: health, Topology: d.Topology}
	}
	return devs, p.changed
}

// readHealth takes the unhealthy GPU from healthFile; with no file, none.
func (p *stub) readHealth() {
	if p.fault == "ignore-health" {
		return
	}
	gpu := -1
	if data, err := os.ReadFile(filepath.Join(p.dir, healthFile)); err == nil {
		if _, err := fmt.Sscan(string(data), &gpu); err != nil {
			log.Printf("%s: %v", healthFile, err)
			return
		}
	} else if p.fault == "no-recovery" {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if gpu != p.unhealthyGPU {
		p.unhealthyGPU = gpu
		close(p.changed)
		p.changed = make(chan struct{})
	}
}

func (p *stub) run() error {
	watcher, err := fsnotify.NewWatcher()
	if err != nil {
		return err
	}
	defer watcher.Close()
	if err := watcher.Add(p.dir); err != nil {
		return err
	}
	if err := p.serve(); err != nil {
		return err
	}
	if err := p.register(); err != nil {
		return err
	}

	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	kubeletSock := filepath.Join(p.dir, "kubelet.sock")
	for {
		select {
		case <-signals:
			p.stop(p.fault != "leave-socket")
			return nil
		case ev := <-watcher.Events:
			if ev.Name == filepath.Join(p.dir, healthFile) {
				p.readHealth()
				continue
			}
			if ev.Name != kubeletSock || !ev.Has(fsnotify.Create) {
				continue
			}
			if p.fault == "slow-reregister" {
				time.Sleep(2 * time.Second)
			}
			// The restarted kubelet has removed every socket in the directory:
			// serve on a new one, then register again.
			p.stop(true)
			if err := p.serve(); err != nil {
				return err
			}
			if err := p.register(); err != nil {
				log.Printf("registration after kubelet restart failed: %v", err)
			}
		case err := <-watcher.Errors:
			log.Printf("watch: %v", err)
		}
	}
}

// serve starts the DevicePlugin service on a socket whose name is new for
// every server this process starts.
func (p *stub) serve() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.serial++
	socket := filepath.Join(p.dir, fmt.Sprintf("stub-%d-%d.sock", os.Getpid(), p.serial))
	_ = os.Remove(socket)
	ln, err := net.Listen("unix", socket)
	if err != nil {
		return err
	}
	// This process removes its own socket; the kubelet may already have
	// removed it, and a late unlink must never hit a newer file.
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	srv := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(srv, &service{stub: p})
	p.server, p.socket = srv, socket
	go func() { _ = srv.Serve(ln) }()
	return nil
}

func (p *stub) stop(removeSocket bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.server == nil {
		return
	}
	p.server.Stop()
	p.server = nil
	if removeSocket {
		_ = os.Remove(p.socket)
	}
}

// register tells the kubelet about the current socket, retrying while the
// kubelet is not listening yet. Each attempt uses a fresh connection: one made
// before a kubelet restart may sit in reconnect backoff.
func (p *stub) register() error {
	p.mu.Lock()
	endpoint := filepath.Base(p.socket)
	p.mu.Unlock()
	target := "unix://" + filepath.Join(p.dir, "kubelet.sock")
	deadline := time.Now().Add(10 * time.Second)
	for {
		err := p.registerOnce(target, endpoint)
		if err == nil || time.Now().After(deadline) {
			return err
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func (p *stub) registerOnce(target, endpoint string) error {
	conn, err := grpc.NewClient(target, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version:      pluginapi.Version,
		Endpoint:     endpoint,
		ResourceName: p.resource,
		Options:      &pluginapi.DevicePluginOptions{GetPreferredAllocationAvailable: true},
	})
	return err
}

type service struct {
	pluginapi.UnimplementedDevicePluginServer
	stub *stub
}

func (s *service) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{GetPreferredAllocationAvailable: true}, nil
}

func (s *service) ListAndWatch(_ *pluginapi.Empty, stream pluginapi.DevicePlugin_ListAndWatchServer) error {
	for {
		devices, changed := s.stub.current()
		if err := stream.Send(&pluginapi.ListAndWatchResponse{Devices: devices}); err != nil {
			return err
		}
		select {
		case <-changed:
		case <-stream.Context().Done():
			return nil
		}
	}
}

func (s *service) GetPreferredAllocation(_ context.Context, req *pluginapi.PreferredAllocationRequest,
) (*pluginapi.PreferredAllocationResponse, error) {
	resp := &pluginapi.PreferredAllocationResponse{}
	for _, cr := range req.ContainerRequests {
		ids := s.stub.prefer(cr.AvailableDeviceIDs, cr.MustIncludeDeviceIDs, int(cr.AllocationSize))
		resp.ContainerResponses = append(resp.ContainerResponses,
			&pluginapi.ContainerPreferredAllocationResponse{DeviceIDs: ids})
	}
	return resp, nil
}

// prefer fills the request from the NUMA node with the most available devices
// after the ones that must be included.
func (p *stub) prefer(available, mustInclude []string, size int) []string {
	node := map[string]int64{}
	for _, d := range p.devices {
		node[d.ID] = d.Topology.Nodes[0].ID
	}
	chosen := append([]string(nil), mustInclude...)
	taken := map[string]bool{}
	for _, id := range mustInclude {
		taken[id] = true
	}
	byNode := map[int64][]string{}
	for _, id := range available {
		if !taken[id] {
			byNode[node[id]] = append(byNode[node[id]], id)
		}
	}
	nodes := make([]int64, 0, len(byNode))
	for n, ids := range byNode {
		sort.Strings(ids)
		nodes = append(nodes, n)
	}
	sort.Slice(nodes, func(i, j int) bool {
		if len(byNode[nodes[i]]) != len(byNode[nodes[j]]) {
			return len(byNode[nodes[i]]) > len(byNode[nodes[j]])
		}
		return nodes[i] < nodes[j]
	})
	if p.fault == "split-numa" {
		for i := 0; len(chosen) < size && i < len(available); i++ {
			n := nodes[i%len(nodes)]
			if k := i / len(nodes); k < len(byNode[n]) {
				chosen = append(chosen, byNode[n][k])
			}
		}
		return chosen
	}
	for _, n := range nodes {
		for _, id := range byNode[n] {
			if len(chosen) == size {
				return chosen
			}
			chosen = append(chosen, id)
		}
	}
	return chosen
}

func (s *service) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	resp := &pluginapi.AllocateResponse{}
	for _, cr := range req.ContainerRequests {
		var ids []string
		for _, id := range cr.DevicesIds {
			if gpu := gpuOf(id); s.stub.fault == "repeat-uuid" || !slices.Contains(ids, gpu) {
				ids = append(ids, gpu)
			}
		}
		if s.stub.fault == "wrong-env" {
			ids = nil
			for _, d := range s.stub.devices {
				ids = append(ids, d.ID)
			}
		}
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": strings.Join(ids, ",")},
		})
	}
	return resp, nil
}

func (s *service) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest,
) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}
