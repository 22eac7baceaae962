# zps — the only build entry point.  See README.md and docs/build.md.
#
#   make            deps check + build build/bin/zps-*
#   make test       deps + build + every test (Criterion), ends with the synthesis line
#   make test-unit  the tests that start no extra processes (used for sanitizer runs)
#   make soak       the fault suite at length (it_soak with ZPS_SOAK=long; docs/training.md)
#   make bench      benchmarks; JSON under build/bench/
#   make bench-peers  TensorFlow into build/peers-venv (once), then zps against TF and PyTorch
#   make demo       the main job (see README.md)
#   make fuzz       libFuzzer targets under tests/fuzz (clang)
#   make tsan       ThreadSanitizer over real PS and all-reduce fleets (scripts/tsan-fleets.sh)
#   make gpu-bundle build here and pack bin, libs, tests and data for a GPU machine (.gpu/)
#   make test-gpu   on a GPU machine: the GPU suite from that bundle (docs/gpu.md)
#   make bench-gpu  on a GPU machine: the GPU benchmarks from that bundle (docs/gpu.md)
#   make SAN=address|undefined|address+undefined ...   sanitizer build in build-SAN/
#   make CUDA=0     never build the CUDA library (default CUDA=auto)
#   make install    libzps.so, include/zps, zps.pc, zps-server, zps-ctl into PREFIX (DESTDIR)
#   make install-files  the same copies without building first (what tests/test_capi.c runs)
#   make clean

SHELL := /bin/bash
CUDA ?= auto
SAN ?=
ifeq ($(SAN),)
B := build
else
B := build-$(subst +,-,$(SAN))
endif
# SAN=address+undefined: both sanitizers in one build (build-address-undefined/)
comma := ,
SAN_FLAG := $(subst +,$(comma),$(SAN))

CC ?= gcc
PKGS := libzmq libprotobuf-c lmdb dnnl libturbojpeg libpng libsodium
CFLAGS_BASE := -std=c11 -D_GNU_SOURCE -O2 -g -Wall -Wextra -Wstrict-prototypes -Werror -Wno-format-truncation \
	-fno-omit-frame-pointer -pthread -I. -I$(B)/gen
CFLAGS_GEN := -std=c11 -D_GNU_SOURCE -O2 -g -fPIC -pthread -I$(B)/gen
ifneq ($(SAN),)
CFLAGS_BASE += -fsanitize=$(SAN_FLAG) -fno-sanitize-recover=all
CFLAGS_GEN += -fsanitize=$(SAN_FLAG)
LDSAN := -fsanitize=$(SAN_FLAG)
endif
CFLAGS_BASE += $(EXTRA_CFLAGS)
LDLIBS := -lzmq -lprotobuf-c -llmdb -ldnnl -lturbojpeg -lpng -lsodium -lz -ldl -lrt -lm -pthread

