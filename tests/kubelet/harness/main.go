// Command kubelet-harness checks a device plugin against the kubelet's own
// device-manager code (k8s.io/kubernetes/pkg/kubelet/cm/devicemanager).
//
// It serves kubelet.sock in a fresh temporary directory, starts the plugin as
// a child process, and checks registration, capacity, NUMA topology, the
// GetPreferredAllocation and Allocate round trip of a pod through the
// manager, re-registration after a kubelet restart, and a clean exit on
// SIGTERM. It prints one PASS or FAIL line per check and exits 1 if any
// check failed. -scenario mig, multi, replicas and health check MIG devices,
// several resources in one pod, time-sliced replicas and a health change
// reaching the manager's allocatable (scenarios.go).
//
// usage: kubelet-harness [flags] [-- plugin command...]
//
// In the plugin command, {dir} stands for the socket directory. Without a
// command it runs <repo>/.venv/bin/gpu-agent against the mock DGX H100
// (-scenario gpu only).
package main

import (
	"flag"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/klog/v2"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
	"k8s.io/kubernetes/pkg/kubelet/cm/devicemanager"
)

// The checks, in the order they run; every run prints all of them.
var checkNames = []string{
	"registration",
	"plugin-options",
	"capacity",
	"device-ids",
	"numa-topology",
	"topology-hints",
	"preferred-allocation",
	"allocate",
	"allocate-env",
	"kubelet-restart",
	"capacity-after-restart",
	"sigterm-exit",
	"socket-removed",
}

// The socket path limit of AF_UNIX (sun_path) on Linux, with its NUL.
const maxSocketPath = 107

