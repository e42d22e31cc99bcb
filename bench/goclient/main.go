// Command bench-grpc is the Go side of the Allocate floor benchmark (allocate_floor in bench/grpc_bench.py):
//
//	bench-grpc call  -socket PATH[,PATH...] -method allocate|preferred -calls N -warmup W -chunk C -seed S -ids ID,...
//	bench-grpc serve -socket PATH -ids ID,ID,...
//	bench-grpc load  -socket PATH -method allocate|preferred -clients N -rate R -seconds S -warmup W -seed S -ids ID,...
//
// "call" is a client that dials device plugins' unix sockets and calls them the way the kubelet's device
// manager does (pkg/kubelet/cm/devicemanager: grpc.DialContext with an insecure unix dialer and authority
// "localhost", then one container request per call on context.Background()), timing every call; it prints
// one JSON object with each call's latency in nanoseconds. The servers take turns, C calls each (A B C A B
// C ...), so they share the same moments of a busy machine; each gets the same requests, drawn from the
// seed before the first call.
//
// "load" is many kubelet-like clients at once (load in bench/grpc_bench.py): N clients, each on a connection of
// its own dialled as "call" dials, each calling at random moments (a Poisson process of R calls per second;
// with R 0, each call as soon as its previous one is answered) for S seconds, one call at a time; it prints one JSON object with every timed call's latency and the most
// calls that were in flight at once.
//
// "serve" is the floor a plugin written in Go has: the same DevicePlugin service on grpc-go, answering
// Allocate with one fixed response and GetPreferredAllocation with the first devices offered.
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/signal"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

func main() {
	if len(os.Args) < 2 {
		fail("usage: bench-grpc call|serve [flags]")
	}
	var err error
	switch os.Args[1] {
	case "call":
		err = call(os.Args[2:])
	case "serve":
		err = serve(os.Args[2:])
	case "load":
		err = load(os.Args[2:])
	default:
		err = fmt.Errorf("unknown command %q: call, serve or load", os.Args[1])
	}
	if err != nil {
		fail(err.Error())
	}
}

func fail(message string) {
	fmt.Fprintln(os.Stderr, "bench-grpc:", message)
	os.Exit(2)
}

func splitIDs(ids string) ([]string, error) {
	list := strings.Split(ids, ",")
	if ids == "" || len(list) == 0 {
		return nil, fmt.Errorf("-ids names no device")
	}
	return list, nil
}

// --- the client ---------------------------------------------------------------------------------------------

type result struct {
	Method    string    `json:"method"`
	Calls     int       `json:"calls"`
	Warmup    int       `json:"warmup"`
	Chunk     int       `json:"chunk"`
	Sockets   []string  `json:"sockets"`
	LatencyNs [][]int64 `json:"latency_ns"` // per socket, in call order
	WallS     float64   `json:"wall_s"`
	CPUS      float64   `json:"cpu_s"` // this process's user + system time over its whole run (getrusage)
}

