package iptables

import (
	"context"
	"time"

	"k8s.io/klog/v2"
)

func (r *runner) Monitor(ctx context.Context, canary Chain, tables []Table, reloadFunc func(), interval time.Duration) {
	logger := klog.FromContext(ctx)
	if len(tables) == 0 {
		logger.Error(nil, "No tables to watch for an iptables flush", "chain", canary)
		return
	}
	for {
		// The canaries, every interval until each table has one.
		planted := poll(ctx, interval, true, func() bool {
			for _, table := range tables {
				if _, err := r.EnsureChain(ctx, table, canary); err != nil {
					if ctx.Err() != nil { // stopped, not failed
						return false
					}
					logger.Error(err, "Could not set up iptables canary", "table", table, "chain", canary)
					return false
				}
			}
			return true
		})
		// Then every interval until the first table's canary is gone.
		flushed := planted && poll(ctx, interval, false, func() bool {
			exists, err := r.chainExists(ctx, tables[0], canary)
			if exists || ctx.Err() != nil { // there, or the command stopped with the context
				return false
			}
			if isResourceError(err) { // the lock not had: no answer yet
				logger.Error(err, "Could not check for iptables canary", "table", tables[0], "chain", canary)
				return false
			}
			logger.V(2).Info("IPTables canary deleted", "table", tables[0], "chain", canary)
			// A flush empties the tables one after another: reload once the others are empty too, or after
			// flushWait whatever they hold.
			if !r.waitGone(ctx, canary, tables[1:]) && ctx.Err() == nil {
				logger.Info("Inconsistent iptables state detected")
			}
			return true
		})
		if !flushed {
			r.removeCanaries(ctx, canary, tables)
			return
		}
		logger.V(2).Info("Reloading after iptables flush")
		reloadFunc()
	}
}

// waitGone looks every flushPoll, for flushWait at most, until no table of tables has the canary (a table that
// cannot be read for a resource problem counts as having it). True once none has.
func (r *runner) waitGone(ctx context.Context, canary Chain, tables []Table) bool {
	deadline := time.Now().Add(flushWait)
	for {
		gone := true
		for _, table := range tables {
			if exists, err := r.chainExists(ctx, table, canary); exists || isResourceError(err) {
				gone = false
				break
			}
		}
		if gone {
			return true
		}
		if !time.Now().Add(flushPoll).Before(deadline) || !sleep(ctx, flushPoll) {
			return false
		}
	}
}

// removeCanaries deletes the canary from every table once Monitor's context ended, on a context of its own.
func (r *runner) removeCanaries(ctx context.Context, canary Chain, tables []Table) {
	cleanup, cancel := context.WithTimeout(context.WithoutCancel(ctx), cleanupTimeout)
	defer cancel()
	for _, table := range tables {
		_ = r.deleteChain(cleanup, table, canary)
	}
}

// poll calls done (at once when immediate, then every interval) until it returns true: true then, false when
// ctx ended first.
func poll(ctx context.Context, interval time.Duration, immediate bool, done func() bool) bool {
	if ctx.Err() != nil {
		return false
	}
	if immediate && done() {
		return true
	}
	ticker := time.NewTicker(interval)
	defer ticker.Stop()
	for {
		select {
		case <-ctx.Done():
			return false
		case <-ticker.C:
			if done() {
				return true
			}
		}
	}
}

// sleep waits d, or less when ctx ends: false then.
func sleep(ctx context.Context, d time.Duration) bool {
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-timer.C:
		return true
	}
}