var gpuUUID = regexp.MustCompile(`^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)

type options struct {
	resource       string
	devices        int
	request        int
	envVar         string
	reregister     time.Duration
	registerWithin time.Duration
	expectNUMA     map[string]int64
	repo           string
	keep           bool
	pluginArgv     []string

	// The scenarios other than "gpu" (scenarios.go).
	scenario     string
	resources    []resourceSpec
	replicas     int
	replicaGPUs  int
	inject       string
	recover      string
	unhealthy    string
	healthWithin time.Duration
	oneContainer bool
	deviceList   string
	expectDev    map[string]string
}

func main() {
	os.Exit(run())
}

func run() int {
	opts, err := parseFlags()
	if err != nil {
		fmt.Fprintln(os.Stderr, "kubelet-harness:", err)
		return 2
	}
	dir, err := os.MkdirTemp("", "kh")
	if err != nil {
		fmt.Fprintln(os.Stderr, "kubelet-harness:", err)
		return 2
	}
	if opts.keep {
		fmt.Fprintln(os.Stderr, "kubelet-harness: keeping", dir)
	} else {
		defer os.RemoveAll(dir)
	}
	klogFile, err := os.Create(filepath.Join(dir, "kubelet.log"))
	if err != nil {
		fmt.Fprintln(os.Stderr, "kubelet-harness:", err)
		return 2
	}
	defer klogFile.Close()
	klog.SetOutput(klogFile)
	defer klog.Flush()

	r := &report{names: checkNames}
	h := &harness{opts: opts, dir: dir, report: r}
	go h.abortOnSignal()
	if opts.scenario == "gpu" {
		h.run()
	} else {
		r.names = opts.scenarioChecks()
		h.runScenario()
	}
	r.finish()
	if r.failed {
		fmt.Fprintf(os.Stderr, "--- plugin output (last 40 lines) ---\n%s\n", tail(filepath.Join(dir, "plugin.log"), 40))
		fmt.Fprintf(os.Stderr, "--- kubelet log (last 40 lines) ---\n%s\n", tail(filepath.Join(dir, "kubelet.log"), 40))
		return 1
	}
	return 0
}

func parseFlags() (*options, error) {
	o := &options{}
	var expectNUMA string
	flag.StringVar(&o.resource, "resource", "nvidia.com/gpu", "resource name the plugin registers")
	flag.IntVar(&o.devices, "devices", 8, "number of devices the plugin advertises")
	flag.IntVar(&o.request, "request", 2, "devices the test pod asks for")
	flag.StringVar(&o.envVar, "env", "NVIDIA_VISIBLE_DEVICES", "variable Allocate must set to the allocated IDs")
	flag.DurationVar(&o.reregister, "reregister-within", time.Second, "limit for re-registration after a kubelet restart")
	flag.DurationVar(&o.registerWithin, "register-within", 20*time.Second, "limit for the first registration")
	flag.StringVar(&expectNUMA, "expect-numa", "", "exact NUMA node per device, as ID=node,ID=node,...")
	flag.StringVar(&o.repo, "repo", ".", "repository whose .venv/bin/gpu-agent is the default plugin")
	flag.BoolVar(&o.keep, "keep", false, "keep the socket directory and logs")
	verbosity := flag.String("v", "0", "kubelet log verbosity (klog -v), logged to kubelet.log")
	flag.StringVar(&o.scenario, "scenario", "gpu", "checks to run: "+strings.Join(scenarioNames(), ", "))
	resources := flag.String("resources", "", "-scenario other than gpu: the resources the plugin registers, "+
		"as NAME=DEVICES:REQUEST,... (REQUEST: devices the pod's container for NAME asks for)")
	flag.IntVar(&o.replicas, "replicas", 4, "-scenario replicas: replicas per GPU")
	flag.IntVar(&o.replicaGPUs, "replica-gpus", 1, "-scenario replicas: GPUs the preferred replicas are on")
	flag.StringVar(&o.inject, "inject", "", "-scenario health: shell command that makes one device unhealthy")
	flag.StringVar(&o.recover, "recover", "", "-scenario health: shell command that clears the fault (optional)")
	flag.StringVar(&o.unhealthy, "unhealthy", "", "-scenario health: IDs of the devices -inject makes unhealthy, "+
		"as ID,ID,... (default: any one device)")
	flag.DurationVar(&o.healthWithin, "health-within", 15*time.Second,
		"-scenario health: limit for each health change to reach the manager")
	expectDev := flag.String("expect-dev", "", "-scenario mig, multi, replicas: the GPU device node the runtime "+
		"must get for each device, as ID=/dev/nvidiaN,... (adds the check allocate-devices)")
	flag.BoolVar(&o.oneContainer, "one-container", false, "-scenario multi: ask for every resource in one container")
	flag.StringVar(&o.deviceList, "device-list", "envvar", "-scenario mig, multi, replicas: how Allocate names "+
		"the devices, envvar (NVIDIA_VISIBLE_DEVICES) or cdi-cri (CDI devices nvidia.com/gpu=ID)")
	flag.Parse()
	if *expectDev != "" {
		o.expectDev = map[string]string{}
		for _, pair := range strings.Split(*expectDev, ",") {
			id, node, ok := strings.Cut(pair, "=")
			if !ok || !gpuDeviceNode.MatchString(node) {
				return nil, fmt.Errorf("-expect-dev: %q is not ID=/dev/nvidiaN", pair)
			}
			o.expectDev[id] = node
		}
	}
	set := map[string]bool{}
	flag.Visit(func(f *flag.Flag) { set[f.Name] = true })
	if err := o.scenarioFlags(*resources, set); err != nil {
		return nil, err
	}

	klogFlags := flag.NewFlagSet("klog", flag.ContinueOnError)
	klog.InitFlags(klogFlags)
	if err := klogFlags.Set("v", *verbosity); err != nil {
		return nil, fmt.Errorf("-v: %w", err)
	}
	// The kubelet's log goes to kubelet.log only; stdout is for check lines.
	for name, value := range map[string]string{
		"logtostderr": "false", "stderrthreshold": "FATAL", "one_output": "true",
	} {
		if err := klogFlags.Set(name, value); err != nil {
			return nil, err
		}
	}
	if expectNUMA != "" {
		o.expectNUMA = map[string]int64{}
		for _, pair := range strings.Split(expectNUMA, ",") {
			id, node, ok := strings.Cut(pair, "=")
			n, err := strconv.ParseInt(node, 10, 64)
			if !ok || err != nil {
				return nil, fmt.Errorf("-expect-numa: %q is not ID=node", pair)
			}
			o.expectNUMA[id] = n
		}
	}
	o.pluginArgv = flag.Args()
	if len(o.pluginArgv) == 0 && o.scenario != "gpu" {
		return nil, fmt.Errorf("-scenario %s needs the plugin command after --", o.scenario)
	}
	if len(o.pluginArgv) == 0 {
		agent, err := filepath.Abs(filepath.Join(o.repo, ".venv", "bin", "gpu-agent"))
		if err != nil {
			return nil, err
		}
		o.pluginArgv = []string{agent, "run", "--nvml", "mock:dgx-h100", "--kubelet-dir", "{dir}",
			"--no-kube", "--metrics-port", "0"}
	}
	return o, nil
}

// report prints one line per check and remembers whether any failed.
type report struct {
	names  []string // the checks of the scenario, in order
	done   map[string]bool
	failed bool
}

func (r *report) line(ok bool, name, format string, args ...any) {
	if r.done == nil {
		r.done = map[string]bool{}
	}
	if r.done[name] {
		panic("check reported twice: " + name)
	}
	r.done[name] = true
	verdict := "PASS"
	if !ok {
		verdict = "FAIL"
		r.failed = true
	}
	fmt.Printf("%s %s: %s\n", verdict, name, fmt.Sprintf(format, args...))
}

func (r *report) pass(name, format string, args ...any) { r.line(true, name, format, args...) }
func (r *report) fail(name, format string, args ...any) { r.line(false, name, format, args...) }

// check reports a failure when err is set, a pass with detail otherwise.
func (r *report) check(name string, err error, detail string) bool {
	if err != nil {
		r.fail(name, "%v", err)
		return false
	}
	r.pass(name, "%s", detail)
	return true
}

// finish reports every check that did not get to run as failed.
func (r *report) finish() {
	for _, name := range r.names {
		if !r.done[name] {
			r.fail(name, "not run")
		}
	}
}

type harness struct {
	opts   *options
	dir    string
	report *report

	pod     *v1.Pod
	plugin  *pluginProcess
	sockets []string // the plugin's sockets, from its newest registrations

	mu      sync.Mutex
	started *pluginProcess // h.plugin, for the signal handler
}

// abortOnSignal ends the plugin and removes the socket directory when the
// harness is interrupted, then exits as the signal would have.
func (h *harness) abortOnSignal() {
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
	sig := <-signals
	h.mu.Lock()
	if h.started != nil {
		h.started.kill()
	}
	h.mu.Unlock()
	if !h.opts.keep {
		_ = os.RemoveAll(h.dir)
	}
	fmt.Fprintf(os.Stderr, "kubelet-harness: %s\n", sig)
	os.Exit(128 + int(sig.(syscall.Signal)))
}

func (h *harness) container() *v1.Container { return &h.pod.Spec.Containers[0] }

func (h *harness) activePods() []*v1.Pod { return []*v1.Pod{h.pod} }

func (h *harness) run() {
	o, r := h.opts, h.report
	if n := len(filepath.Join(h.dir, "kubelet.sock")); n > maxSocketPath-40 {
		r.fail("registration", "socket directory %s leaves too little room under the %d-byte socket path limit",
			h.dir, maxSocketPath)
		return
	}
	h.pod = gpuPod(o.resource, o.request)

	k, err := startKubelet(h.dir, h.activePods)
	if err != nil {
		r.fail("registration", "%v", err)
		return
	}
	defer func() { _ = k.stop() }()

	h.plugin, err = startPlugin(o.pluginArgv, h.dir, filepath.Join(h.dir, "plugin.log"))
	if err != nil {
		r.fail("registration", "%v", err)
		return
	}
	h.mu.Lock()
	h.started = h.plugin
	h.mu.Unlock()
	defer h.plugin.kill()
	go func() {
		<-h.plugin.done
		k.rec.record(func() {}) // wake a wait for the first registration
	}()

	if !h.checkRegistration(k) {
		return
	}
	devices := h.checkCapacity(k, "capacity")
	if devices == nil {
		return
	}
	h.checkDeviceIDs(devices)
	h.checkNUMA(devices)
	h.checkTopologyHints(k)
	h.checkAllocation(k, devices)

	if err := k.stop(); err != nil {
		r.fail("kubelet-restart", "stopping the device manager: %v", err)
		return
	}
	k2, err := startKubelet(h.dir, h.activePods)
	if err != nil {
		r.fail("kubelet-restart", "%v", err)
		return
	}
	defer func() { _ = k2.stop() }()
	if h.checkReregistration(k2) {
		h.checkCapacity(k2, "capacity-after-restart")
	}
	h.checkTermination()
}

func gpuPod(resourceName string, count int) *v1.Pod {
	quantity := resource.MustParse(strconv.Itoa(count))
	limits := v1.ResourceList{v1.ResourceName(resourceName): quantity}
	return &v1.Pod{
		ObjectMeta: metav1.ObjectMeta{
			Name: "gpu-pod", Namespace: "default", UID: types.UID("4f6d7a9e-0b1c-4d2e-8f3a-5b6c7d8e9f01"),
		},
		Spec: v1.PodSpec{Containers: []v1.Container{{
			Name:      "cuda",
			Image:     "cuda",
			Resources: v1.ResourceRequirements{Limits: limits, Requests: limits},
		}}},
	}
}

func (h *harness) checkRegistration(k *kubelet) bool {
	o, r := h.opts, h.report
	registered := k.rec.waitFor(o.registerWithin, func() bool {
		return len(k.rec.connections) > 0 || h.plugin.exited()
	})
	k.rec.mu.Lock()
	conns := slices.Clone(k.rec.connections)
	k.rec.mu.Unlock()
	if !registered || len(conns) == 0 {
		if h.plugin.exited() {
			r.fail("registration", "plugin exited before registering: %v", h.plugin.err)
		} else {
			r.fail("registration", "no registration on kubelet.sock within %s", o.registerWithin)
		}
		return false
	}
	c := conns[0]
	h.sockets = []string{c.socket}
	if c.resource != o.resource {
		r.fail("registration", "registered resource %q, want %q", c.resource, o.resource)
		return false
	}
	r.pass("registration", "%s on %s after %d ms", c.resource, filepath.Base(c.socket),
		c.at.Sub(k.startedAt).Milliseconds())

	switch {
	case c.options == nil:
		r.fail("plugin-options", "GetDevicePluginOptions returned no options")
	case !c.options.GetPreferredAllocationAvailable:
		r.fail("plugin-options", "get_preferred_allocation_available=false, want true")
	default:
		r.pass("plugin-options", "get_preferred_allocation_available=true pre_start_required=%t",
			c.options.PreStartRequired)
	}
	return true
}

// checkCapacity waits for a ListAndWatch response to reach the manager, then
// checks the node capacity the kubelet would report. It returns the healthy
// devices, or nil after a failure.
func (h *harness) checkCapacity(k *kubelet, name string) map[string]*pluginapi.Device {
	o, r := h.opts, h.report
	if !k.rec.waitFor(5*time.Second, func() bool { return k.rec.updates > 0 }) {
		r.fail(name, "no ListAndWatch response within 5s of registering")
		return nil
	}
	// The plugin may send its list in more than one message; the last one
	// counts. Give it a moment to settle on the expected count.
	var capacity, allocatable int64
	settled := k.rec.waitFor(2*time.Second, func() bool {
		capacity, allocatable = k.capacity(o.resource)
		return capacity == int64(o.devices) && allocatable == int64(o.devices)
	})
	capacity, allocatable = k.capacity(o.resource)
	if !settled {
		r.fail(name, "capacity %s=%d allocatable=%d, want %d and %d", o.resource, capacity, allocatable,
			o.devices, o.devices)
		return nil
	}
	r.pass(name, "capacity %s=%d allocatable=%d", o.resource, capacity, allocatable)
	return k.manager.GetAllocatableDevices(logger)[o.resource]
}

func (k *kubelet) capacity(name string) (capacity, allocatable int64) {
	return managerCapacity(k.manager, name)
}

// managerCapacity is the capacity and allocatable the manager reports for a
// resource, as the kubelet puts them in the node's status.
func managerCapacity(m *devicemanager.ManagerImpl, name string) (capacity, allocatable int64) {
	c, a, _ := m.GetCapacity(logger)
	rn := v1.ResourceName(name)
	if q, ok := c[rn]; ok {
		capacity = q.Value()
	}
	if q, ok := a[rn]; ok {
		allocatable = q.Value()
	}
	return capacity, allocatable
}

func (h *harness) checkDeviceIDs(devices map[string]*pluginapi.Device) {
	var bad []string
	for id, d := range devices {
		if !gpuUUID.MatchString(id) || d.Health != pluginapi.Healthy {
			bad = append(bad, fmt.Sprintf("%q (%s)", id, d.Health))
		}
	}
	sort.Strings(bad)
	if len(bad) > 0 {
		h.report.fail("device-ids", "not a healthy GPU UUID: %s", strings.Join(bad, ", "))
		return
	}
	h.report.pass("device-ids", "%d distinct GPU UUIDs, all %s", len(devices), pluginapi.Healthy)
}

// numaNode returns the one NUMA node of a device, or an error naming what is
// wrong with its topology.
func numaNode(d *pluginapi.Device) (int64, error) {
	if d.Topology == nil || len(d.Topology.Nodes) == 0 {
		return 0, fmt.Errorf("%s has no NUMA topology", d.ID)
	}
	if len(d.Topology.Nodes) != 1 {
		ids := make([]string, len(d.Topology.Nodes))
		for i, n := range d.Topology.Nodes {
			ids[i] = strconv.FormatInt(n.ID, 10)
		}
		return 0, fmt.Errorf("%s is on NUMA nodes [%s], want one", d.ID, strings.Join(ids, " "))
	}
	return d.Topology.Nodes[0].ID, nil
}

func (h *harness) checkNUMA(devices map[string]*pluginapi.Device) {
	o, r := h.opts, h.report
	perNode := map[int64]int{}
	var problems []string
	for id, d := range devices {
		node, err := numaNode(d)
		if err != nil {
			problems = append(problems, err.Error())
			continue
		}
		perNode[node]++
		if want, ok := o.expectNUMA[id]; o.expectNUMA != nil && (!ok || want != node) {
			problems = append(problems, fmt.Sprintf("%s on NUMA node %d, want %s", id, node, expectedNode(o, id)))
		}
	}
	half := o.devices / 2
	if perNode[0] != half || perNode[1] != o.devices-half || len(perNode) != 2 {
		problems = append(problems, fmt.Sprintf("devices per NUMA node %v, want map[0:%d 1:%d]",
			perNode, half, o.devices-half))
	}
	sort.Strings(problems)
	if len(problems) > 0 {
		r.fail("numa-topology", "%s", strings.Join(problems, "; "))
		return
	}
	detail := fmt.Sprintf("NUMA node 0: %d devices, NUMA node 1: %d devices", perNode[0], perNode[1])
	if o.expectNUMA != nil {
		detail += ", each on its expected node"
	}
	r.pass("numa-topology", "%s", detail)
}

func expectedNode(o *options, id string) string {
	if n, ok := o.expectNUMA[id]; ok {
		return strconv.FormatInt(n, 10)
	}
	return "no device with this ID"
}

// checkTopologyHints asks the manager for the hints it gives the Topology
// Manager for the pod: with the devices split 4 and 4 over two NUMA nodes, a
// request of 2 fits either node alone (preferred) or both (not preferred).
func (h *harness) checkTopologyHints(k *kubelet) {
	o := h.opts
	hints := k.manager.GetTopologyHints(logger, h.pod, h.container(), admission)[o.resource]
	got := make([]string, len(hints))
	for i, hint := range hints {
		got[i] = formatHint(hint.NUMANodeAffinity.GetBits(), hint.Preferred)
	}
	want := []string{formatHint([]int{0}, true), formatHint([]int{1}, true), formatHint([]int{0, 1}, false)}
	if !slices.Equal(got, want) {
		h.report.fail("topology-hints", "hints for %d x %s: %v, want %v", o.request, o.resource, got, want)
		return
	}
	h.report.pass("topology-hints", "%v", got)
}

func formatHint(nodes []int, preferred bool) string {
	p := "preferred"
	if !preferred {
		p = "not-preferred"
	}
	return fmt.Sprintf("numa%v:%s", nodes, p)
}

// checkAllocation admits the pod's container through the manager, the way the
// kubelet's admission handler does, and checks both plugin calls it made.
func (h *harness) checkAllocation(k *kubelet, devices map[string]*pluginapi.Device) {
	o, r := h.opts, h.report
	allocErr := k.manager.Allocate(ctx, h.pod, h.container(), admission)

	k.rec.mu.Lock()
	preferred := slices.Clone(k.rec.preferred)
	allocations := slices.Clone(k.rec.allocations)
	k.rec.mu.Unlock()

	answer, err := checkPreferred(preferred, devices, o.request)
	r.check("preferred-allocation", err, fmt.Sprintf("asked for %d of %d, answered %v (NUMA node %d)",
		o.request, len(devices), answer, nodeOf(devices, answer)))

	allocated, err := checkAllocate(k, h.pod, o.resource, allocErr, allocations, answer)
	if !r.check("allocate", err, fmt.Sprintf("Allocate(%v); the manager assigned %v", allocated, allocated)) {
		r.fail("allocate-env", "not checked: allocation failed")
		return
	}
	value, err := checkEnv(k, h.pod, o.envVar, allocations[0], allocated)
	r.check("allocate-env", err, fmt.Sprintf("%s=%s", o.envVar, value))
}

func checkPreferred(calls []preferredCall, devices map[string]*pluginapi.Device, size int) ([]string, error) {
	if len(calls) != 1 {
		return nil, fmt.Errorf("the manager called GetPreferredAllocation %d times, want 1", len(calls))
	}
	c := calls[0]
	if c.err != nil {
		return nil, fmt.Errorf("GetPreferredAllocation failed: %v", c.err)
	}
	if n := len(c.req.ContainerRequests); n != 1 {
		return nil, fmt.Errorf("the manager sent %d container requests, want 1", n)
	}
	req := c.req.ContainerRequests[0]
	all := sortedKeys(devices)
	if got := sorted(req.AvailableDeviceIDs); !slices.Equal(got, all) || len(req.MustIncludeDeviceIDs) != 0 ||
		int(req.AllocationSize) != size {
		return nil, fmt.Errorf("unexpected request from the manager: available=%v must_include=%v size=%d",
			got, req.MustIncludeDeviceIDs, req.AllocationSize)
	}
	if c.resp == nil || len(c.resp.ContainerResponses) != 1 {
		return nil, fmt.Errorf("answer has %d container responses, want 1", len(c.resp.GetContainerResponses()))
	}
	answer := sorted(c.resp.ContainerResponses[0].DeviceIDs)
	if len(answer) != size || len(slices.Compact(slices.Clone(answer))) != size {
		return answer, fmt.Errorf("answer %v is not %d distinct devices", answer, size)
	}
	nodes := map[int64]bool{}
	for _, id := range answer {
		d, ok := devices[id]
		if !ok {
			return answer, fmt.Errorf("answer %v names %s, which is not available", answer, id)
		}
		node, err := numaNode(d)
		if err != nil {
			return answer, err
		}
		nodes[node] = true
	}
	if len(nodes) != 1 {
		return answer, fmt.Errorf("answer %v spans NUMA nodes %v, want one node", answer, sortedNodes(nodes))
	}
	return answer, nil
}

func checkAllocate(k *kubelet, pod *v1.Pod, name string, allocErr error, calls []allocateCall,
	answer []string) ([]string, error) {
	return checkContainerAllocate(k, pod, &pod.Spec.Containers[0], name, allocErr, calls, answer)
}

// checkContainerAllocate checks the Allocate calls of name for one container.
func checkContainerAllocate(k *kubelet, pod *v1.Pod, container *v1.Container, name string, allocErr error,
	calls []allocateCall, answer []string) ([]string, error) {
	if allocErr != nil {
		return nil, fmt.Errorf("the manager refused the pod: %v", allocErr)
	}
	if len(calls) != 1 {
		return nil, fmt.Errorf("the manager called Allocate %d times, want 1", len(calls))
	}
	c := calls[0]
	if c.err != nil {
		return nil, fmt.Errorf("allocate failed: %v", c.err)
	}
	if n := len(c.req.ContainerRequests); n != 1 {
		return nil, fmt.Errorf("the manager sent %d container requests, want 1", n)
	}
	requested := sorted(c.req.ContainerRequests[0].DevicesIds)
	if answer != nil && !slices.Equal(requested, answer) {
		return requested, fmt.Errorf("the manager allocated %v, not the preferred %v", requested, answer)
	}
	assigned := sortedKeys(k.manager.GetDevices(string(pod.UID), container.Name)[name])
	if !slices.Equal(assigned, requested) {
		return requested, fmt.Errorf("the manager recorded %v for the container, Allocate was for %v", assigned, requested)
	}
	if len(c.resp.GetContainerResponses()) != 1 {
		return requested, fmt.Errorf("response has %d container responses, want 1", len(c.resp.GetContainerResponses()))
	}
	return requested, nil
}

// checkEnv checks the variable in the plugin's answer, then what the
// manager hands the container runtime for the container.
func checkEnv(k *kubelet, pod *v1.Pod, name string, call allocateCall, allocated []string) (string, error) {
	return checkContainerEnv(k, pod, &pod.Spec.Containers[0], name, call, allocated)
}

// checkContainerEnv checks that the variable is exactly want, in the answer
// and in the run options the manager has for the container.
func checkContainerEnv(k *kubelet, pod *v1.Pod, container *v1.Container, name string, call allocateCall,
	allocated []string) (string, error) {
	value, ok := call.resp.ContainerResponses[0].Envs[name]
	if !ok {
		return "", fmt.Errorf("allocate response sets no %s (envs: %v)", name, call.resp.ContainerResponses[0].Envs)
	}
	ids := strings.Split(value, ",")
	if got := sorted(ids); !slices.Equal(got, allocated) || len(ids) != len(allocated) {
		return value, fmt.Errorf("%s=%q, want exactly the allocated %v", name, value, allocated)
	}
	runOpts, err := k.manager.GetDeviceRunContainerOptions(ctx, pod, container)
	if err != nil {
		return value, fmt.Errorf("the manager has no run options for the container: %v", err)
	}
	for _, env := range runOpts.Envs {
		if env.Name == name {
			if env.Value != value {
				return value, fmt.Errorf("the runtime would get %s=%q, the plugin answered %q", name, env.Value, value)
			}
			return value, nil
		}
	}
	return value, fmt.Errorf("the runtime would not get %s", name)
}

// checkReregistration: the new kubelet has removed the plugin's socket and
// serves a new kubelet.sock; the plugin must notice and register again.
func (h *harness) checkReregistration(k *kubelet) bool {
	o, r := h.opts, h.report
	registered := k.rec.waitFor(o.reregister+5*time.Second, func() bool { return len(k.rec.connections) > 0 })
	if !registered {
		r.fail("kubelet-restart", "no re-registration within %s of the restart", o.reregister+5*time.Second)
		return false
	}
	k.rec.mu.Lock()
	c := k.rec.connections[0]
	k.rec.mu.Unlock()
	h.sockets = []string{c.socket}
	took := c.at.Sub(k.startedAt)
	switch {
	case c.resource != o.resource:
		r.fail("kubelet-restart", "re-registered resource %q, want %q", c.resource, o.resource)
		return false
	case took > o.reregister:
		r.fail("kubelet-restart", "re-registered after %d ms, want within %s", took.Milliseconds(), o.reregister)
		return true
	}
	r.pass("kubelet-restart", "re-registered %s on %s within %s (%d ms)", c.resource, filepath.Base(c.socket),
		o.reregister, took.Milliseconds())
	return true
}

func (h *harness) checkTermination() {
	r := h.report
	code, err := h.plugin.terminate(10 * time.Second)
	switch {
	case err != nil:
		r.fail("sigterm-exit", "%v", err)
	case code != 0:
		r.fail("sigterm-exit", "exit code %d after SIGTERM, want 0", code)
	default:
		r.pass("sigterm-exit", "exit code 0")
	}
	if len(h.sockets) == 0 {
		r.fail("socket-removed", "not checked: the plugin never registered a socket")
		return
	}
	names := make([]string, len(h.sockets))
	for i, socket := range h.sockets {
		names[i] = filepath.Base(socket)
		if _, err := os.Lstat(socket); !os.IsNotExist(err) {
			r.fail("socket-removed", "%s still exists after the plugin exited", names[i])
			return
		}
	}
	r.pass("socket-removed", "%s removed", strings.Join(names, ", "))
}

func nodeOf(devices map[string]*pluginapi.Device, ids []string) int64 {
	if len(ids) == 0 {
		return -1
	}
	d, ok := devices[ids[0]]
	if !ok {
		return -1
	}
	node, err := numaNode(d)
	if err != nil {
		return -1
	}
	return node
}

func sorted(s []string) []string {
	out := slices.Clone(s)
	sort.Strings(out)
	return out
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

func sortedNodes(m map[int64]bool) []int64 {
	out := make([]int64, 0, len(m))
	for n := range m {
		out = append(out, n)
	}
	slices.Sort(out)
	return out
}
