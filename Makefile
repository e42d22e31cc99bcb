# gpu-node-agent developer commands. `make demo` and `make test` set themselves up from a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test unit lint protos protos-check testbin kubelet-harness bench clean cluster cluster-down

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

unit: $(STAMP)
	$(VENV)/bin/pytest tests/unit -q

test: $(STAMP)
	hack/test.sh

bench: $(STAMP)
	$(PY) bench/allocator_bench.py
	$(PY) bench/run.py

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
