package main

// The scenarios beyond whole GPUs on the default config (-scenario): MIG
// devices, time-sliced replicas, several resources at once (one container per
// resource, admitted as one pod), and a health change reaching the manager's
// allocatable. The plugin's inputs (a MIG layout, a sharing config, a mock
// NVML state) are the caller's: the harness only knows what the kubelet sees.

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	v1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// resourceSpec is one resource the plugin must register: its device count
// (capacity and allocatable) and what the test pod's container for it asks.
type resourceSpec struct {
	name    string
	devices int
	request int
}

type scenario struct {
	checks []string
	// The default -resources, the figures of mock:dgx-h100 (eight H100 80GB,
	// GPUs 0-3 on NUMA node 0, 4-7 on node 1) with the layout or config the
	// scenario is about.
	resources []resourceSpec
}

var allocationChecks = []string{
	"registration", "capacity", "device-ids", "numa-topology", "preferred-allocation", "allocate",
	"allocate-env", "sigterm-exit", "socket-removed",
}

var scenarios = map[string]scenario{
	// Every GPU in MIG mode with seven 1g.10gb devices (layout all-1g.10gb),
	// mixed strategy.
	"mig": {checks: allocationChecks, resources: []resourceSpec{{"nvidia.com/mig-1g.10gb", 56, 1}}},
	// GPUs 0, 1, 4, 5 with seven 1g.10gb each, GPUs 2 and 6 with two
	// 3g.40gb each, GPUs 3 and 7 whole; mixed strategy.
	"multi": {checks: allocationChecks, resources: []resourceSpec{
		{"nvidia.com/mig-1g.10gb", 28, 2}, {"nvidia.com/mig-3g.40gb", 4, 1}, {"nvidia.com/gpu", 2, 1},
	}},
	// Time-slicing with 4 replicas of every GPU, allocation policy packed.
	"replicas": {checks: allocationChecks, resources: []resourceSpec{{"nvidia.com/gpu", 32, 2}}},
	// Whole GPUs; -inject makes one unhealthy, then it recovers.
	"health": {checks: []string{
		"registration", "capacity", "device-ids", "health-unhealthy", "health-recovered", "sigterm-exit",
		"socket-removed",
	}, resources: []resourceSpec{{"nvidia.com/gpu", 8, 0}}},
}

// scenarioChecks is the scenario's check list; with -device-list cdi-cri,
// allocate-cdi takes the place of allocate-env.
func (o *options) scenarioChecks() []string {
	checks := slices.Clone(scenarios[o.scenario].checks)
	at := slices.Index(checks, "allocate-env")
	if at >= 0 && o.deviceList == "cdi-cri" {
		checks[at] = "allocate-cdi"
	}
	if at >= 0 && o.expectDev != nil {
		checks = slices.Insert(checks, at+1, "allocate-devices")
	}
	return checks
}

// cdiKind is the CDI kind of NVIDIA's GPUs and MIG devices (nvidia-ctk's
// specs, and the names NVIDIA's device plugin returns).
const cdiKind = "nvidia.com/gpu"

func scenarioNames() []string {
	names := []string{"gpu"}
	for name := range scenarios {
		names = append(names, name)
	}
	slices.Sort(names[1:])
	return names
}

var (
	migUUID   = regexp.MustCompile(`^MIG-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$`)
	replicaID = regexp.MustCompile(`^(GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})::([0-9]+)$`)
	// A GPU's own device node; the control and capability nodes are others.
	gpuDeviceNode = regexp.MustCompile(`^/dev/nvidia[0-9]+$`)
)

// flagScenarios names the scenarios each scenario-bound flag is for; a flag
// set for another scenario is refused rather than ignored.
var flagScenarios = map[string][]string{
	"resource":          {"gpu"},
	"devices":           {"gpu"},
	"request":           {"gpu"},
	"reregister-within": {"gpu"},
	"resources":         {"health", "mig", "multi", "replicas"},
	"device-list":       {"mig", "multi", "replicas"},
	"expect-dev":        {"mig", "multi", "replicas"},
	"one-container":     {"multi"},
	"replicas":          {"replicas"},
	"replica-gpus":      {"replicas"},
	"inject":            {"health"},
	"recover":           {"health"},
	"unhealthy":         {"health"},
	"health-within":     {"health"},
}

