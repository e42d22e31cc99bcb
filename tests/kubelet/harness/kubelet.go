package main

// The kubelet side of the harness: the kubelet's own device manager
// (devicemanager.ManagerImpl) with its own registration server
// (plugin/v1beta1), composed as the kubelet composes them, except that the
// socket directory is a temporary one and every call the manager makes to the
// plugin passes through a recorder so the harness can check what was asked
// and what was answered.

import (
	"context"
	"fmt"
	"path/filepath"
	"reflect"
	"sort"
	"sync"
	"time"
	"unsafe"

	cadvisorapi "github.com/google/cadvisor/lib/model"
	"google.golang.org/grpc"
	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/klog/v2"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	"k8s.io/kubernetes/pkg/kubelet/cm/containermap"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
	plugin "k8s.io/kubernetes/pkg/kubelet/cm/devicemanager/plugin/v1beta1"
	"k8s.io/kubernetes/pkg/kubelet/cm/topologymanager"
	"k8s.io/kubernetes/pkg/kubelet/lifecycle"
)

// newManagerImpl is the device manager's own constructor. The exported
// NewManagerImpl hard-codes /var/lib/kubelet/device-plugins/kubelet.sock and
// keeps its checkpoint next to it; this one takes the socket path, which is
// what the kubelet's own tests use.
//
//go:linkname newManagerImpl k8s.io/kubernetes/pkg/kubelet/cm/devicemanager.newManagerImpl
func newManagerImpl(logger klog.Logger, socketPath string, topology []cadvisorapi.Node,
	topologyAffinityStore topologymanager.Store) (*devicemanager.ManagerImpl, error)

// The kubelet's logger (klog, which main sends to kubelet.log) and a context
// carrying it: the device manager takes one or the other on every call since
// Kubernetes 1.35.
var (
	logger = klog.Background()
	ctx    = klog.NewContext(context.Background(), logger)
)

// admission is the pod lifecycle operation the harness admits pods under: a
// new pod, as the kubelet's admit handler sees it.
const admission = lifecycle.AddOperation

// The machine the harness pretends to be: two NUMA nodes, as on a DGX H100.
var machineNUMANodes = []cadvisorapi.Node{{Id: 0}, {Id: 1}}

// noAffinity is the topology store of a kubelet running the default
// topology-manager policy "none": no container gets a NUMA affinity, so the
// device manager leaves the choice of devices to GetPreferredAllocation.
type noAffinity struct{}

func (noAffinity) GetAffinity(klog.Logger, string, string) topologymanager.TopologyHint {
	return topologymanager.TopologyHint{}
}

func (noAffinity) GetPolicy() topologymanager.Policy { return topologymanager.NewNonePolicy() }
func (noAffinity) Name() string                      { return "topology-manager" }

type allSourcesReady struct{}

func (allSourcesReady) AddSource(string) {}
func (allSourcesReady) AllReady() bool   { return true }

// connection is one successful registration: the kubelet dialled the
// plugin's socket and asked for its options.
type connection struct {
	resource string
	socket   string
	options  *pluginapi.DevicePluginOptions
	at       time.Time
}

type preferredCall struct {
	resource string
	req      *pluginapi.PreferredAllocationRequest
	resp     *pluginapi.PreferredAllocationResponse
	err      error
}

type allocateCall struct {
	resource string
	req      *pluginapi.AllocateRequest
	resp     *pluginapi.AllocateResponse
	err      error
}

// listing is what one ListAndWatch response did to the manager: the devices
// it marked unhealthy, and the capacity and allocatable the manager reported
// for the resource right after taking it.
type listing struct {
	resource              string
	unhealthy             []string
	capacity, allocatable int64
	at                    time.Time
}

// recorder sits between the registration server and the manager: it hands
// every call on unchanged and remembers it.
type recorder struct {
	m *devicemanager.ManagerImpl

	mu          sync.Mutex
	changed     chan struct{} // closed and replaced on every event
	connections []connection
	updates     int // ListAndWatch responses received
	listings    []listing
	preferred   []preferredCall
	allocations []allocateCall
}

func newRecorder(m *devicemanager.ManagerImpl) *recorder {
	return &recorder{m: m, changed: make(chan struct{})}
}

func (r *recorder) record(f func()) {
	r.mu.Lock()
	defer r.mu.Unlock()
	f()
	close(r.changed)
	r.changed = make(chan struct{})
}

// waitFor waits until cond (called with the lock held) is true or the
// timeout passes; it reports whether cond became true.
func (r *recorder) waitFor(timeout time.Duration, cond func() bool) bool {
	deadline := time.NewTimer(timeout)
	defer deadline.Stop()
	for {
		r.mu.Lock()
		ok := cond()
		ch := r.changed
		r.mu.Unlock()
		if ok {
			return true
		}
		select {
		case <-ch:
		case <-deadline.C:
			r.mu.Lock()
			defer r.mu.Unlock()
			return cond()
		}
	}
}

func (r *recorder) CleanupPluginDirectory(l klog.Logger, dir string) error {
	return r.m.CleanupPluginDirectory(l, dir)
}

