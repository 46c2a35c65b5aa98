# The two Quickstart commands: `make demo` and `make test`. Both install what they need first.
PYTHON ?= python3
PIP := $(PYTHON) -m pip
# CPU torch where no NVIDIA driver is present: an unpinned torch pulls several GB of CUDA packages.
TORCH_SPEC := $(shell command -v nvidia-smi >/dev/null 2>&1 && echo "torch>=2.1" || echo "torch==2.13.0")
PYTEST_ARGS ?=
# test processes (pytest-xdist), each taking whole files: one process kept 1 of 2 cores busy (9:06 -> 6:07)
PYTEST_WORKERS ?= 2
XDIST := -n $(PYTEST_WORKERS) --dist loadfile

.PHONY: setup setup-demo demo test test-slow test-docker test-netns test-all

# what the suite needs: the test tools and every optional extra the tests exercise
setup:
	$(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -e ".[test,hf,metrics,tensorboard,wandb]"

# what the demo needs: the core and matplotlib for its plots (the extras took 2 of its 2.5 minutes to install)
setup-demo:
	$(PIP) install --quiet "$(TORCH_SPEC)"
	$(PIP) install --quiet -e ".[bench]"

demo: setup-demo
	$(PYTHON) -m p2ptrain demo --workers 2 --outer-steps 5 --local-steps 20

# the default suite: unit and swarm tests, well under 15 minutes on 2 cores
test: setup
	$(PYTHON) -m pytest $(XDIST) -m "not slow and not docker and not netns" $(PYTEST_ARGS)

# the long swarm and chaos tests (minutes each): CI runs them after the default suite
test-slow: setup
	$(PYTHON) -m pytest $(XDIST) -m "slow and not docker and not netns" $(PYTEST_ARGS)

# the compose swarm: builds the image offline (docker/build-offline.sh) and runs it; needs a Docker engine
test-docker: setup
	$(PYTHON) -m pytest -m docker $(PYTEST_ARGS)

# workers behind real NAT routers in network namespaces (iptables MASQUERADE); needs root
test-netns: setup
	$(PYTHON) -m pytest -m netns $(PYTEST_ARGS)

test-all: setup
	$(PYTHON) -m pytest $(PYTEST_ARGS)
