# gpu-node-agent developer commands. `make demo` and `make test` set themselves up from a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-release unit lint protos protos-check testbin kubelet-harness bench bench-fleet bench-input clean cluster cluster-down mutate image

$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@{ $(PY) -m pip install -q --upgrade pip && $(PY) -m pip install -q -e '.[test]'; } >$(VENV)/install.log 2>&1 \
	  || { cat $(VENV)/install.log; exit 1; }
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	@$(VENV)/bin/gpu-agent simulate --node dgx-h100

lint: $(STAMP)
	$(VENV)/bin/ruff check agent tests
	$(VENV)/bin/mypy --strict agent

protos: $(STAMP)
	hack/protos.sh

# The Kubernetes release the rig, the kubelet harness's cluster and `make cluster` run: 1.35, 1.36, 1.37 or 1.38
# (make test KUBE=1.35); empty: the default, hack/testbin/kube/default (the newest GA release pinned; 1.38 is a beta). Each release's binaries are kept apart under .cache/testbin/kube-<release>.
KUBE ?=
export KUBE

testbin:
	hack/testbin.sh

kubelet-harness: testbin
	hack/kubelet-harness.sh

# A real single-node cluster on this machine (root): control plane, containerd, a kubelet, and the
# agent's DaemonSet on the fake NVML of PRESET. hack/cluster/kubectl talks to it.
PRESET ?= dgx-h100
cluster: $(STAMP)
	hack/cluster/up.sh $(PRESET)

cluster-down:
	hack/cluster/down.sh

# The agent's image for linux/amd64 and linux/arm64 from the Dockerfile, as one OCI image index in
# .cache/cluster/images/agent-index.tar (root; the arm64 half is built under qemu). Rebuilt only when its inputs change.
image:
	hack/image.sh

unit: $(STAMP)
	$(VENV)/bin/pytest tests/unit -q

# The whole suite on KUBE (default hack/testbin/kube/default), then, without KUBE, the tests marked `matrix` on the oldest release.
test: $(STAMP)
	hack/test.sh

# Only the tests that depend on the release (marker `matrix`), on KUBE: make test-release KUBE=1.36.
test-release: $(STAMP)
	@test -n "$(KUBE)" || { echo "make test-release needs KUBE (e.g. KUBE=1.36)"; exit 2; }
	hack/test.sh --matrix

# Mutation testing of the pure core against its unit tests (docs/mutation.md). Results are kept in mutants/
# and a second run only retests what changed; MUTANTS='agent.labels*' limits a run to matching mutants.
MUTATE_STAMP := $(VENV)/.installed-mutate
MUTANTS ?=
$(MUTATE_STAMP): $(STAMP)
	@$(PY) -m pip install -q -e '.[test,mutate]' >>$(VENV)/install.log 2>&1 || { cat $(VENV)/install.log; exit 1; }
	@touch $(MUTATE_STAMP)

mutate: $(MUTATE_STAMP)
	@start=$$(date +%s); nice -n 15 $(VENV)/bin/mutmut run $(MUTANTS) || exit 1; \
	  echo "mutmut run: $$(( $$(date +%s) - start )) s"
	@printf '%-30s %7s %7s %8s %8s %7s\n' module killed survived timeout 'no tests' other
	@$(VENV)/bin/mutmut results --all true | awk -F': ' '{ m = $$1; sub(/^ +/, "", m); sub(/\.x[_ǁ].*/, "", m); \
	  s = $$2; if (s != "killed" && s != "survived" && s != "timeout" && s != "no tests") s = "other"; n[m, s]++; \
	  mods[m] } END { for (m in mods) printf "%-30s %7d %7d %8d %8d %7d\n", m, n[m, "killed"], n[m, "survived"], \
	  n[m, "timeout"], n[m, "no tests"], n[m, "other"] }' | sort
	@$(VENV)/bin/mutmut results

# The agent's figures (bench/run.py), then what a fleet of 50 agents costs one API server (bench/fleet.py) and what
# reading hostile input files costs (bench/input_cost.py); all three into docs/benchmarks.md.
bench: $(STAMP)
	$(PY) bench/allocator_bench.py
	$(PY) bench/run.py
	$(PY) bench/fleet.py
	$(PY) bench/input_cost.py

bench-fleet: $(STAMP)
	$(PY) bench/fleet.py

bench-input: $(STAMP)
	$(PY) bench/input_cost.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