// scenarioFlags checks the flags that belong to the scenarios and fills in
// the scenario's default resources. set names the flags given.
func (o *options) scenarioFlags(text string, set map[string]bool) error {
	if _, ok := scenarios[o.scenario]; !ok && o.scenario != "gpu" {
		return fmt.Errorf("-scenario: unknown scenario %q (known: %s)", o.scenario, strings.Join(scenarioNames(), ", "))
	}
	names := make([]string, 0, len(set))
	for name := range set {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		if allowed, bound := flagScenarios[name]; bound && !slices.Contains(allowed, o.scenario) {
			return fmt.Errorf("-%s is for -scenario %s", name, strings.Join(allowed, ", "))
		}
	}
	if o.scenario == "gpu" {
		return nil
	}
	sc := scenarios[o.scenario]
	o.resources = sc.resources
	if text != "" {
		o.resources = nil
		for _, item := range strings.Split(text, ",") {
			spec, err := parseResource(item)
			if err != nil {
				return err
			}
			for _, r := range o.resources {
				if r.name == spec.name {
					return fmt.Errorf("-resources: %s named twice", spec.name)
				}
			}
			o.resources = append(o.resources, spec)
		}
	}
	if o.deviceList != "envvar" && o.deviceList != "cdi-cri" {
		return fmt.Errorf("-device-list: %q is neither envvar nor cdi-cri", o.deviceList)
	}
	minRequest := 1
	switch o.scenario {
	case "health":
		minRequest = 0
		if o.inject == "" {
			return fmt.Errorf("-scenario health needs -inject, the command that makes a device unhealthy")
		}
		fallthrough
	case "replicas":
		if len(o.resources) != 1 {
			return fmt.Errorf("-scenario %s takes one resource in -resources, got %d", o.scenario, len(o.resources))
		}
	}
	if o.scenario == "replicas" && (o.replicas < 1 || o.resources[0].devices%o.replicas != 0) {
		return fmt.Errorf("-replicas %d does not divide the %d devices of %s", o.replicas, o.resources[0].devices,
			o.resources[0].name)
	}
	for _, r := range o.resources {
		if r.request < minRequest || r.request > r.devices {
			return fmt.Errorf("-resources: %s asks for %d of %d devices, want %d to %d", r.name, r.request,
				r.devices, minRequest, r.devices)
		}
	}
	return nil
}

func parseResource(item string) (resourceSpec, error) {
	name, figures, ok := strings.Cut(item, "=")
	devices, request, ok2 := strings.Cut(figures, ":")
	d, err := strconv.Atoi(devices)
	q, err2 := strconv.Atoi(request)
	if !ok || !ok2 || name == "" || err != nil || err2 != nil || d < 1 {
		return resourceSpec{}, fmt.Errorf("-resources: %q is not NAME=DEVICES:REQUEST", item)
	}
	return resourceSpec{name: name, devices: d, request: q}, nil
}

// idKind is the form the scenario's device IDs must have.
func (h *harness) idKind(name string) string {
	switch {
	case h.opts.scenario == "replicas":
		return "replica"
	case strings.HasPrefix(name, "nvidia.com/mig-"):
		return "MIG UUID"
	default:
		return "GPU UUID"
	}
}

// gpuOf is the physical device behind a device ID: a replica's GPU, or the ID.
func gpuOf(id string) string {
	if m := replicaID.FindStringSubmatch(id); m != nil {
		return m[1]
	}
	return id
}