func call(args []string) error {
	fs := flag.NewFlagSet("call", flag.ContinueOnError)
	socketList := fs.String("socket", "", "the plugins' unix sockets, comma-separated: calls take turns among them")
	method := fs.String("method", "allocate", "allocate or preferred")
	calls := fs.Int("calls", 3000, "timed calls per socket")
	warmup := fs.Int("warmup", 200, "untimed calls first, per socket")
	chunk := fs.Int("chunk", 100, "calls to one socket before the next one's turn")
	seed := fs.Uint64("seed", 1, "seed of the request draws")
	idList := fs.String("ids", "", "the resource's device IDs, comma-separated")
	if err := fs.Parse(args); err != nil {
		return err
	}
	ids, err := splitIDs(*idList)
	if err != nil {
		return err
	}
	if *socketList == "" || *calls < 1 || *warmup < 0 || *chunk < 1 {
		return fmt.Errorf("-socket, -calls >= 1 and -chunk >= 1 are required")
	}
	sockets := strings.Split(*socketList, ",")
	clients := make([]pluginapi.DevicePluginClient, len(sockets))
	for i, socket := range sockets {
		client, conn, err := dial(socket)
		if err != nil {
			return err
		}
		defer conn.Close()
		clients[i] = client
	}

	// Every socket gets the same requests in the same order.
	rng := rand.New(rand.NewPCG(*seed, 0x5eed))
	total := *warmup + *calls
	var invoke func(client pluginapi.DevicePluginClient, i int) error
	switch *method {
	case "allocate":
		requests := make([]*pluginapi.AllocateRequest, total)
		for i := range requests {
			requests[i] = &pluginapi.AllocateRequest{
				ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: sample(rng, ids, 1+rng.IntN(len(ids)))}},
			}
		}
		invoke = func(client pluginapi.DevicePluginClient, i int) error {
			_, err := client.Allocate(context.Background(), requests[i])
			return err
		}
	case "preferred":
		requests := make([]*pluginapi.PreferredAllocationRequest, total)
		for i := range requests {
			requests[i] = preferredRequest(rng, ids, i)
		}
		invoke = func(client pluginapi.DevicePluginClient, i int) error {
			_, err := client.GetPreferredAllocation(context.Background(), requests[i])
			return err
		}
	default:
		return fmt.Errorf("unknown -method %q: allocate or preferred", *method)
	}

	for s, client := range clients {
		for i := 0; i < *warmup; i++ {
			if err := invoke(client, i); err != nil {
				return fmt.Errorf("%s: warm-up call %d: %v", sockets[s], i, err)
			}
		}
	}
	out := result{Method: *method, Calls: *calls, Warmup: *warmup, Chunk: *chunk, Sockets: sockets,
		LatencyNs: make([][]int64, len(sockets))}
	for s := range sockets {
		out.LatencyNs[s] = make([]int64, *calls)
	}
	began := time.Now()
	for first := 0; first < *calls; first += *chunk {
		last := min(first+*chunk, *calls)
		for s, client := range clients {
			for i := first; i < last; i++ {
				start := time.Now()
				if err := invoke(client, *warmup+i); err != nil {
					return fmt.Errorf("%s: call %d: %v", sockets[s], i, err)
				}
				out.LatencyNs[s][i] = time.Since(start).Nanoseconds()
			}
		}
	}
	out.WallS = time.Since(began).Seconds()
	var usage syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &usage); err == nil {
		out.CPUS = time.Duration(usage.Utime.Nano() + usage.Stime.Nano()).Seconds()
	}
	return json.NewEncoder(os.Stdout).Encode(out)
}

type loadResult struct {
	Method        string    `json:"method"`
	Clients       int       `json:"clients"`
	RatePerClient float64   `json:"rate_per_client"`
	Seconds       float64   `json:"seconds"`
	Warmup        int       `json:"warmup"`
	LatencyNs     []int64   `json:"latency_ns"` // every timed call, all clients
	MaxInFlight   int64     `json:"max_in_flight"`
	InFlightSeen  []int64   `json:"in_flight_seen"` // calls in flight as each timed call started (itself included)
	WallS         float64   `json:"wall_s"`
	CPUS          float64   `json:"cpu_s"`
	Errors        []string  `json:"errors"`
	Started       time.Time `json:"started"`
}

