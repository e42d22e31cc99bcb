package iptables

import (
	"context"
	"errors"
	"fmt"
	"os/exec"
	"strings"
	"time"

	"k8s.io/klog/v2"
)

// Protocol is the IP family one Interface manages.
type Protocol string

const (
	// ProtocolIPv4 is managed with the iptables command.
	ProtocolIPv4 Protocol = "IPv4"
	// ProtocolIPv6 is managed with the ip6tables command.
	ProtocolIPv6 Protocol = "IPv6"
)

// Table is one of the kernel's built-in tables.
type Table string

const (
	// TableNAT is the nat table.
	TableNAT Table = "nat"
	// TableFilter is the filter table.
	TableFilter Table = "filter"
	// TableMangle is the mangle table.
	TableMangle Table = "mangle"
)

// Chain is a chain of a table, built-in or made by a caller.
type Chain string

const (
	// ChainInput is the built-in chain of packets for this host.
	ChainInput Chain = "INPUT"
	// ChainOutput is the built-in chain of packets this host sends.
	ChainOutput Chain = "OUTPUT"

	// chainPostrouting is the nat chain whose listing tells that a family's iptables works.
	chainPostrouting Chain = "POSTROUTING"
)

// RulePosition is where EnsureRule adds a missing rule: the iptables flag that adds it.
type RulePosition string

const (
	// Prepend inserts the rule at the head of the chain (-I).
	Prepend RulePosition = "-I"
	// Append adds the rule at the end of the chain (-A).
	Append RulePosition = "-A"
)

// Mode says which iptables backend NewBestEffort's interfaces use.
type Mode string

// UseInstalledMode uses the node's iptables and ip6tables commands as installed: the backend (legacy or nft)
// is the one they are.
const UseInstalledMode Mode = "installed"

// Interface runs one IP family's iptables commands. Its methods may be called from several goroutines.
type Interface interface {
	// EnsureChain creates the chain unless it exists; true when it existed.
	EnsureChain(ctx context.Context, table Table, chain Chain) (bool, error)
	// EnsureRule adds the rule at position unless the chain has it; true when it had.
	EnsureRule(ctx context.Context, position RulePosition, table Table, chain Chain, args ...string) (bool, error)
	// IsIPv6 is true for the IPv6 family's interface.
	IsIPv6() bool
	// Protocol is the family this interface manages.
	Protocol() Protocol
	// Monitor notices when something outside (a firewall reload, say) flushes the tables: it creates the
	// canary chain in each table, polls tables[0] every interval until the canary is gone, waits a little for
	// it to be gone from the other tables too, calls reloadFunc, and starts again. It returns when ctx ends,
	// deleting its canaries. Run it in a goroutine of its own.
	Monitor(ctx context.Context, canary Chain, tables []Table, reloadFunc func(), interval time.Duration)
}

// NewBestEffort returns an Interface for each IP family whose iptables works on this node (IPv4 with iptables,
// IPv6 with ip6tables), keyed by family; an empty map where neither does. Missing support is not an error:
// callers that only want iptables where it exists take what they get.
func NewBestEffort(ctx context.Context, mode Mode) map[Protocol]Interface {
	logger := klog.FromContext(ctx)
	found := map[Protocol]Interface{}
	if mode != UseInstalledMode {
		logger.Error(nil, "Unknown iptables mode; using no iptables", "mode", mode)
		return found
	}
	for _, protocol := range []Protocol{ProtocolIPv4, ProtocolIPv6} {
		r := &runner{protocol: protocol, command: "iptables"}
		if protocol == ProtocolIPv6 {
			r.command = "ip6tables"
		}
		if err := r.present(ctx); err != nil {
			logger.V(2).Info("No iptables support for this family", "protocol", protocol, "err", err)
			continue
		}
		logger.V(2).Info("Using the installed iptables", "protocol", protocol, "command", r.command,
			"backend", r.backend(ctx))
		found[protocol] = r
	}
	return found
}

// runner implements Interface with the installed iptables or ip6tables command.
type runner struct {
	protocol Protocol
	command  string
}