// scenarioPod asks for each resource in its own container, or with
// oneContainer for all of them in one.
func scenarioPod(resources []resourceSpec, oneContainer bool) *v1.Pod {
	pod := &v1.Pod{ObjectMeta: metav1.ObjectMeta{
		Name: "gpu-pod", Namespace: "default", UID: types.UID("4f6d7a9e-0b1c-4d2e-8f3a-5b6c7d8e9f02"),
	}}
	for i, r := range resources {
		quantity := resource.MustParse(strconv.Itoa(r.request))
		if oneContainer && i > 0 {
			c := &pod.Spec.Containers[0]
			c.Resources.Limits[v1.ResourceName(r.name)] = quantity
			c.Resources.Requests[v1.ResourceName(r.name)] = quantity
			continue
		}
		pod.Spec.Containers = append(pod.Spec.Containers, v1.Container{
			Name: fmt.Sprintf("cuda-%d", i), Image: "cuda",
			Resources: v1.ResourceRequirements{
				Limits:   v1.ResourceList{v1.ResourceName(r.name): quantity},
				Requests: v1.ResourceList{v1.ResourceName(r.name): quantity},
			},
		})
	}
	return pod
}

// containerOf is the pod's container that asks for the i-th resource.
func (h *harness) containerOf(i int) *v1.Container {
	if h.opts.oneContainer {
		return &h.pod.Spec.Containers[0]
	}
	return &h.pod.Spec.Containers[i]
}

func (h *harness) runScenario() {
	o, r := h.opts, h.report
	if n := len(filepath.Join(h.dir, "kubelet.sock")); n > maxSocketPath-40 {
		r.fail("registration", "socket directory %s leaves too little room under the %d-byte socket path limit",
			h.dir, maxSocketPath)
		return
	}
	h.pod = scenarioPod(o.resources, o.oneContainer)
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
		k.rec.record(func() {}) // wake a wait for the registrations
	}()

	if !h.checkRegistrations(k) {
		return
	}
	devices := h.checkCapacities(k)
	if devices == nil {
		return
	}
	h.checkScenarioIDs(devices)
	if o.scenario == "health" {
		h.checkHealth(k)
	} else {
		h.checkNUMAPerResource(devices)
		h.checkContainers(k, devices)
	}
	h.checkTermination()
}

// checkRegistrations waits until every resource of -resources registered.
func (h *harness) checkRegistrations(k *kubelet) bool {
	o, r := h.opts, h.report
	want := map[string]bool{}
	for _, res := range o.resources {
		want[res.name] = true
	}
	latest := func() map[string]connection {
		byName := map[string]connection{}
		for _, c := range k.rec.connections {
			byName[c.resource] = c
		}
		return byName
	}
	k.rec.waitFor(o.registerWithin, func() bool {
		got := latest()
		for name := range want {
			if _, ok := got[name]; !ok {
				return h.plugin.exited()
			}
		}
		return true
	})
	k.rec.mu.Lock()
	got := latest()
	k.rec.mu.Unlock()
	var missing, extra, done []string
	for _, res := range o.resources {
		c, ok := got[res.name]
		if !ok {
			missing = append(missing, res.name)
			continue
		}
		h.sockets = append(h.sockets, c.socket)
		done = append(done, fmt.Sprintf("%s on %s after %d ms", c.resource, filepath.Base(c.socket),
			c.at.Sub(k.startedAt).Milliseconds()))
	}
	for name := range got {
		if !want[name] {
			extra = append(extra, name)
		}
	}
	sort.Strings(extra)
	switch {
	case len(missing) > 0 && h.plugin.exited():
		r.fail("registration", "plugin exited before registering %s: %v", strings.Join(missing, ", "), h.plugin.err)
		return false
	case len(missing) > 0:
		r.fail("registration", "no registration of %s on kubelet.sock within %s", strings.Join(missing, ", "),
			o.registerWithin)
		return false
	case len(extra) > 0:
		r.fail("registration", "registered %s too, which -resources does not name", strings.Join(extra, ", "))
		return false
	}
	r.pass("registration", "%s", strings.Join(done, "; "))
	return true
}

