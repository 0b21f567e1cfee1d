# Every target does every step it needs on a fresh machine (Python 3.11, a C++ compiler, CMake;
# GPU=tf also apt-get and dpkg-deb, docs/gpus.rst).
PYTHON ?= python3.11
# The TensorFlow line: 2.21 (the default: today's TensorFlow, Keras 3) or 2.15 (the 2023 line,
# Keras 2). Each line has its own constraints and its own environment, so both can stand side by side.
TF ?= 2.21
# GPU=1: the GPU line instead (docs/gpus.rst), PyTorch's CUDA build and horovod with NCCL, in
# its own environment; GPU=tf: TensorFlow's, in another (the two need different CUDA
# releases). Both build on a machine without a GPU, and `make test-gpu` runs on one.
GPU ?= 0
ifeq ($(filter $(GPU),0 1 tf),)
$(error GPU=$(GPU) is not a line: use GPU=1 (PyTorch's CUDA build), GPU=tf (TensorFlow's) or leave it out)
endif
# The chosen environment's site-packages, where pip's CUDA and NCCL wheels lie.
SITE = $(shell $(PY) -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
ifeq ($(GPU),1)
LINE := gpu
VENV := .venv-gpu
CONSTRAINTS := constraints-gpu.txt
# The CUDA 13 compiler, its headers and NVVM; the runtime and NCCL come with torch, and
# are named so that their pins in constraints-gpu.txt apply.
TF_PACKAGES := torch nvidia-cuda-nvcc nvidia-cuda-crt nvidia-cuda-cccl nvidia-nvvm \
	nvidia-cuda-runtime nvidia-nccl-cu13
TF_EXTRA := torch
WHEEL_EXTRAS := torch,tune
# pip's wheels have only libnccl.so.2 and libcudart.so.13: the build finds unversioned links
# to them in a folder of its own. nvcc's profile looks for its runtime in lib64, which the
# wheels name lib (CUDAFLAGS). The built extension finds both libraries at run time because
# horovod.torch imports torch first, which loads them from the environment's wheels.
CUDA_ROOT = $(SITE)/nvidia
HOROVOD_BUILD_ENV = HOROVOD_CUDA_HOME=$(CUDA_ROOT)/cu13 CUDA_HOME=$(CUDA_ROOT)/cu13 \
	CUDAFLAGS=-L$(CUDA_ROOT)/cu13/lib \
	CMAKE_LIBRARY_PATH=$(HOROVOD_BUILD)/links HOROVOD_NCCL_INCLUDE=$(CUDA_ROOT)/nccl/include \
	HOROVOD_NCCL_LIB=$(HOROVOD_BUILD)/links
else ifeq ($(GPU),tf)
LINE := gpu-tf
VENV := .venv-gpu-tf
CONSTRAINTS := constraints-gpu-tf.txt
# TensorFlow's GPU build with the CUDA 12 libraries it loads (its and-cuda extra: cuDNN,
# cuBLAS, NCCL, ...); the compiler comes from Debian (patches/gpu-tf/cuda12-home.sh).
TF_PACKAGES := 'tensorflow[and-cuda]' keras
TF_EXTRA := tensorflow-gpu
WHEEL_EXTRAS := tensorflow-gpu,tune
HOROVOD_GPU_TF := $(sort $(wildcard patches/gpu-tf/*))
# TensorFlow 2.21's headers include highwayhash and farmhash, which its wheel ships outside
# the include path it gives. NCCL's wheel has only libnccl.so.2: a link in links/ (below).
HOROVOD_BUILD_ENV = HOROVOD_CUDA_HOME=$(HOROVOD_BUILD)/cuda CUDA_HOME=$(HOROVOD_BUILD)/cuda \
	CXXFLAGS="-I$(SITE)/tensorflow/include/external/highwayhash \
	-I$(SITE)/tensorflow/include/external/farmhash_archive/src" \
	CMAKE_LIBRARY_PATH=$(HOROVOD_BUILD)/links HOROVOD_NCCL_INCLUDE=$(SITE)/nvidia/nccl/include \
	HOROVOD_NCCL_LIB=$(HOROVOD_BUILD)/links
else ifeq ($(TF),2.21)
LINE := tf$(TF)
VENV := .venv
CONSTRAINTS := constraints.txt
TF_PACKAGES := tensorflow-cpu keras torch
TF_EXTRA := tensorflow,torch,docs
WHEEL_EXTRAS := tensorflow,torch,tune
HOROVOD_TORCH := HOROVOD_WITH_PYTORCH=1
else ifeq ($(TF),2.15)
LINE := tf$(TF)
VENV := .venv-tf2.15
CONSTRAINTS := constraints-tf2.15.txt
TF_PACKAGES := tensorflow-cpu
TF_EXTRA := tensorflow-2023
WHEEL_EXTRAS := tensorflow-2023,tune
HOROVOD_TORCH := HOROVOD_WITHOUT_PYTORCH=1
else
$(error TF=$(TF) is not a supported TensorFlow line: use TF=2.21 (the default, Keras 3) or TF=2.15 (Keras 2))
endif
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Rebuilt only when what it depends on changes; a ready machine skips straight to the check.
STAMP := $(VENV)/.installed
HOROVOD_STAMP := $(VENV)/.horovod
HOROVOD_VERSION := 0.28.1
HOROVOD_PATCHES := $(sort $(wildcard patches/horovod-$(HOROVOD_VERSION)-*.patch)) \
	$(filter %.patch,$(HOROVOD_GPU_TF))
HOROVOD_FLAGS := HOROVOD_WITH_GLOO=1 HOROVOD_WITH_TENSORFLOW=1 $(HOROVOD_TORCH) \
	HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_MXNET=1
CHECK_FLAGS := --require-fix
ifeq ($(GPU),1)
# PyTorch alone (docs/gpus.rst says why not TensorFlow), with horovod's GPU collectives on
# NCCL, for Turing (75), Ampere (80), Hopper (90) and Blackwell (100) GPUs.
HOROVOD_FLAGS := HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITH_PYTORCH=1 \
	HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_GPU_OPERATIONS=NCCL \
	HOROVOD_NCCL_LINK=SHARED HOROVOD_BUILD_CUDA_CC_LIST=75,80,90,100
CHECK_FLAGS := --require-fix --gpu torch
else ifeq ($(GPU),tf)
# TensorFlow alone, with NCCL, for Volta (70), Turing (75), Ampere (80) and Hopper (90) GPUs
# (CUDA 12.4 predates Blackwell); XLA's custom calls (xla_mpi_ops.cc) are compiled, as on any
# GPU build.
HOROVOD_FLAGS := HOROVOD_WITH_GLOO=1 HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITHOUT_PYTORCH=1 \
	HOROVOD_WITHOUT_MPI=1 HOROVOD_WITHOUT_MXNET=1 HOROVOD_GPU_OPERATIONS=NCCL \
	HOROVOD_NCCL_LINK=SHARED HOROVOD_BUILD_CUDA_CC_LIST=70,75,80,90
CHECK_FLAGS := --require-fix --gpu tensorflow
endif
# horovod is compiled once for each set of what goes into it (its patches, the frameworks
# pinned, the flags, Python, the compiler), in a folder named by a hash of those, kept
# outside the checkout like pip's cache: a clean clone or a second line's rebuild of the
# environment reinstalls the wheel in seconds. build/$(LINE) links to it (tests compile
# against its Gloo). The folder is complete once it holds wheel/; `make clean-cache` empties it.
HOROVOD_CACHE ?= $(HOME)/.cache/horovod_ray
HOROVOD_KEY := $(shell (cat $(HOROVOD_PATCHES) $(HOROVOD_GPU_TF); \
	grep -E '^(tensorflow(-cpu)?|torch|horovod|nvidia-[a-z0-9-]+)==' $(CONSTRAINTS); \
	echo '$(HOROVOD_FLAGS)'; $(PYTHON) --version; c++ --version | head -1) \
	| sha256sum | cut -c1-16)
HOROVOD_BUILD := $(HOROVOD_CACHE)/horovod-$(HOROVOD_VERSION)-$(LINE)-$(HOROVOD_KEY)
HOROVOD_SRC := $(HOROVOD_BUILD)/horovod-$(HOROVOD_VERSION)
PYTEST_ARGS ?=

.PHONY: install horovod-wheel wheels test test-suite test-quick test-2023 test-subset \
	test-gpu-line test-gpu test-bench test-deploy test-image image print-image prometheus demo docs lint \
	bench bench-quick bench-lines native clean clean-cache

install: $(STAMP)
	@$(PY) -m horovod_ray.stack.check_install $(CHECK_FLAGS)

# Two steps: the stack with horovod built from source (minutes), then this package (seconds),
# so that a change to setup.py does not rebuild horovod.
$(HOROVOD_STAMP): $(CONSTRAINTS) Makefile $(HOROVOD_PATCHES) $(HOROVOD_GPU_TF)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade "pip>=23.2" "setuptools>=65" wheel
	$(PIP) install --quiet -c $(CONSTRAINTS) $(TF_PACKAGES) "ray[default,tune]" numpy \
		protobuf pandas pyarrow
	# horovod's source release, with this repo's fixes applied (see patches/), compiled
	# against the frameworks installed above, so no build isolation; one build at a time.
	mkdir -p $(HOROVOD_CACHE)
	flock $(HOROVOD_BUILD).lock $(MAKE) --no-print-directory TF=$(TF) GPU=$(GPU) horovod-wheel
	$(PIP) install --quiet --force-reinstall --no-deps $(HOROVOD_BUILD)/wheel/horovod-*.whl
	$(PIP) install --quiet -c $(CONSTRAINTS) horovod==$(HOROVOD_VERSION)
	mkdir -p build && rm -rf build/$(LINE) && ln -s $(HOROVOD_BUILD) build/$(LINE)
	touch $(HOROVOD_STAMP)

# Compiles horovod into $(HOROVOD_BUILD)/wheel unless an earlier build left it there.
horovod-wheel:
	if [ -d $(HOROVOD_BUILD)/wheel ]; then \
		echo "horovod: reusing the wheel in $(HOROVOD_BUILD)"; \
	else \
		rm -rf $(HOROVOD_BUILD) && \
		$(PIP) download --quiet --no-deps --no-binary horovod -d $(HOROVOD_BUILD) \
			horovod==$(HOROVOD_VERSION) && \
		tar -xzf $(HOROVOD_BUILD)/horovod-$(HOROVOD_VERSION).tar.gz -C $(HOROVOD_BUILD) && \
		for p in $(HOROVOD_PATCHES); do git -C $(HOROVOD_SRC) apply $(CURDIR)/$$p || exit 1; done && \
		$(if $(filter gpu,$(LINE)),mkdir -p $(HOROVOD_BUILD)/links && \
			ln -sf $(CUDA_ROOT)/nccl/lib/libnccl.so.2 $(HOROVOD_BUILD)/links/libnccl.so && \
			ln -sf $(CUDA_ROOT)/cu13/lib/libcudart.so.13 $(HOROVOD_BUILD)/links/libcudart.so &&) \
		$(if $(filter gpu-tf,$(LINE)),patches/gpu-tf/cuda12-home.sh $(HOROVOD_BUILD)/cuda $(PY) && \
			mkdir -p $(HOROVOD_BUILD)/links && \
			ln -sf $(SITE)/nvidia/nccl/lib/libnccl.so.2 $(HOROVOD_BUILD)/links/libnccl.so &&) \
		$(HOROVOD_FLAGS) $(HOROVOD_BUILD_ENV) MAKEFLAGS=-j$(shell nproc) $(PIP) wheel --quiet --no-build-isolation \
			--no-cache-dir --no-deps -w $(HOROVOD_BUILD)/wheel.partial $(HOROVOD_SRC) && \
		mv $(HOROVOD_BUILD)/wheel.partial $(HOROVOD_BUILD)/wheel; \
	fi

# A wheelhouse of the line (docs/deploying.rst): the patched horovod, labelled with a local
# version (0.28.1+hr<build>.tf221.torch213, see horovod_ray/stack/wheelhouse.py), this
# package, and every package they need at the line's pins, so that
# `pip install --no-index --find-links WHEELHOUSE 'horovod-ray[$(WHEEL_EXTRAS)]'` installs a
# node without a checkout or a compiler.
# WHEELHOUSE is emptied first; only wheels go in (no source archive to build on a node).
WHEELHOUSE ?= build/wheelhouse-$(LINE)
wheels: install
	rm -rf $(WHEELHOUSE) && mkdir -p $(WHEELHOUSE)
	mkdir -p $(HOROVOD_CACHE)
	flock $(HOROVOD_BUILD).lock $(MAKE) --no-print-directory TF=$(TF) GPU=$(GPU) horovod-wheel
	$(PY) -m horovod_ray.stack.wheelhouse retag $(HOROVOD_BUILD)/wheel/horovod-$(HOROVOD_VERSION)-*.whl \
		--key $(HOROVOD_KEY) --out $(WHEELHOUSE)
	rm -rf build/lib build/bdist.*  # setuptools' leftovers would go into the wheel
	$(PIP) wheel --quiet --no-deps --no-build-isolation -w $(WHEELHOUSE) .
	$(PIP) download --quiet --only-binary=:all: -c $(CONSTRAINTS) --find-links $(WHEELHOUSE) \
		-d $(WHEELHOUSE) "$$(ls $(WHEELHOUSE)/horovod_ray-*.whl)[$(WHEEL_EXTRAS)]"
	$(PY) -m horovod_ray.stack.wheelhouse pins $(WHEELHOUSE)  # last: the wheelhouse is whole
	@echo "wheelhouse: $(WHEELHOUSE) ($$(ls $(WHEELHOUSE)/*.whl | wc -l) wheels)"

# The container image (docs/deploying.rst): Ray's own image with the line's wheelhouse
# installed at its pins (deploy/Dockerfile), built by podman or docker, whichever is here
# first (CONTAINER=...), from the wheelhouse that is there when it is whole (`make wheels`
# makes it, and remakes it after a change to what goes in). CONTAINER_FLAGS: more flags
# for the build.
VERSION := $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' horovod_ray/__version__.py)
RAY_VERSION := $(shell sed -n 's/^ray==//p' $(CONSTRAINTS))
IMAGE ?= horovod-ray:$(VERSION)-$(LINE)
BASE_IMAGE ?= rayproject/ray:$(RAY_VERSION)-py311$(if $(filter 0,$(GPU)),,-gpu)
CONTAINER ?= $(firstword $(shell command -v podman docker))
CONTAINER_FLAGS ?=
image:
	test -f $(WHEELHOUSE)/constraints.txt || $(MAKE) --no-print-directory TF=$(TF) GPU=$(GPU) wheels
	$(if $(CONTAINER),,$(error no container builder: install podman or docker, or give CONTAINER=))
	$(CONTAINER) build $(CONTAINER_FLAGS) -f deploy/Dockerfile --build-arg BASE_IMAGE=$(BASE_IMAGE) \
		--build-arg EXTRAS=$(WHEEL_EXTRAS) --build-arg CHECK_FLAGS="$(CHECK_FLAGS)" \
		-t $(IMAGE) $(WHEELHOUSE)

print-image:
	@echo IMAGE=$(IMAGE) BASE_IMAGE=$(BASE_IMAGE) WHEELHOUSE=$(WHEELHOUSE)

$(STAMP): $(HOROVOD_STAMP) setup.py
	$(PIP) install --quiet -c $(CONSTRAINTS) -e '.[$(TF_EXTRA),tune,test,examples,bench]'
	touch $(STAMP)

# The documentation, then the whole suite on the chosen line; on the default line, then
# the 2023 line's subset.
ifneq ($(GPU),0)
test: test-gpu-line
else ifeq ($(TF),2.21)
test: docs test-suite test-2023
else
test: test-suite
endif

# The benchmark runner's smoke passes (test/test_bench.py, 11 minutes on 2 slow cores) are
# not in make test, whose time on CI they would take a fifth of: run make test-bench after
# changing bench/. Pure logic first (no Ray, seconds), then everything on real Ray: a test
# module says which it is (``pytestmark = pytest.mark.unit``; test/conftest.py fails a unit
# test that starts Ray).
test-suite: install prometheus
	$(PY) -m pytest $(PYTEST_ARGS) -m unit test
	$(PY) -m pytest $(PYTEST_ARGS) -m "not unit" --ignore=test/test_bench.py \
		--ignore=test/deploy/test_wheelhouse.py --ignore=test/deploy/test_image.py test

# The inner loop while working on one part (docs/testing.rst): the unit tests, then the
# tests on Ray of the module or folder T (make test-quick T=test/job/test_elastic.py).
T ?= test/test_executor.py
test-quick: install
	$(PY) -m pytest $(PYTEST_ARGS) -q -m unit test
	$(PY) -m pytest $(PYTEST_ARGS) -m "not unit" $(T)

# The 2023 line (TensorFlow 2.15, Keras 2) in its own environment: the core logic (unit),
# horovod's Keras API on real 2-rank jobs and an elastic Keras run that loses a node
# (marked line_2023).
test-2023:
	$(MAKE) TF=2.15 GPU=0 test-subset

test-subset: install
	$(PY) -m pytest $(PYTEST_ARGS) -m "unit or line_2023" --ignore=test/test_bench.py test

# A GPU line on a machine without a GPU (make test GPU=1 or GPU=tf, a minute or two after
# its install): its build's NCCL and CUDA, its framework's horovod tests on CPU tensors
# (test_torch.py; test_keras.py, marked line_2023), and the device check's script on CPU
# ranks. Not in `make test` (CI), whose time it does not fit.
GPU_LINE_TESTS := $(if $(filter tf,$(GPU)),test/test_keras.py,test/test_torch.py)
test-gpu-line: install
	$(PY) -m pytest $(PYTEST_ARGS) -m "gpu_line or line_2023" test/stack $(GPU_LINE_TESTS)

# The device check, on a machine with NVIDIA GPUs (docs/gpus.rst): each GPU line in turn,
# built first where it is not built yet, then checked; one line's failure (its build or its
# check) does not keep the other from its check, and fails the target.
test-gpu:
	status=0; \
	{ $(MAKE) GPU=1 install && .venv-gpu/bin/python -m bench.tools.gpu_check --framework torch; } \
		|| status=$$?; \
	{ $(MAKE) GPU=tf install && \
		.venv-gpu-tf/bin/python -m bench.tools.gpu_check --framework tensorflow; } || status=$$?; \
	exit $$status

test-bench: install
	$(PY) -m pytest $(PYTEST_ARGS) test/test_bench.py

# The wheelhouse on machines that never saw the checkout (test/deploy, minutes: a fresh
# virtualenv from the wheelhouse alone, then a Ray cluster of simulated hosts running from
# it). Not in `make test`, whose time on CI it does not fit: run it after changing what goes
# into the wheelhouse (setup.py, the constraints, the patches).
ifeq ($(LINE),tf2.21)
test-deploy: wheels
	HOROVOD_RAY_WHEELHOUSE=$(abspath $(WHEELHOUSE)) $(PY) -m pytest $(PYTEST_ARGS) \
		test/deploy/test_wheelhouse.py
else
test-deploy:
	$(error test-deploy checks the default line's wheelhouse (its TensorFlow and PyTorch jobs): leave TF and GPU out)
endif

# The image built and run here (test/deploy/test_image.py, minutes): `make image` on a
# stand-in for Ray's image made from Debian's packages (no registry is reachable to pull
# Ray's), then the KubeRay RayJob's cluster and entrypoint in a container. Needs root, and
# installs Debian's podman, runc and debootstrap when they are missing. Not in `make test`.
ifeq ($(LINE),tf2.21)
test-image: wheels
	command -v podman && command -v runc && command -v debootstrap || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman runc debootstrap >/dev/null; }
	HOROVOD_RAY_WHEELHOUSE=$(abspath $(WHEELHOUSE)) $(PY) -m pytest $(PYTEST_ARGS) \
		test/deploy/test_image.py
else
test-image:
	$(error test-image runs the default line's image (the RayJob's PyTorch job): leave TF and GPU out)
endif

# Debian's Prometheus, which test/observe starts with a config of its own to scrape a real
# job (docs/observability.rst); never started as a service here.
prometheus:
	command -v prometheus >/dev/null || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq prometheus >/dev/null; }

demo: install
	$(PY) examples/tensorflow2_digits.py --num-workers 2

# The Sphinx site (docs/) into build/docs/html: any warning fails it (a broken reference,
# a docstring that does not render), then every link between its pages is checked.
# Built with the default line's environment, where ``make install`` puts Sphinx.
docs:
	$(MAKE) TF=2.21 GPU=0 .venv/.installed
	rm -rf build/docs
	.venv/bin/python -m sphinx -W --keep-going -q -b html docs build/docs/html
	.venv/bin/python docs/check_links.py build/docs/html

lint: install
	$(PY) -m ruff check horovod_ray test examples docs
	$(PY) -m ruff format --check horovod_ray test examples docs

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

# B1, B2 and the demo's epoch time on both TensorFlow lines, alternating (docs/benchmarks.rst).
bench-lines: native
	$(MAKE) TF=2.21 GPU=0 install
	$(MAKE) TF=2.15 GPU=0 install
	.venv/bin/python -m bench.harness.lines

clean:
	rm -rf .venv .venv-tf2.15 .venv-gpu .venv-gpu-tf build *.egg-info .pytest_cache

# The horovod builds that `make install` keeps for reuse (see HOROVOD_CACHE).
clean-cache:
	rm -rf $(HOROVOD_CACHE)/horovod-$(HOROVOD_VERSION)-*
