package iptables

import (
	"context"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// fakeIptables is an iptables that keeps each chain of each table as a file of rule lines under
// $FAKE_IPTABLES_STATE/<command>/<table>/<chain> and logs every command line to <command>.log.
const fakeIptables = `#!/bin/sh
cmd=$(basename "$0")
if [ "$1" = --version ]; then echo "$cmd v1.8.9 (nf_tables)"; exit 0; fi
echo "$*" >>"$FAKE_IPTABLES_STATE/$cmd.log"
[ "$1" = -w ] && [ "$2" = 5 ] || { echo "no -w 5" >&2; exit 2; }
op=$3 chain=$4
[ "$5" = -t ] || { echo "no -t" >&2; exit 2; }
dir=$FAKE_IPTABLES_STATE/$cmd/$6
shift 6
f=$dir/$chain
[ -f "$FAKE_IPTABLES_STATE/$cmd.locked" ] && { echo "Another app is currently holding the xtables lock." >&2; exit 4; }
case $op in
-N) [ -e "$f" ] && { echo "iptables: Chain already exists." >&2; exit 1; }; mkdir -p "$dir" && : >"$f" ;;
-S) [ -e "$f" ] || { echo "iptables: No chain/target/match by that name." >&2; exit 1; }; cat "$f" ;;
-X) [ -e "$f" ] || { echo "iptables: No chain/target/match by that name." >&2; exit 1; }; rm "$f" ;;
-C) [ -e "$f" ] || { echo "iptables: No chain/target/match by that name." >&2; exit 1; }
    grep -qxF -- "$*" "$f" || { echo "iptables: Bad rule (does a matching rule exist in that chain?)." >&2; exit 1; } ;;
-I) [ -e "$f" ] || exit 1; { printf '%s\n' "$*"; cat "$f"; } >"$f.new" && mv "$f.new" "$f" ;;
-A) [ -e "$f" ] || exit 1; printf '%s\n' "$*" >>"$f" ;;
*) echo "unknown option $op" >&2; exit 2 ;;
esac
`

// node is a PATH with only the fake commands named, each with the built-in chains of a fresh network
// namespace, and their state directory.
func node(t *testing.T, commands ...string) string {
	t.Helper()
	bin, state := t.TempDir(), t.TempDir()
	for _, command := range commands {
		if err := os.WriteFile(filepath.Join(bin, command), []byte(fakeIptables), 0o755); err != nil {
			t.Fatal(err)
		}
		for table, chains := range map[string][]string{
			"nat":    {"PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"},
			"filter": {"INPUT", "FORWARD", "OUTPUT"},
			"mangle": {"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"},
		} {
			dir := filepath.Join(state, command, table)
			if err := os.MkdirAll(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			for _, chain := range chains {
				if err := os.WriteFile(filepath.Join(dir, chain), nil, 0o644); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	// The fakes and the tools they use; the machine's own iptables (in /usr/sbin) is out of reach.
	t.Setenv("PATH", bin+":/usr/bin:/bin")
	t.Setenv("FAKE_IPTABLES_STATE", state)
	return state
}

func rules(t *testing.T, state, command, table, chain string) []string {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(state, command, table, chain))
	if err != nil {
		t.Fatal(err)
	}
	return strings.Split(strings.TrimSuffix(string(data), "\n"), "\n")
}

func exists(state, command, table, chain string) bool {
	_, err := os.Stat(filepath.Join(state, command, table, chain))
	return err == nil
}

func TestNewBestEffortHasTheFamiliesWhoseCommandsWork(t *testing.T) {
	ctx := context.Background()
	node(t, "iptables")
	found := NewBestEffort(ctx, UseInstalledMode)
	if len(found) != 1 || found[ProtocolIPv4] == nil {
		t.Fatalf("NewBestEffort = %v, want IPv4 only (no ip6tables)", found)
	}
	if v4 := found[ProtocolIPv4]; v4.Protocol() != ProtocolIPv4 || v4.IsIPv6() {
		t.Errorf("IPv4 interface: Protocol %q, IsIPv6 %v", v4.Protocol(), v4.IsIPv6())
	}

	node(t, "iptables", "ip6tables")
	both := NewBestEffort(ctx, UseInstalledMode)
	if len(both) != 2 || !both[ProtocolIPv6].IsIPv6() || both[ProtocolIPv6].Protocol() != ProtocolIPv6 {
		t.Fatalf("NewBestEffort = %v, want IPv4 and IPv6", both)
	}

	node(t)
	if none := NewBestEffort(ctx, UseInstalledMode); len(none) != 0 {
		t.Fatalf("NewBestEffort without iptables = %v, want none", none)
	}
	node(t, "iptables")
	if unknown := NewBestEffort(ctx, Mode("detect")); len(unknown) != 0 {
		t.Fatalf("NewBestEffort of an unknown mode = %v, want none", unknown)
	}
}

// The kubelet's own calls (pkg/kubelet/kubelet_network_linux.go), twice: the second time everything exists.
func TestTheKubeletsRulesAreMadeOnceInTheInstalledIptables(t *testing.T) {
	ctx := context.Background()
	state := node(t, "iptables")
	ipt := NewBestEffort(ctx, UseInstalledMode)[ProtocolIPv4]
	drop := []string{"-m", "comment", "--comment", "block incoming localnet connections", "--dst", "127.0.0.0/8",
		"!", "--src", "127.0.0.0/8", "-m", "conntrack", "!", "--ctstate", "RELATED,ESTABLISHED,DNAT", "-j", "DROP"}
	for round, want := range []bool{false, true} {
		for _, got := range []func() (bool, error){
			func() (bool, error) { return ipt.EnsureChain(ctx, TableMangle, "KUBE-IPTABLES-HINT") },
			func() (bool, error) { return ipt.EnsureChain(ctx, TableFilter, "KUBE-FIREWALL") },
			func() (bool, error) {
				return ipt.EnsureRule(ctx, Prepend, TableFilter, ChainOutput, "-j", "KUBE-FIREWALL")
			},
			func() (bool, error) {
				return ipt.EnsureRule(ctx, Prepend, TableFilter, ChainInput, "-j", "KUBE-FIREWALL")
			},
			func() (bool, error) { return ipt.EnsureRule(ctx, Append, TableFilter, "KUBE-FIREWALL", drop...) },
		} {
			if existed, err := got(); err != nil || existed != want {
				t.Fatalf("round %d: (%v, %v), want (%v, nil)", round, existed, err, want)
			}
		}
	}
	if !exists(state, "iptables", "mangle", "KUBE-IPTABLES-HINT") {
		t.Error("no KUBE-IPTABLES-HINT in mangle")
	}
	for _, chain := range []string{"INPUT", "OUTPUT"} {
		if got := rules(t, state, "iptables", "filter", chain); !reflect.DeepEqual(got, []string{"-j KUBE-FIREWALL"}) {
			t.Errorf("filter %s = %q", chain, got)
		}
	}
	if got := rules(t, state, "iptables", "filter", "KUBE-FIREWALL"); !reflect.DeepEqual(got,
		[]string{strings.Join(drop, " ")}) {
		t.Errorf("KUBE-FIREWALL = %q", got)
	}
	log, err := os.ReadFile(filepath.Join(state, "iptables.log"))
	if err != nil {
		t.Fatal(err)
	}
	if first := strings.SplitN(string(log), "\n", 3)[:2]; !reflect.DeepEqual(first, []string{
		"-w 5 -S POSTROUTING -t nat", "-w 5 -N KUBE-IPTABLES-HINT -t mangle"}) {
		t.Errorf("first commands = %q", first)
	}
}

func TestAFailureSaysWhatIptablesSaid(t *testing.T) {
	ctx := context.Background()
	state := node(t, "iptables")
	ipt := NewBestEffort(ctx, UseInstalledMode)[ProtocolIPv4]
	if err := os.WriteFile(filepath.Join(state, "iptables.locked"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := ipt.EnsureChain(ctx, TableMangle, "KUBE-IPTABLES-HINT")
	want := `error creating chain "KUBE-IPTABLES-HINT": exit status 4: Another app is currently holding the xtables lock.`
	if err == nil || strings.TrimSpace(err.Error()) != want {
		t.Errorf("EnsureChain with the lock held: %v, want %q", err, want)
	}
	_, err = ipt.EnsureRule(ctx, Prepend, TableFilter, ChainInput, "-j", "KUBE-FIREWALL")
	want = "error checking rule: exit status 4: Another app is currently holding the xtables lock."
	if err == nil || strings.TrimSpace(err.Error()) != want {
		t.Errorf("EnsureRule with the lock held: %v, want %q", err, want)
	}
}

// A flush of every table (a firewall reload) brings the reload and new canaries; the end of the context takes
// the canaries away.
func TestMonitorReloadsAfterAFlushAndRemovesItsCanariesWhenStopped(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	state := node(t, "iptables")
	ipt := NewBestEffort(ctx, UseInstalledMode)[ProtocolIPv4]
	tables := []Table{TableMangle, TableNAT, TableFilter}
	var reloads atomic.Int32
	done := make(chan struct{})
	go func() {
		defer close(done)
		ipt.Monitor(ctx, "KUBE-KUBELET-CANARY", tables, func() { reloads.Add(1) }, 20*time.Millisecond)
	}()
	within := func(what string, check func() bool) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); !check(); time.Sleep(10 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("not within 10 s: %s", what)
			}
		}
	}
	canaries := func(want bool) func() bool {
		return func() bool {
			for _, table := range tables {
				if exists(state, "iptables", string(table), "KUBE-KUBELET-CANARY") != want {
					return false
				}
			}
			return true
		}
	}
	within("the canaries", canaries(true))
	if n := reloads.Load(); n != 0 {
		t.Fatalf("%d reloads before any flush", n)
	}
	for _, table := range tables {
		if err := os.Remove(filepath.Join(state, "iptables", string(table), "KUBE-KUBELET-CANARY")); err != nil {
			t.Fatal(err)
		}
	}
	within("a reload", func() bool { return reloads.Load() == 1 })
	within("the canaries again", canaries(true))
	cancel()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Monitor did not return within 10 s of its context's end")
	}
	if !canaries(false)() {
		t.Error("canaries left after Monitor returned")
	}
	if n := reloads.Load(); n != 1 {
		t.Errorf("%d reloads, want 1", n)
	}
}