// checkCapacities waits for a ListAndWatch response of every resource, then
// for the capacity and allocatable the kubelet would report to settle on the
// expected counts. It returns the healthy devices per resource, or nil.
func (h *harness) checkCapacities(k *kubelet) map[string]map[string]*pluginapi.Device {
	o, r := h.opts, h.report
	listed := func() []string {
		var silent []string
		for _, res := range o.resources {
			if !slices.ContainsFunc(k.rec.listings, func(l listing) bool { return l.resource == res.name }) {
				silent = append(silent, res.name)
			}
		}
		return silent
	}
	k.rec.waitFor(5*time.Second, func() bool { return len(listed()) == 0 })
	k.rec.mu.Lock()
	silent := listed()
	k.rec.mu.Unlock()
	if len(silent) > 0 {
		r.fail("capacity", "no ListAndWatch response for %s within 5s of registering", strings.Join(silent, ", "))
		return nil
	}
	figures := func() (string, bool) {
		var parts []string
		ok := true
		for _, res := range o.resources {
			c, a := k.capacity(res.name)
			ok = ok && c == int64(res.devices) && a == int64(res.devices)
			parts = append(parts, fmt.Sprintf("%s capacity=%d allocatable=%d", res.name, c, a))
		}
		return strings.Join(parts, "; "), ok
	}
	k.rec.waitFor(2*time.Second, func() bool { _, ok := figures(); return ok })
	got, ok := figures()
	if !ok {
		var want []string
		for _, res := range o.resources {
			want = append(want, fmt.Sprintf("%s=%d", res.name, res.devices))
		}
		r.fail("capacity", "%s; want capacity and allocatable %s", got, strings.Join(want, ", "))
		return nil
	}
	r.pass("capacity", "%s", got)
	all := k.manager.GetAllocatableDevices(logger)
	devices := map[string]map[string]*pluginapi.Device{}
	for _, res := range o.resources {
		devices[res.name] = all[res.name]
	}
	return devices
}

func (h *harness) checkScenarioIDs(devices map[string]map[string]*pluginapi.Device) {
	o, r := h.opts, h.report
	var bad, detail []string
	owner := map[string]string{}
	for _, res := range o.resources {
		kind := h.idKind(res.name)
		replicasOf := map[string][]int{}
		for id, d := range devices[res.name] {
			if other, dup := owner[id]; dup {
				bad = append(bad, fmt.Sprintf("%q is a device of both %s and %s", id, other, res.name))
			}
			owner[id] = res.name
			ok := d.Health == pluginapi.Healthy
			switch kind {
			case "MIG UUID":
				ok = ok && migUUID.MatchString(id)
			case "GPU UUID":
				ok = ok && gpuUUID.MatchString(id)
			default:
				n, err := -1, error(nil)
				m := replicaID.FindStringSubmatch(id)
				if m != nil {
					n, err = strconv.Atoi(m[2])
				}
				if m == nil || err != nil || n >= o.replicas {
					ok = false
				} else {
					replicasOf[m[1]] = append(replicasOf[m[1]], n)
				}
			}
			if !ok {
				bad = append(bad, fmt.Sprintf("%s: %q (%s) is not a healthy %s", res.name, id, d.Health, kind))
			}
		}
		if kind != "replica" {
			detail = append(detail, fmt.Sprintf("%s: %d distinct %ss", res.name, len(devices[res.name]), kind))
			continue
		}
		if want := res.devices / o.replicas; len(replicasOf) != want {
			bad = append(bad, fmt.Sprintf("%s: replicas of %d GPUs, want %d", res.name, len(replicasOf), want))
		}
		for gpu, ns := range replicasOf {
			slices.Sort(ns)
			if len(ns) != o.replicas || ns[0] != 0 || ns[len(ns)-1] != o.replicas-1 {
				bad = append(bad, fmt.Sprintf("%s: %s has replicas %v, want 0..%d", res.name, gpu, ns, o.replicas-1))
			}
		}
		detail = append(detail, fmt.Sprintf("%s: %d replicas <GPU UUID>::0..%d of %d GPUs", res.name,
			len(devices[res.name]), o.replicas-1, len(replicasOf)))
	}
	sort.Strings(bad)
	if len(bad) > 0 {
		r.fail("device-ids", "%s", strings.Join(bad, "; "))
		return
	}
	r.pass("device-ids", "%s, all %s", strings.Join(detail, "; "), pluginapi.Healthy)
}