# ---- optional CUDA part: a shared library loaded at run time (kernels/device.c) ----
NVCC := $(shell command -v nvcc 2>/dev/null || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
CUDA_HOME := $(if $(NVCC),$(patsubst %/bin/nvcc,%,$(NVCC)),)
CUDNN_H := $(firstword $(wildcard $(CUDA_HOME)/include/cudnn.h /usr/include/cudnn.h /usr/local/include/cudnn.h))
ifeq ($(CUDA),0)
HAVE_CUDA := 0
else ifneq ($(and $(NVCC),$(CUDNN_H)),)
HAVE_CUDA := 1
else
HAVE_CUDA := 0
endif
NVCCFLAGS := -O2 -std=c++17 -Xcompiler -fPIC,-Wall -I. --threads 2 \
	-gencode arch=compute_80,code=sm_80 -gencode arch=compute_90,code=sm_90
# NCCL is not linked: nccl_allreduce.cu loads it on first use (a GPU without it still trains)
CUDA_LIBS := -lcudnn -lcublas -ldl
CU_SRC := $(wildcard kernels/cuda/*.cu)
CUDA_SO := $(B)/lib/libzps_cuda.so

# ---- sources ----
PROTOS := $(wildcard proto/*.proto)
GEN_C := $(patsubst proto/%.proto,$(B)/gen/%.pb-c.c,$(PROTOS))
GEN_H := $(GEN_C:.c=.h)
LIB_DIRS := common kernels kernels/ref kernels/cpu ps trainer trainer/nn trainer/models trainer/detect datasets
LIB_SRC := $(filter-out %_main.c,$(foreach d,$(LIB_DIRS),$(wildcard $(d)/*.c)))
LIB_OBJ := $(patsubst %.c,$(B)/obj/%.o,$(LIB_SRC)) $(patsubst $(B)/gen/%.c,$(B)/obj/gen/%.o,$(GEN_C))
LIB := $(B)/lib/libzps.a

# binaries: <dir>/<name>_main.c -> build/bin/zps-<name>; bench/*.c -> zps-bench
MAINS := $(wildcard ps/server_main.c ps/ctl_main.c trainer/trainer_main.c datasets/data_main.c)
BIN_NAMES := $(patsubst %_main.c,zps-%,$(notdir $(MAINS)))
BINS := $(addprefix $(B)/bin/,$(BIN_NAMES) zps-bench)
BENCH_SRC := $(wildcard bench/*.c)
BENCH_OBJ := $(patsubst %.c,$(B)/obj/%.o,$(BENCH_SRC))

TEST_SRC := $(wildcard tests/test_*.c)
TEST_OBJ := $(patsubst %.c,$(B)/obj/%.o,$(TEST_SRC))
TEST_BIN := $(B)/tests/zps-tests
# Criterion: each test in its own process; tests carry their own .timeout.
TEST_JOBS ?= 2
TEST_ARGS ?=
# Builds use every core unless the caller chose (make -jN, or -j1 to read errors in order):
# a fresh build on 2 cores took 86 s serially, 43 s in parallel (2026-12-07).
ifeq ($(filter -j%,$(MAKEFLAGS))$(filter j%,$(firstword $(MAKEFLAGS))),)
MAKEFLAGS += -j$(shell nproc 2>/dev/null || echo 2)
endif

.PHONY: all deps test test-unit soak bench bench-peers demo fuzz tsan clean parts gpu-bundle test-gpu bench-gpu py-venv
.DEFAULT_GOAL := all
.DELETE_ON_ERROR:

all: $(B)/.deps-ok parts $(BINS) $(if $(filter 1,$(HAVE_CUDA)),$(CUDA_SO))

parts:
	@printf 'zps build (%s):\n' "$(B)"; \
	 printf '  %s CUDA library (nvcc%s, cuDNN%s)%s\n' \
	   "$(if $(filter 1,$(HAVE_CUDA)),✓,✗)" \
	   "$(if $(NVCC),: $(NVCC), not found)" "$(if $(CUDNN_H),: $(CUDNN_H), not found)" \
	   "$(if $(filter 0,$(CUDA)), — disabled by CUDA=0,)"; \
	 printf '  %s sanitizer %s\n' "$(if $(SAN),✓,✗)" "$(if $(SAN),$(SAN),(none; make SAN=address|undefined|address+undefined))"; \
	 printf '  %s python3-torch reference tests\n' "$$(/usr/bin/python3 -c 'import torch' 2>/dev/null && echo ✓ || echo ✗)"

deps: $(B)/.deps-ok
$(B)/.deps-ok: scripts/deps.sh
	@bash scripts/deps.sh
	@mkdir -p $(@D) && touch $@

# ---- protobuf-c generation (never committed) ----
$(B)/gen/%.pb-c.c $(B)/gen/%.pb-c.h: proto/%.proto | $(B)/.deps-ok
	@mkdir -p $(@D)
	protoc-c --proto_path=proto --c_out=$(B)/gen $<

$(B)/obj/gen/%.o: $(B)/gen/%.c
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_GEN) -c $< -o $@

# Objects depend on the flags they were built with (CUDA=0/auto, SAN, EXTRA_CFLAGS).
FLAGS_LINE := $(CC) $(CFLAGS_BASE) -DZPS_HAVE_CUDA=$(HAVE_CUDA)
$(B)/.flags: FORCE
	@mkdir -p $(@D); echo '$(FLAGS_LINE)' | cmp -s - $@ || echo '$(FLAGS_LINE)' > $@
.PHONY: FORCE
FORCE:

# The git commit goes into $(B)/gen/zps_git.h, rewritten only when it changes.
GIT_HASH := $(shell git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)$(shell \
	git diff --quiet HEAD -- 2>/dev/null || { git rev-parse HEAD >/dev/null 2>&1 && echo -dirty; })
$(B)/gen/zps_git.h: FORCE
	@mkdir -p $(@D); l='#define ZPS_GIT_HASH "$(GIT_HASH)"'; \
	 echo "$$l" | cmp -s - $@ || echo "$$l" > $@
$(B)/obj/common/version.o: $(B)/gen/zps_git.h

$(B)/obj/%.o: %.c $(GEN_H) $(B)/.flags | $(B)/.deps-ok
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_BASE) -DZPS_HAVE_CUDA=$(HAVE_CUDA) -MMD -MP -c $< -o $@

# ps/: the server's per-element loops (NaN/Inf check, optimizers, sync sums) are memory-bound
# streams that -O2 leaves scalar; -O3 vectorises them (elementwise, so results are unchanged).
$(B)/obj/ps/%.o: CFLAGS_BASE += -O3
# The optimizers' loop also -fno-math-errno: sqrtf that may set errno is a call GCC cannot
# vectorise, which left rmsprop, adam and adagrad scalar (the square root is IEEE's correctly
# rounded one either way: the same bits).
$(B)/obj/common/optim_apply.o: CFLAGS_BASE += -O3 -fno-math-errno
# The cpu back-end's NCHW batchnorm loops: the same (-O2's cheap cost model leaves them scalar).
$(B)/obj/kernels/cpu/bn_plain.o: CFLAGS_BASE += -O3

$(LIB): $(LIB_OBJ)
	@mkdir -p $(@D)
	rm -f $@ && ar rcs $@ $^

define BIN_RULE
$(B)/bin/$(patsubst %_main.c,zps-%,$(notdir $(1))): $(B)/obj/$(1:.c=.o) $(LIB)
	@mkdir -p $$(@D)
	$$(CC) $$(LDSAN) -o $$@ $$< $$(LIB) $$(LDLIBS)
endef
$(foreach m,$(MAINS),$(eval $(call BIN_RULE,$(m))))

$(B)/bin/zps-bench: $(BENCH_OBJ) $(LIB)
	@mkdir -p $(@D)
	$(CC) $(LDSAN) -o $@ $(BENCH_OBJ) $(LIB) $(LDLIBS)

$(CUDA_SO): $(CU_SRC) $(wildcard kernels/cuda/*.h kernels/*.h)
	@mkdir -p $(@D)
	$(NVCC) $(NVCCFLAGS) -shared -o $@ $(CU_SRC) -L$(CUDA_HOME)/lib64 $(CUDA_LIBS)

$(TEST_BIN): $(TEST_OBJ) $(LIB)
	@mkdir -p $(@D)
	$(CC) $(LDSAN) -o $@ $(TEST_OBJ) $(LIB) $(LDLIBS) -lcriterion

# ---- the shared library and `make install` (docs/ps.md "C API") ----
# libzps.so is the client side only (api/zps.c over ps/client.h), built from its own -fPIC
# objects under $(B)/pic with hidden visibility; api/libzps.map exports the zps_* API of
# include/zps/zps.h and nothing else. Soname policy: libzps.so.MAJOR -> libzps.so.VERSION
# (common/version.h); MAJOR changes when a signature or a struct layout of zps.h changes.
PREFIX ?= /usr/local
DESTDIR ?=
LIBDIR ?= $(PREFIX)/lib
INCLUDEDIR ?= $(PREFIX)/include
ZPS_VER := $(shell sed -n 's/^\#define ZPS_VERSION "\(.*\)"/\1/p' common/version.h)
SO_MAJOR := $(firstword $(subst ., ,$(ZPS_VER)))
SO_FILE := libzps.so.$(ZPS_VER)
SO_NAME := libzps.so.$(SO_MAJOR)
SO := $(B)/lib/$(SO_FILE)
SO_SRC := api/zps.c $(wildcard ps/client*.c) ps/plan.c ps/optim.c ps/dtype.c ps/curve.c ps/shm.c \
	common/status.c common/log.c common/mem.c common/clock.c common/net.c \
	common/version.c common/fileio.c common/optim_apply.c
SO_OBJ := $(patsubst %.c,$(B)/pic/%.o,$(SO_SRC)) $(patsubst $(B)/gen/%.c,$(B)/obj/gen/%.o,$(GEN_C))
SO_LIBS := -lzmq -lprotobuf-c -lm -pthread
all: $(B)/lib/libzps.so
$(TEST_BIN): $(B)/lib/libzps.so
$(B)/pic/%.o: %.c $(GEN_H) $(B)/.flags | $(B)/.deps-ok
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_BASE) -fPIC $(PIC_VIS) -Iinclude -DZPS_HAVE_CUDA=$(HAVE_CUDA) -MMD -MP -c $< -o $@
$(B)/pic/ps/%.o: CFLAGS_BASE += -O3
$(B)/pic/common/optim_apply.o: CFLAGS_BASE += -O3 -fno-math-errno
# zps/status.h (= common/status.h) is public: its two functions are exported too
PIC_VIS := -fvisibility=hidden
$(B)/pic/common/status.o: PIC_VIS :=
$(B)/pic/common/version.o: $(B)/gen/zps_git.h
$(SO): $(SO_OBJ) api/libzps.map
	@mkdir -p $(@D)
	$(CC) $(LDSAN) -shared -Wl,-soname,$(SO_NAME) -Wl,--version-script=api/libzps.map \
	  -Wl,--no-undefined -o $@ $(SO_OBJ) $(SO_LIBS)
$(B)/lib/libzps.so: $(SO)
	ln -sf $(SO_FILE) $(B)/lib/$(SO_NAME) && ln -sf $(SO_NAME) $@
install: all
	@$(MAKE) -s install-files
# what install copies, without building first: tests/test_capi.c stages it while other tests
# run the binaries (make test has built them), so a tree edited during the run cannot relink
# a binary under a running test
install-files:
	install -d $(DESTDIR)$(LIBDIR)/pkgconfig $(DESTDIR)$(INCLUDEDIR)/zps $(DESTDIR)$(PREFIX)/bin
	install -m 755 $(SO) $(DESTDIR)$(LIBDIR)/$(SO_FILE)
	ln -sf $(SO_FILE) $(DESTDIR)$(LIBDIR)/$(SO_NAME)
	ln -sf $(SO_NAME) $(DESTDIR)$(LIBDIR)/libzps.so
	install -m 644 include/zps/zps.h include/zps/status.h $(DESTDIR)$(INCLUDEDIR)/zps/
	sed -e 's|@PREFIX@|$(PREFIX)|; s|@LIBDIR@|$(LIBDIR)|; s|@INCLUDEDIR@|$(INCLUDEDIR)|' \
	  -e 's|@VERSION@|$(ZPS_VER)|' api/zps.pc.in > $(DESTDIR)$(LIBDIR)/pkgconfig/zps.pc
	install -m 755 $(B)/bin/zps-server $(B)/bin/zps-ctl $(DESTDIR)$(PREFIX)/bin/
.PHONY: install install-files
-include $(shell find $(B)/pic -name '*.d' 2>/dev/null)

# ---- running ----
# ZPS_BIN tells multi-process tests where the binaries are.
# ZPS_PYTHON: the Python with the packages of scripts/py-venv (tests that read safetensors
# and TensorBoard files skip, saying why, when it could not be made).
PY_VENV := $(B)/py-venv
test: all $(TEST_BIN)
	@bash scripts/py-venv $(PY_VENV) || true
	@echo "running $(TEST_BIN) ($(TEST_JOBS) jobs)"
	ZPS_BIN=$(abspath $(B)/bin) ZPS_ROOT=$(CURDIR) ZPS_PYTHON=$(abspath $(PY_VENV))/bin/python \
	  bash scripts/run-tests.sh $(B)/test.log $(TEST_BIN) -j$(TEST_JOBS) $(TEST_ARGS)

py-venv:
	bash scripts/py-venv $(PY_VENV)

# unit tests: suites whose name does not start with it_ (integration, multi-process)
test-unit: all $(TEST_BIN)
	ZPS_BIN=$(abspath $(B)/bin) ZPS_ROOT=$(CURDIR) bash scripts/run-tests.sh $(B)/test-unit.log \
	  $(TEST_BIN) -j$(TEST_JOBS) --filter='!(it_*)/*' $(TEST_ARGS)

# the fault suite (tests/test_soak.c): make test runs it short; this runs longer fleets,
# several rounds each, every mode in the partition case (as root: it makes namespaces)
soak: all $(TEST_BIN)
	ZPS_SOAK=long ZPS_BIN=$(abspath $(B)/bin) ZPS_ROOT=$(CURDIR) $(TEST_BIN) -j1 --filter='it_soak/*' $(TEST_ARGS)

bench: all
	@mkdir -p $(B)/bench
	ZPS_BIN=$(abspath $(B)/bin) ZPS_ROOT=$(CURDIR) bash scripts/bench.sh $(B)

# the peer benchmark alone (scripts/bench.d/tf-peers), after installing TensorFlow into
# $(B)/peers-venv when it is not there; `make bench` runs it too once the venv exists
bench-peers: all
	@bash scripts/bench.d/peers-venv $(B)/peers-venv
	@mkdir -p $(B)/bench
	ZPS_BIN=$(abspath $(B)/bin) ZPS_ROOT=$(CURDIR) bash scripts/bench.d/tf-peers $(B)

demo: all
	ZPS_BIN=$(abspath $(B)/bin) ZPS_ROOT=$(CURDIR) bash scripts/demo.sh $(B)

# The GPU suite runs on a machine with none of our Debian libraries and no package registry:
# gpu-bundle packs everything here, test-gpu (no build, no deps check) runs it there.
GPU_BUNDLE ?= .gpu
gpu-bundle: $(B)/.deps-ok
	bash scripts/gpu-bundle $(GPU_BUNDLE)

test-gpu:
	bash scripts/test-gpu.sh $(GPU_BUNDLE)

bench-gpu:
	bash scripts/bench-gpu.sh $(GPU_BUNDLE)

FUZZ_SRC := $(wildcard tests/fuzz/fuzz_*.c)
# ThreadSanitizer over real fleets (scripts/tsan-fleets.sh): Criterion's runner does not
# start under TSan, so the threads of the servers, trainers and all-reduce are checked here.
tsan: all
	$(MAKE) SAN=thread CUDA=0 build-thread/bin/zps-server build-thread/bin/zps-trainer
	bash scripts/tsan-fleets.sh build-thread/bin "$$(bash scripts/fashion-data.sh $(B)/bin)"

fuzz: $(B)/.deps-ok $(GEN_H) $(B)/gen/zps_git.h
	@mkdir -p build-fuzz
	@for f in $(FUZZ_SRC); do n=$$(basename $$f .c); \
	  echo "building build-fuzz/$$n"; \
	  clang -std=c11 -D_GNU_SOURCE -g -O1 -fsanitize=fuzzer,address,undefined -I. -I$(B)/gen \
	    -DZPS_HAVE_CUDA=0 $$f $(filter-out %_main.c,$(LIB_SRC)) $(GEN_C) -o build-fuzz/$$n $(LDLIBS) || exit 1; \
	done
	@bash scripts/fuzz.sh build-fuzz

clean:
	rm -rf build build-address build-undefined build-address-undefined build-thread build-fuzz

-include $(shell find $(B)/obj -name '*.d' 2>/dev/null)