func load(args []string) error {
	fs := flag.NewFlagSet("load", flag.ContinueOnError)
	socket := fs.String("socket", "", "the plugin's unix socket")
	method := fs.String("method", "allocate", "allocate or preferred")
	clients := fs.Int("clients", 64, "clients, each on a connection of its own")
	rate := fs.Float64("rate", 5, "calls per second per client (a Poisson process); 0: back to back")
	seconds := fs.Float64("seconds", 10, "how long the clients call")
	warmup := fs.Int("warmup", 20, "untimed calls per client first")
	seed := fs.Uint64("seed", 1, "seed of the request draws and call times")
	idList := fs.String("ids", "", "the resource's device IDs, comma-separated")
	if err := fs.Parse(args); err != nil {
		return err
	}
	ids, err := splitIDs(*idList)
	if err != nil {
		return err
	}
	if *socket == "" || *clients < 1 || *rate < 0 || *seconds <= 0 || *warmup < 0 {
		return fmt.Errorf("-socket, -clients >= 1, -rate >= 0, -seconds > 0 are required")
	}
	gap := func(rng *rand.Rand) time.Duration {
		if *rate == 0 {
			return 0
		}
		return time.Duration(rng.ExpFloat64() / *rate * float64(time.Second))
	}
	if *method != "allocate" && *method != "preferred" {
		return fmt.Errorf("unknown -method %q: allocate or preferred", *method)
	}
	stubs := make([]pluginapi.DevicePluginClient, *clients)
	for i := range stubs {
		client, conn, err := dial(*socket)
		if err != nil {
			return err
		}
		defer conn.Close()
		stubs[i] = client
	}
	invoke := func(client pluginapi.DevicePluginClient, rng *rand.Rand, trial int) error {
		var err error
		if *method == "allocate" {
			_, err = client.Allocate(context.Background(), &pluginapi.AllocateRequest{
				ContainerRequests: []*pluginapi.ContainerAllocateRequest{{DevicesIds: sample(rng, ids, 1+rng.IntN(len(ids)))}},
			})
		} else {
			_, err = client.GetPreferredAllocation(context.Background(), preferredRequest(rng, ids, trial))
		}
		return err
	}
	rngs := make([]*rand.Rand, *clients)
	for c := range rngs {
		rngs[c] = rand.New(rand.NewPCG(*seed, uint64(c)))
	}
	for c, client := range stubs {
		for i := 0; i < *warmup; i++ {
			if err := invoke(client, rngs[c], i); err != nil {
				return fmt.Errorf("client %d: warm-up call %d: %v", c, i, err)
			}
		}
	}
	out := loadResult{Method: *method, Clients: *clients, RatePerClient: *rate, Seconds: *seconds, Warmup: *warmup,
		Errors: []string{}}
	var (
		mu       sync.Mutex
		inFlight atomic.Int64
		maxSeen  atomic.Int64
		wg       sync.WaitGroup
	)
	out.Started = time.Now()
	end := out.Started.Add(time.Duration(*seconds * float64(time.Second)))
	for c, client := range stubs {
		wg.Add(1)
		go func(c int, client pluginapi.DevicePluginClient) {
			defer wg.Done()
			rng := rngs[c]
			next := out.Started.Add(gap(rng))
			var latencies, seen []int64
			var errs []string
			for trial := 0; next.Before(end); trial++ {
				time.Sleep(time.Until(next))
				now := inFlight.Add(1)
				for {
					top := maxSeen.Load()
					if now <= top || maxSeen.CompareAndSwap(top, now) {
						break
					}
				}
				start := time.Now()
				err := invoke(client, rng, trial)
				took := time.Since(start).Nanoseconds()
				inFlight.Add(-1)
				if err != nil {
					errs = append(errs, fmt.Sprintf("client %d call %d: %v", c, trial, err))
				} else {
					latencies = append(latencies, took)
					seen = append(seen, now)
				}
				if *rate == 0 {
					next = time.Now()
				} else {
					next = next.Add(gap(rng))
				}
			}
			mu.Lock()
			out.LatencyNs = append(out.LatencyNs, latencies...)
			out.InFlightSeen = append(out.InFlightSeen, seen...)
			out.Errors = append(out.Errors, errs...)
			mu.Unlock()
		}(c, client)
	}
	wg.Wait()
	out.WallS = time.Since(out.Started).Seconds()
	out.MaxInFlight = maxSeen.Load()
	var usage syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &usage); err == nil {
		out.CPUS = time.Duration(usage.Utime.Nano() + usage.Stime.Nano()).Seconds()
	}
	return json.NewEncoder(os.Stdout).Encode(out)
}