// checkNUMAPerResource: each device on one NUMA node, its own (a replica's
// or a MIG device's: its GPU's) with -expect-numa; each resource half on
// node 0 and half on node 1.
func (h *harness) checkNUMAPerResource(devices map[string]map[string]*pluginapi.Device) {
	o, r := h.opts, h.report
	var problems, detail []string
	for _, res := range o.resources {
		perNode := map[int64]int{}
		for id, d := range devices[res.name] {
			node, err := numaNode(d)
			if err != nil {
				problems = append(problems, err.Error())
				continue
			}
			perNode[node]++
			if o.expectNUMA == nil {
				continue
			}
			if want, ok := o.expectNUMA[gpuOf(id)]; !ok || want != node {
				problems = append(problems, fmt.Sprintf("%s on NUMA node %d, want %s", id, node,
					expectedNode(o, gpuOf(id))))
			}
		}
		want := map[int64]int{}
		if half := res.devices / 2; half > 0 {
			want[0] = half
		}
		want[1] = res.devices - res.devices/2
		if !mapsEqual(perNode, want) {
			problems = append(problems, fmt.Sprintf("%s: devices per NUMA node %v, want %v", res.name, perNode, want))
		}
		detail = append(detail, fmt.Sprintf("%s: %d on NUMA node 0, %d on node 1", res.name, perNode[0], perNode[1]))
	}
	sort.Strings(problems)
	if len(problems) > 0 {
		r.fail("numa-topology", "%s", strings.Join(problems, "; "))
		return
	}
	if o.expectNUMA != nil {
		detail = append(detail, "each on its GPU's node")
	}
	r.pass("numa-topology", "%s", strings.Join(detail, "; "))
}

func mapsEqual(a, b map[int64]int) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

