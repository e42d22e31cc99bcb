package main

// The device plugin under test, run as a child process.

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"time"
)

type pluginProcess struct {
	cmd  *exec.Cmd
	log  *os.File
	done chan struct{}
	err  error // from Wait, valid once done is closed

	killOnce sync.Once
}

// startPlugin runs argv with every "{dir}" replaced by the socket directory.
// The child gets its own process group so that the harness can kill whatever
// it started, even if the plugin forks.
func startPlugin(argv []string, dir, logPath string) (*pluginProcess, error) {
	args := make([]string, len(argv))
	for i, a := range argv {
		args[i] = strings.ReplaceAll(a, "{dir}", dir)
	}
	logFile, err := os.Create(logPath)
	if err != nil {
		return nil, err
	}
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Stdout = logFile
	cmd.Stderr = logFile
	// Pdeathsig: should the harness itself be killed, the plugin goes with it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		logFile.Close()
		return nil, fmt.Errorf("starting %q: %w", strings.Join(args, " "), err)
	}
	p := &pluginProcess{cmd: cmd, log: logFile, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		close(p.done)
	}()
	return p, nil
}

func (p *pluginProcess) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// terminate sends SIGTERM to the plugin itself (not its group, as the
// kubelet's container runtime signals the container's first process) and
// waits for it to exit. It returns the exit code, or an error on timeout.
func (p *pluginProcess) terminate(timeout time.Duration) (int, error) {
	if !p.exited() {
		if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
			return -1, err
		}
	}
	select {
	case <-p.done:
	case <-time.After(timeout):
		return -1, fmt.Errorf("still running %s after SIGTERM", timeout)
	}
	var exitErr *exec.ExitError
	switch {
	case p.err == nil:
		return 0, nil
	case errors.As(p.err, &exitErr):
		return exitErr.ExitCode(), nil // -1 when killed by a signal
	default:
		return -1, p.err
	}
}

// kill ends the plugin's whole process group; used on the way out whatever
// happened before.
func (p *pluginProcess) kill() {
	p.killOnce.Do(func() {
		_ = syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
		select {
		case <-p.done:
		case <-time.After(5 * time.Second):
		}
		p.log.Close()
	})
}

// tail returns the last lines of the plugin's output, for failure reports.
func tail(path string, lines int) string {
	data, err := os.ReadFile(path)
	if err != nil {
		return ""
	}
	all := bytes.Split(bytes.TrimRight(data, "\n"), []byte("\n"))
	if len(all) > lines {
		all = all[len(all)-lines:]
	}
	return string(bytes.Join(all, []byte("\n")))
}