const (
	// waitSeconds is how long each command waits for the xtables lock (-w).
	waitSeconds = "5"
	// checkTimeout bounds a rule check (-C), which can be slow on huge tables.
	checkTimeout = 5 * time.Minute
	// exitFailed is iptables' exit status for an operation that failed (the chain exists, the rule does not),
	// as against a command line it could not run.
	exitFailed = 1
	// exitResourceProblem is iptables' exit status for a resource problem, such as the xtables lock not had
	// within the wait.
	exitResourceProblem = 4
	// flushWait and flushPoll: once the first table's canary is gone, how long and how often to look for the
	// other tables' canaries to go too.
	flushWait = 5 * time.Second
	flushPoll = 100 * time.Millisecond
	// cleanupTimeout bounds deleting the canaries after Monitor's context ended.
	cleanupTimeout = 10 * time.Second
)

// run runs `<command> -w 5 <op> <chain> -t <table> [args...]` and returns its combined output.
func (r *runner) run(ctx context.Context, op string, table Table, chain Chain, args ...string) ([]byte, error) {
	argv := append([]string{"-w", waitSeconds, op, string(chain), "-t", string(table)}, args...)
	klog.FromContext(ctx).V(5).Info("Running", "command", r.command, "arguments", argv)
	return exec.CommandContext(ctx, r.command, argv...).CombinedOutput()
}

// exitStatus is the exit status of a command that ran and exited, or -1.
func exitStatus(err error) int {
	var exited *exec.ExitError
	if errors.As(err, &exited) && exited.Exited() {
		return exited.ExitCode()
	}
	return -1
}

func (r *runner) EnsureChain(ctx context.Context, table Table, chain Chain) (bool, error) {
	out, err := r.run(ctx, "-N", table, chain)
	switch {
	case err == nil:
		return false, nil
	case exitStatus(err) == exitFailed: // "Chain already exists"
		return true, nil
	default:
		return false, fmt.Errorf("error creating chain %q: %v: %s", chain, err, out)
	}
}

func (r *runner) EnsureRule(ctx context.Context, position RulePosition, table Table, chain Chain,
	args ...string) (bool, error) {
	exists, err := r.checkRule(ctx, table, chain, args...)
	if err != nil {
		return false, err
	}
	if exists {
		return true, nil
	}
	if out, err := r.run(ctx, string(position), table, chain, args...); err != nil {
		return false, fmt.Errorf("error appending rule: %v: %s", err, out)
	}
	return false, nil
}

// checkRule says whether the chain has the rule (-C), or why it could not tell.
func (r *runner) checkRule(ctx context.Context, table Table, chain Chain, args ...string) (bool, error) {
	bounded, cancel := context.WithTimeout(ctx, checkTimeout)
	defer cancel()
	out, err := r.run(bounded, "-C", table, chain, args...)
	if errors.Is(bounded.Err(), context.DeadlineExceeded) {
		return false, fmt.Errorf("timed out while checking rules")
	}
	switch {
	case err == nil:
		return true, nil
	case exitStatus(err) == exitFailed: // no such rule
		return false, nil
	default:
		return false, fmt.Errorf("error checking rule: %v: %s", err, out)
	}
}

func (r *runner) IsIPv6() bool { return r.protocol == ProtocolIPv6 }

func (r *runner) Protocol() Protocol { return r.protocol }

// chainExists lists the chain (-S): true when that worked; otherwise false and the command's error.
func (r *runner) chainExists(ctx context.Context, table Table, chain Chain) (bool, error) {
	out, err := r.run(ctx, "-S", table, chain)
	if err != nil {
		return false, fmt.Errorf("error listing chain %q in table %q: %w: %s", chain, table, err, out)
	}
	return true, nil
}

func (r *runner) deleteChain(ctx context.Context, table Table, chain Chain) error {
	if out, err := r.run(ctx, "-X", table, chain); err != nil {
		return fmt.Errorf("error deleting chain %q: %v: %s", chain, err, out)
	}
	return nil
}

// present is nil when this family's iptables works: its command exists and lists the nat table's POSTROUTING.
func (r *runner) present(ctx context.Context) error {
	_, err := r.chainExists(ctx, TableNAT, chainPostrouting)
	return err
}

// backend is "nf_tables" or "legacy" as `<command> --version` says, for the log ("unknown" if it says neither).
func (r *runner) backend(ctx context.Context) string {
	out, err := exec.CommandContext(ctx, r.command, "--version").Output()
	text := string(out)
	switch {
	case err != nil:
		return "unknown"
	case strings.Contains(text, "(nf_tables)"):
		return "nf_tables"
	case strings.Contains(text, "(legacy)"):
		return "legacy"
	default:
		return "unknown"
	}
}

// isResourceError is true for a command that exited with iptables' resource-problem status (4).
func isResourceError(err error) bool {
	return exitStatus(err) == exitResourceProblem
}