// checkContainers admits the pod, container by container as the kubelet's
// admission handler does, and checks every plugin call the manager made.
func (h *harness) checkContainers(k *kubelet, devices map[string]map[string]*pluginapi.Device) {
	o, r := h.opts, h.report
	admitted := map[string]error{}
	for i := range h.pod.Spec.Containers {
		c := &h.pod.Spec.Containers[i]
		admitted[c.Name] = k.manager.Allocate(ctx, h.pod, c, admission)
	}
	k.rec.mu.Lock()
	preferred := slices.Clone(k.rec.preferred)
	allocations := slices.Clone(k.rec.allocations)
	k.rec.mu.Unlock()

	answers := make([][]string, len(o.resources))
	var prefProblems, prefDetail []string
	for i, res := range o.resources {
		var calls []preferredCall
		for _, c := range preferred {
			if c.resource == res.name {
				calls = append(calls, c)
			}
		}
		answer, err := checkPreferred(calls, devices[res.name], res.request)
		if err == nil && o.scenario == "replicas" {
			err = h.checkReplicaSpread(answer)
		}
		answers[i] = answer
		if err != nil {
			prefProblems = append(prefProblems, fmt.Sprintf("%s: %v", res.name, err))
			continue
		}
		prefDetail = append(prefDetail, fmt.Sprintf("%s: asked for %d of %d, answered %v (NUMA node %d)", res.name,
			res.request, len(devices[res.name]), answer, nodeOf(devices[res.name], answer)))
	}
	if len(prefProblems) > 0 {
		r.fail("preferred-allocation", "%s", strings.Join(prefProblems, "; "))
	} else {
		r.pass("preferred-allocation", "%s", strings.Join(prefDetail, "; "))
	}

	var allocProblems, allocDetail []string
	granted := make([][]string, len(o.resources))
	calls := make([]allocateCall, len(o.resources))
	for i, res := range o.resources {
		var mine []allocateCall
		for _, c := range allocations {
			if c.resource == res.name {
				mine = append(mine, c)
			}
		}
		container := h.containerOf(i)
		allocated, err := checkContainerAllocate(k, h.pod, container, res.name, admitted[container.Name], mine,
			answers[i])
		if err == nil && !o.oneContainer {
			err = onlyResource(k, h.pod, container, res.name)
		}
		if err != nil {
			allocProblems = append(allocProblems, fmt.Sprintf("%s: %v", res.name, err))
			continue
		}
		granted[i], calls[i] = allocated, mine[0]
		allocDetail = append(allocDetail, fmt.Sprintf("container %s: Allocate(%v) for %s", container.Name, allocated,
			res.name))
	}
	handed := "allocate-env"
	if o.deviceList == "cdi-cri" {
		handed = "allocate-cdi"
	}
	if len(allocProblems) > 0 {
		r.fail("allocate", "%s", strings.Join(allocProblems, "; "))
		r.fail(handed, "not checked: allocation failed")
		if o.expectDev != nil {
			r.fail("allocate-devices", "not checked: allocation failed")
		}
		return
	}
	r.pass("allocate", "%s", strings.Join(allocDetail, "; "))

	// What the runtime must get for each container: each allocated device
	// once (a replica as its GPU).
	wants := make([][]string, len(o.resources))
	cdiOf := map[string][]string{} // container name -> every CDI device of its resources
	for i := range o.resources {
		wants[i] = granted[i]
		if o.scenario == "replicas" {
			wants[i] = distinctGPUs(granted[i])
		}
		name := h.containerOf(i).Name
		for _, id := range wants[i] {
			cdiOf[name] = append(cdiOf[name], cdiKind+"="+id)
		}
	}
	var problems, detail []string
	for i, res := range o.resources {
		container := h.containerOf(i)
		var value string
		var err error
		if o.deviceList == "cdi-cri" {
			value, err = checkContainerCDI(k, h.pod, container, calls[i], wants[i], cdiOf[container.Name])
		} else {
			value, err = checkContainerEnv(k, h.pod, container, o.envVar, calls[i], wants[i])
			value = o.envVar + "=" + value
		}
		if err != nil {
			problems = append(problems, fmt.Sprintf("%s: %v", res.name, err))
			continue
		}
		detail = append(detail, fmt.Sprintf("container %s, %s: %s", container.Name, res.name, value))
	}
	if len(problems) > 0 {
		r.fail(handed, "%s", strings.Join(problems, "; "))
	} else {
		r.pass(handed, "%s", strings.Join(detail, "; "))
	}
	if o.expectDev != nil {
		h.checkDeviceNodes(k, granted, calls)
	}
}

// checkDeviceNodes: each response passes the GPU device nodes of its devices
// (a MIG device's or a replica's: its GPU's), each once, and the manager
// hands each container the nodes of all its resources. Other nodes (control,
// capability) are not judged here.
func (h *harness) checkDeviceNodes(k *kubelet, granted [][]string, calls []allocateCall) {
	o, r := h.opts, h.report
	want := func(ids []string) ([]string, error) {
		var nodes []string
		for _, id := range ids {
			node, ok := o.expectDev[id]
			if !ok {
				node, ok = o.expectDev[gpuOf(id)]
			}
			if !ok {
				return nil, fmt.Errorf("-expect-dev names no device node for %s", id)
			}
			nodes = append(nodes, node)
		}
		slices.Sort(nodes)
		return slices.Compact(nodes), nil
	}
	gpuNodes := func(paths []string) []string {
		var out []string
		for _, p := range paths {
			if gpuDeviceNode.MatchString(p) {
				out = append(out, p)
			}
		}
		slices.Sort(out)
		return out
	}
	var problems, detail []string
	perContainer := map[string][]string{}
	for i, res := range o.resources {
		nodes, err := want(granted[i])
		if err != nil {
			problems = append(problems, err.Error())
			continue
		}
		var answered []string
		for _, d := range calls[i].resp.ContainerResponses[0].Devices {
			answered = append(answered, d.ContainerPath)
		}
		if got := gpuNodes(answered); !slices.Equal(got, nodes) {
			problems = append(problems, fmt.Sprintf("%s: allocate response passes GPU device nodes %v, want %v",
				res.name, got, nodes))
			continue
		}
		name := h.containerOf(i).Name
		perContainer[name] = append(perContainer[name], nodes...)
		detail = append(detail, fmt.Sprintf("%s: %s", res.name, strings.Join(nodes, ",")))
	}
	for i := range h.pod.Spec.Containers {
		c := &h.pod.Spec.Containers[i]
		runOpts, err := k.manager.GetDeviceRunContainerOptions(ctx, h.pod, c)
		if err != nil {
			problems = append(problems, fmt.Sprintf("the manager has no run options for container %s: %v", c.Name, err))
			continue
		}
		var handed []string
		for _, d := range runOpts.Devices {
			handed = append(handed, d.PathInContainer)
		}
		nodes := slices.Compact(sorted(perContainer[c.Name]))
		if got := gpuNodes(handed); !slices.Equal(got, nodes) {
			problems = append(problems, fmt.Sprintf("the runtime would get GPU device nodes %v for container %s, "+
				"want %v", got, c.Name, nodes))
		}
	}
	if len(problems) > 0 {
		r.fail("allocate-devices", "%s", strings.Join(problems, "; "))
		return
	}
	r.pass("allocate-devices", "%s", strings.Join(detail, "; "))
}