// dial connects as the kubelet's device manager does (plugin/v1beta1/client.go in k8s.io/kubernetes).
func dial(socket string) (pluginapi.DevicePluginClient, *grpc.ClientConn, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := grpc.DialContext(ctx, socket, //nolint:staticcheck // what the kubelet calls
		grpc.WithAuthority("localhost"),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithBlock(), //nolint:staticcheck // what the kubelet passes
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", addr)
		}),
	)
	if err != nil {
		return nil, nil, fmt.Errorf("cannot dial %s: %v", socket, err)
	}
	return pluginapi.NewDevicePluginClient(conn), conn, nil
}

// sample returns n distinct IDs in random order.
func sample(rng *rand.Rand, ids []string, n int) []string {
	perm := rng.Perm(len(ids))
	out := make([]string, n)
	for i := range out {
		out[i] = ids[perm[i]]
	}
	return out
}

// preferredRequest draws a size from 1..N and an available set of at least that size; every fourth request
// of size 2 or more also names one or two must-include devices among the available ones (as the kubelet does
// for devices a container already holds).
func preferredRequest(rng *rand.Rand, ids []string, trial int) *pluginapi.PreferredAllocationRequest {
	size := 1 + rng.IntN(len(ids))
	available := sample(rng, ids, size+rng.IntN(len(ids)-size+1))
	var must []string
	if size >= 2 && trial%4 == 3 {
		must = append(must, available[:1+rng.IntN(min(2, size-1))]...)
	}
	return &pluginapi.PreferredAllocationRequest{
		ContainerRequests: []*pluginapi.ContainerPreferredAllocationRequest{{
			AvailableDeviceIDs:   available,
			MustIncludeDeviceIDs: must,
			AllocationSize:       int32(size),
		}},
	}
}

// --- the floor server ---------------------------------------------------------------------------------------

type floor struct {
	pluginapi.UnimplementedDevicePluginServer
	devices  []*pluginapi.Device
	allocate *pluginapi.AllocateResponse
}

func (f *floor) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{GetPreferredAllocationAvailable: true}, nil
}

func (f *floor) ListAndWatch(_ *pluginapi.Empty, stream pluginapi.DevicePlugin_ListAndWatchServer) error {
	if err := stream.Send(&pluginapi.ListAndWatchResponse{Devices: f.devices}); err != nil {
		return err
	}
	<-stream.Context().Done()
	return nil
}

func (f *floor) Allocate(context.Context, *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	return f.allocate, nil
}

func (f *floor) GetPreferredAllocation(
	_ context.Context, req *pluginapi.PreferredAllocationRequest,
) (*pluginapi.PreferredAllocationResponse, error) {
	out := &pluginapi.PreferredAllocationResponse{}
	for _, c := range req.ContainerRequests {
		n := min(int(c.AllocationSize), len(c.AvailableDeviceIDs))
		out.ContainerResponses = append(out.ContainerResponses,
			&pluginapi.ContainerPreferredAllocationResponse{DeviceIDs: c.AvailableDeviceIDs[:n]})
	}
	return out, nil
}

func (f *floor) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

func serve(args []string) error {
	fs := flag.NewFlagSet("serve", flag.ContinueOnError)
	socket := fs.String("socket", "", "unix socket to serve on")
	idList := fs.String("ids", "", "device IDs to list, comma-separated")
	if err := fs.Parse(args); err != nil {
		return err
	}
	ids, err := splitIDs(*idList)
	if err != nil {
		return err
	}
	if *socket == "" {
		return fmt.Errorf("-socket is required")
	}
	f := &floor{allocate: &pluginapi.AllocateResponse{ContainerResponses: []*pluginapi.ContainerAllocateResponse{{
		Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": strings.Join(ids, ",")},
	}}}}
	for _, id := range ids {
		f.devices = append(f.devices, &pluginapi.Device{ID: id, Health: pluginapi.Healthy})
	}
	_ = os.Remove(*socket)
	ln, err := net.Listen("unix", *socket)
	if err != nil {
		return err
	}
	server := grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(server, f)
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-signals
		server.Stop()
	}()
	err = server.Serve(ln) // returns nil after Stop; the listener removes its socket when it closes
	return err
}