func (r *recorder) PluginConnected(ctx context.Context, resource string, p plugin.DevicePlugin) error {
	rp := &recordingPlugin{DevicePlugin: p, rec: r}
	rp.client = &recordingClient{DevicePluginClient: p.API(), rec: r, resource: resource}
	err := r.m.PluginConnected(ctx, resource, rp)
	if err == nil {
		r.record(func() {
			r.connections = append(r.connections, connection{
				resource: resource, socket: p.SocketPath(), options: rp.client.lastOptions(), at: time.Now(),
			})
		})
	}
	return err
}

func (r *recorder) PluginDisconnected(l klog.Logger, resource, socket string) {
	r.m.PluginDisconnected(l, resource, socket)
}

func (r *recorder) PluginListAndWatchReceiver(logger klog.Logger, resource string, resp *pluginapi.ListAndWatchResponse) {
	r.m.PluginListAndWatchReceiver(logger, resource, resp)
	l := listing{resource: resource, at: time.Now()}
	for _, d := range resp.Devices {
		if d.Health != pluginapi.Healthy {
			l.unhealthy = append(l.unhealthy, d.ID)
		}
	}
	sort.Strings(l.unhealthy)
	l.capacity, l.allocatable = managerCapacity(r.m, resource)
	r.record(func() {
		r.updates++
		r.listings = append(r.listings, l)
	})
}

type recordingPlugin struct {
	plugin.DevicePlugin
	rec    *recorder
	client *recordingClient
}

func (p *recordingPlugin) API() pluginapi.DevicePluginClient { return p.client }

type recordingClient struct {
	pluginapi.DevicePluginClient
	rec      *recorder
	resource string

	mu      sync.Mutex
	options *pluginapi.DevicePluginOptions
}

func (c *recordingClient) lastOptions() *pluginapi.DevicePluginOptions {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.options
}

func (c *recordingClient) GetDevicePluginOptions(ctx context.Context, in *pluginapi.Empty,
	opts ...grpc.CallOption) (*pluginapi.DevicePluginOptions, error) {
	resp, err := c.DevicePluginClient.GetDevicePluginOptions(ctx, in, opts...)
	c.mu.Lock()
	c.options = resp
	c.mu.Unlock()
	return resp, err
}

func (c *recordingClient) GetPreferredAllocation(ctx context.Context, in *pluginapi.PreferredAllocationRequest,
	opts ...grpc.CallOption) (*pluginapi.PreferredAllocationResponse, error) {
	resp, err := c.DevicePluginClient.GetPreferredAllocation(ctx, in, opts...)
	c.rec.record(func() { c.rec.preferred = append(c.rec.preferred, preferredCall{c.resource, in, resp, err}) })
	return resp, err
}

func (c *recordingClient) Allocate(ctx context.Context, in *pluginapi.AllocateRequest,
	opts ...grpc.CallOption) (*pluginapi.AllocateResponse, error) {
	resp, err := c.DevicePluginClient.Allocate(ctx, in, opts...)
	c.rec.record(func() { c.rec.allocations = append(c.rec.allocations, allocateCall{c.resource, in, resp, err}) })
	return resp, err
}

// kubelet is one life of the kubelet's device manager; a restart is a new one
// over the same directory, as after `systemctl restart kubelet`.
type kubelet struct {
	manager   *devicemanager.ManagerImpl
	rec       *recorder
	startedAt time.Time
}

// startKubelet builds a device manager serving <dir>/kubelet.sock and starts
// it: the manager reads its checkpoint, its registration server removes every
// socket in dir (CleanupPluginDirectory) and listens on kubelet.sock.
func startKubelet(dir string, activePods func() []*v1.Pod) (*kubelet, error) {
	socket := filepath.Join(dir, "kubelet.sock")
	m, err := newManagerImpl(logger, socket, machineNUMANodes, noAffinity{})
	if err != nil {
		return nil, fmt.Errorf("creating the device manager: %w", err)
	}
	rec := newRecorder(m)
	srv, err := plugin.NewServer(logger, socket, rec, rec)
	if err != nil {
		return nil, fmt.Errorf("creating the registration server: %w", err)
	}
	if err := setRegistrationServer(m, srv); err != nil {
		return nil, err
	}
	startedAt := time.Now()
	err = m.Start(logger, activePods, allSourcesReady{}, containermap.NewContainerMap(), sets.New[string]())
	if err != nil {
		return nil, fmt.Errorf("starting the device manager: %w", err)
	}
	return &kubelet{manager: m, rec: rec, startedAt: startedAt}, nil
}

// stop ends this life: the registration server disconnects every plugin and
// stops serving kubelet.sock.
func (k *kubelet) stop() error { return k.manager.Stop(logger) }

// setRegistrationServer swaps the manager's registration server for one whose
// client handler is the recorder. The manager keeps it in an unexported field,
// so this goes through reflect; the type check makes a changed field fail
// loudly instead of corrupting memory.
func setRegistrationServer(m *devicemanager.ManagerImpl, srv plugin.Server) error {
	field := reflect.ValueOf(m).Elem().FieldByName("server")
	want := reflect.TypeOf((*plugin.Server)(nil)).Elem()
	if !field.IsValid() || field.Type() != want {
		return fmt.Errorf("devicemanager.ManagerImpl has no field `server %s`; this harness needs updating", want)
	}
	reflect.NewAt(field.Type(), unsafe.Pointer(field.UnsafeAddr())).Elem().Set(reflect.ValueOf(srv))
	return nil
}