// checkContainerCDI checks the CDI devices in the answer for one resource
// (exactly kind=ID of each wanted device), and that the manager hands the
// runtime exactly the CDI devices of all the container's resources.
func checkContainerCDI(k *kubelet, pod *v1.Pod, container *v1.Container, call allocateCall, want []string,
	all []string) (string, error) {
	var names []string
	for _, d := range call.resp.ContainerResponses[0].CdiDevices {
		names = append(names, d.Name)
	}
	var wanted []string
	for _, id := range want {
		wanted = append(wanted, cdiKind+"="+id)
	}
	if !slices.Equal(sorted(names), sorted(wanted)) {
		return "", fmt.Errorf("allocate response names CDI devices %v, want exactly %v", names, sorted(wanted))
	}
	runOpts, err := k.manager.GetDeviceRunContainerOptions(ctx, pod, container)
	if err != nil {
		return "", fmt.Errorf("the manager has no run options for the container: %v", err)
	}
	var handed []string
	for _, d := range runOpts.CDIDevices {
		handed = append(handed, d.Name)
	}
	if !slices.Equal(sorted(handed), sorted(all)) {
		return "", fmt.Errorf("the runtime would get CDI devices %v for container %s, want %v", sorted(handed),
			container.Name, sorted(all))
	}
	return "CDI devices " + strings.Join(names, ","), nil
}

// checkReplicaSpread: the preferred replicas are on exactly -replica-gpus GPUs.
func (h *harness) checkReplicaSpread(answer []string) error {
	if gpus := distinctGPUs(answer); len(gpus) != h.opts.replicaGPUs {
		return fmt.Errorf("answer %v is on %d GPUs %v, want %d", answer, len(gpus), gpus, h.opts.replicaGPUs)
	}
	return nil
}

// distinctGPUs is the sorted set of GPUs behind device IDs.
func distinctGPUs(ids []string) []string {
	gpus := make([]string, 0, len(ids))
	for _, id := range ids {
		gpus = append(gpus, gpuOf(id))
	}
	slices.Sort(gpus)
	return slices.Compact(gpus)
}

// onlyResource: the manager gave the container devices of its own resource
// and of no other.
func onlyResource(k *kubelet, pod *v1.Pod, container *v1.Container, name string) error {
	for other, ids := range k.manager.GetDevices(string(pod.UID), container.Name) {
		if other != name && len(ids) > 0 {
			return fmt.Errorf("container %s also got %s devices %v", container.Name, other, sortedKeys(ids))
		}
	}
	return nil
}

