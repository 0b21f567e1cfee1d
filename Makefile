# Every target does every step it needs on a fresh machine (Python 3.11, a C++ compiler, CMake).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Rebuilt only when what it depends on changes; a ready machine skips straight to the check.
STAMP := $(VENV)/.installed
HOROVOD_STAMP := $(VENV)/.horovod
HOROVOD_VERSION := 0.28.1
HOROVOD_SRC := build/horovod-$(HOROVOD_VERSION)
HOROVOD_PATCHES := $(sort $(wildcard patches/horovod-$(HOROVOD_VERSION)-*.patch))
HOROVOD_BUILD_ENV := HOROVOD_WITH_GLOO=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_MPI=1 \
	HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 MAKEFLAGS=-j$(shell nproc)
PYTEST_ARGS ?=

.PHONY: install test demo lint bench bench-quick native clean

install: $(STAMP)
	@$(PY) -m horovod_ray._check_install --require-fix

# Two steps: the stack with horovod built from source (minutes), then this package (seconds),
# so that a change to setup.py does not rebuild horovod.
$(HOROVOD_STAMP): constraints.txt Makefile $(HOROVOD_PATCHES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade "pip>=23.2" "setuptools>=65" wheel
	$(PIP) install --quiet -c constraints.txt tensorflow-cpu "ray[default,tune]" numpy \
		protobuf pandas pyarrow
	# horovod's source release, with this repo's fixes applied (see patches/), compiled
	# against the TensorFlow installed above, so no build isolation.
	rm -rf $(HOROVOD_SRC) build/horovod-sdist
	$(PIP) download --quiet --no-deps --no-binary horovod -d build/horovod-sdist \
		horovod==$(HOROVOD_VERSION)
	tar -xzf build/horovod-sdist/horovod-$(HOROVOD_VERSION).tar.gz -C build
	for p in $(HOROVOD_PATCHES); do git apply --directory=$(HOROVOD_SRC) $$p || exit 1; done
	$(HOROVOD_BUILD_ENV) $(PIP) install --quiet --no-build-isolation --no-cache-dir \
		--force-reinstall --no-deps ./$(HOROVOD_SRC)
	$(PIP) install --quiet -c constraints.txt horovod==$(HOROVOD_VERSION)
	touch $(HOROVOD_STAMP)

$(STAMP): $(HOROVOD_STAMP) setup.py
	$(PIP) install --quiet -c constraints.txt -e '.[tensorflow,tune,test,examples,bench]'
	touch $(STAMP)

# Pure logic first (no Ray, seconds), then everything on real Ray.
UNIT_TESTS := test/test_calls.py test/test_command.py test/test_elastic_logic.py test/test_errors.py \
	test/test_failures.py \
	test/test_lifecycle.py test/test_network.py test/test_ranks.py test/test_settings.py

test: install
	$(PY) -m pytest $(PYTEST_ARGS) $(UNIT_TESTS)
	$(PY) -m pytest $(PYTEST_ARGS) $(addprefix --ignore=,$(UNIT_TESTS)) test

demo: install
	$(PY) examples/tensorflow2_digits.py --num-workers 2

lint: install
	$(PY) -m ruff check horovod_ray test examples
	$(PY) -m ruff format --check horovod_ray test examples

# The raw Gloo ceiling for B1: Debian's libgloo-dev, built with CMake.
native:
	test -f /usr/include/gloo/allreduce_ring.h || \
		(apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libgloo-dev)
	cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
	cmake --build build -j$(shell nproc)

bench: install native
	$(PY) -m bench.run --mode full

bench-quick: install native
	$(PY) -m bench.run --mode quick

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