// checkHealth runs -inject and follows the ListAndWatch responses: the first
// one with an unhealthy device must mark exactly that device, with the
// manager's allocatable one lower and its capacity unchanged; a later one
// must bring allocatable back to capacity.
func (h *harness) checkHealth(k *kubelet) {
	o, r := h.opts, h.report
	res := o.resources[0]
	k.rec.mu.Lock()
	mark := len(k.rec.listings)
	k.rec.mu.Unlock()
	injected := time.Now()
	if err := runShell(o.inject, h.dir); err != nil {
		r.fail("health-unhealthy", "-inject: %v", err)
		r.fail("health-recovered", "not checked: -inject failed")
		return
	}
	find := func(from int, match func(listing) bool) (int, listing) {
		for i := from; i < len(k.rec.listings); i++ {
			if l := k.rec.listings[i]; l.resource == res.name && match(l) {
				return i, l
			}
		}
		return -1, listing{}
	}
	anyUnhealthy := func(l listing) bool { return len(l.unhealthy) > 0 }
	k.rec.waitFor(o.healthWithin, func() bool { i, _ := find(mark, anyUnhealthy); return i >= 0 })
	k.rec.mu.Lock()
	at, drop := find(mark, anyUnhealthy)
	k.rec.mu.Unlock()
	if at < 0 {
		c, a := k.capacity(res.name)
		r.fail("health-unhealthy", "no device of %s unhealthy within %s of -inject (capacity=%d allocatable=%d)",
			res.name, o.healthWithin, c, a)
		r.fail("health-recovered", "not checked: nothing became unhealthy")
		return
	}
	// Without -unhealthy: any one device; with it: exactly those.
	wantIDs, wantText := []string(nil), "one device"
	if o.unhealthy != "" {
		wantIDs = sorted(strings.Split(o.unhealthy, ","))
		wantText = fmt.Sprintf("%v", wantIDs)
	}
	okIDs := len(drop.unhealthy) == 1 && wantIDs == nil || wantIDs != nil && slices.Equal(drop.unhealthy, wantIDs)
	gone := max(len(wantIDs), 1)
	figures := fmt.Sprintf("unhealthy %v, capacity %s=%d allocatable=%d after %d ms", drop.unhealthy, res.name,
		drop.capacity, drop.allocatable, drop.at.Sub(injected).Milliseconds())
	if !okIDs || drop.capacity != int64(res.devices) || drop.allocatable != int64(res.devices-gone) {
		r.fail("health-unhealthy", "%s; want %s unhealthy, capacity=%d allocatable=%d", figures, wantText,
			res.devices, res.devices-gone)
		r.fail("health-recovered", "not checked: the health change was not as expected")
		return
	}
	r.pass("health-unhealthy", "%s", figures)

	if o.recover != "" {
		if err := runShell(o.recover, h.dir); err != nil {
			r.fail("health-recovered", "-recover: %v", err)
			return
		}
	}
	recovered := func(l listing) bool {
		return len(l.unhealthy) == 0 && l.capacity == int64(res.devices) && l.allocatable == int64(res.devices)
	}
	k.rec.waitFor(o.healthWithin, func() bool { i, _ := find(at+1, recovered); return i >= 0 })
	k.rec.mu.Lock()
	back, l := find(at+1, recovered)
	k.rec.mu.Unlock()
	if back < 0 {
		c, a := k.capacity(res.name)
		r.fail("health-recovered", "capacity %s=%d allocatable=%d: allocatable not back to %d within %s", res.name,
			c, a, res.devices, o.healthWithin)
		return
	}
	r.pass("health-recovered", "capacity %s=%d allocatable=%d, %d ms after the fault reached the manager", res.name,
		l.capacity, l.allocatable, l.at.Sub(drop.at).Milliseconds())
}

// runShell runs a -inject or -recover command with {dir} replaced by the
// socket directory; a failure carries the command's output.
func runShell(command, dir string) error {
	cmd := exec.Command("sh", "-c", strings.ReplaceAll(command, "{dir}", dir))
	cmd.Env = os.Environ()
	out, err := cmd.CombinedOutput()
	if err != nil {
		return fmt.Errorf("%q: %v: %s", command, err, strings.TrimSpace(string(out)))
	}
	return nil
}
