# EPX - expert-parallel exchange for MoE. GNU make.
#
#   make            build/lib/libepx.so and libepx.a (sm_90)
#   make test       build and run every test (host tests always; GPU tests on visible GPUs),
#                   then the Python package's CPU tests (make test-python: python/tests, pytest)
#   make bench      build and run the benchmark on every visible GPU (BENCH_ARGS=... to pass flags)
#   make soak-bin   build/bin/epx_soak, the long mixed run (docs/testing.md, "Soak")
#   make experts-bench-bin  build/bin/epx_experts_bench, the experts' FFN on one GPU (docs/bench.md)
#   make layout-bench-bin  build/bin/epx_layout_bench, the layout kernel alone on one GPU
#   make moe-bench-bin  build/bin/epx_moe_bench, the MoE layer at decode vs its parts (docs/bench.md)
#   make moe-prefill-bench-bin  build/bin/epx_moe_prefill_bench, the MoE layer at prefill vs its
#                   parts and plain cuBLAS (docs/moe.md, "MoE layer at prefill")
#                   (docs/bench.md)
#   make moe-gemm-bench-bin  build/bin/epx_moe_gemm_bench, the prefill layer's grouped FP8 GEMM
#                   alone on one GPU, in time and SM cycles (docs/bench.md)
#   make format     clang-format the sources in place (make format-check: only check)
#   make install    PREFIX=/usr/local: header, libraries, pkg-config file
# Knobs: CUDA_HOME, NCCL_HOME, PYTHON (the one whose nvidia-nccl-cu13 wheel to use), NVCC_GENCODE
# (and NVCC_GENCODE_WGMMA for the wgmma kernels),
# DEBUG=1, ASAN=1 (host code only), TRACE=0 (compile in-kernel tracing out; build it in its own
# BUILD=dir, docs/profiling.md).
# Every object depends on the headers it includes (-MMD -MP, build/obj/**/*.d), on
# mk/toolchain.mk and on the toolchain stamp (below). Only tests/ and bench/ objects see tests/
# (-Itests); the library never does.

include mk/toolchain.mk

PREFIX ?= /usr/local
BUILD ?= build
NVCC_GENCODE ?= -gencode arch=compute_90,code=sm_90
# Kernels that use Hopper's wgmma (the FP8 experts' GEMMs) need the arch-specific target.
NVCC_GENCODE_WGMMA ?= -gencode arch=compute_90a,code=sm_90a

OPT := -O2
NVCC_OPT := -O2
ifeq ($(DEBUG),1)
  OPT := -O0 -g3 -DEPX_DEBUG_BUILD=1
  NVCC_OPT := -O0 -g -DEPX_DEBUG_BUILD=1 # nvcc takes no -g3
endif
SAN :=
ifeq ($(ASAN),1)
  SAN := -fsanitize=address,undefined -fno-omit-frame-pointer
endif

TRACE_FLAGS :=
ifeq ($(TRACE),0)
  TRACE_FLAGS := -DEPX_TRACE_COMPILED=0
endif

# The CUDA and NCCL the objects were compiled against; the stamp is rewritten only when they
# change (e.g. `pip install` running make with another environment's nvidia-nccl-cu13 wheel),
# and then every object is rebuilt against the new headers.
TOOLCHAIN_STAMP := $(BUILD)/toolchain.stamp
TOOLCHAIN_ID := CUDA_HOME=$(CUDA_HOME) NCCL_HOME=$(NCCL_HOME)
$(shell mkdir -p $(BUILD) && (echo '$(TOOLCHAIN_ID)' | cmp -s - $(TOOLCHAIN_STAMP) || \
  echo '$(TOOLCHAIN_ID)' > $(TOOLCHAIN_STAMP)))

INCLUDES := -Iinclude -Isrc/include -Isrc -I$(NCCL_INCDIR) -I$(CUDA_HOME)/include
CC ?= gcc
CXX ?= g++
CFLAGS := -std=c11 -D_GNU_SOURCE $(OPT) -g -Wall -Wextra -Werror=implicit-function-declaration \
          -fPIC -fvisibility=hidden $(SAN) $(TRACE_FLAGS) $(INCLUDES)
NVCCFLAGS := -std=c++17 $(NVCC_OPT) -lineinfo --expt-relaxed-constexpr \
             -Xcompiler -fPIC,-fvisibility=hidden,-Wall $(TRACE_FLAGS) $(INCLUDES)
LDLIBS := -L$(CUDA_LIBDIR) -lcudart -L$(NCCL_LIBDIR) $(NCCL_LINK) \
          -Wl,-rpath,$(NCCL_LIBDIR) -Wl,-rpath,$(CUDA_LIBDIR) -lpthread -lm -ldl

LIB_C  := $(wildcard src/*.c src/*/*.c)
LIB_CU := $(wildcard src/*/*.cu)
LIB_OBJ := $(patsubst %.c,$(BUILD)/obj/%.o,$(LIB_C)) $(patsubst %.cu,$(BUILD)/obj/%.o,$(LIB_CU))

# tests/soak/plan.c: the soak's plan, pure CPU, checked by a host test (tests/host/).
# bench/'s kernel-time module (KTIME_C: CUPTI loaded at run time, the collector, its pure
# aggregation) is tested by a host test and a one-GPU test, so epx_test links it too.
KTIME_C := bench/cupti_lib.c bench/ktime.c bench/ktime_stats.c
TEST_C  := $(wildcard tests/common/*.c tests/ref/*.c tests/host/*.c tests/gpu/*.c) tests/soak/plan.c \
           $(KTIME_C)
TEST_CU := $(wildcard tests/gpu/*.cu)
TEST_OBJ := $(patsubst %.c,$(BUILD)/obj/%.o,$(TEST_C)) $(patsubst %.cu,$(BUILD)/obj/%.o,$(TEST_CU))

# The benchmark shares the rank-process plumbing of the test runner (tests/common/ranks.c).
BENCH_C  := $(wildcard bench/*.c) tests/common/ranks.c
BENCH_CU := $(wildcard bench/*.cu)
BENCH_OBJ := $(patsubst %.c,$(BUILD)/obj/%.o,$(BENCH_C)) $(patsubst %.cu,$(BUILD)/obj/%.o,$(BENCH_CU))

# The soak (docs/testing.md, "Soak"): its own files and the test harness it reuses (rank
# processes, reference, worlds, checks, test kernels). Built by `make soak-bin`, run by hand or
# by scripts/gpu-check.sh (SOAK_ITERS=N); not part of `make test`.
SOAK_C := $(wildcard tests/soak/*.c)
SOAK_OBJ := $(patsubst %.c,$(BUILD)/obj/%.o,$(SOAK_C))
SOAK_LINK := $(SOAK_OBJ) $(addprefix $(BUILD)/obj/tests/,common/ranks.o ref/epx_ref.o \
             gpu/world.o gpu/normal_checks.o gpu/ll_checks.o gpu/test_kernels.o)

# epx_experts_bench (`make experts-bench-bin`): the experts' FFN on one GPU (bench/experts/).
EXPERTS_BENCH_C := $(wildcard bench/experts/*.c)
EXPERTS_BENCH_CU := $(wildcard bench/experts/*.cu)
EXPERTS_BENCH_OBJ := $(patsubst %.c,$(BUILD)/obj/%.o,$(EXPERTS_BENCH_C)) \
                     $(patsubst %.cu,$(BUILD)/obj/%.o,$(EXPERTS_BENCH_CU))
# The layout kernel alone on one GPU (docs/bench.md): its own file, a group-free kernel context,
# the reference and the spin kernel of the tests. Built by `make layout-bench-bin`; not part of
# `make test` or `make bench`.
LAYOUT_BENCH_C := $(wildcard bench/layout/*.c)
LAYOUT_BENCH_OBJ := $(patsubst %.c,$(BUILD)/obj/%.o,$(LAYOUT_BENCH_C))
LAYOUT_BENCH_LINK := $(LAYOUT_BENCH_OBJ) $(addprefix $(BUILD)/obj/tests/,ref/epx_ref.o \
                     gpu/one_gpu_ctx.o gpu/test_kernels.o) $(BUILD)/obj/bench/check.o

# epx_moe_bench (`make moe-bench-bin`): the MoE layer at decode against its parts, every visible
# GPU (bench/moe/); the rank processes of tests/common/ranks.c, the fills of bench/experts/.
MOE_BENCH_C := $(wildcard bench/moe/*.c)
MOE_BENCH_OBJ := $(patsubst %.c,$(BUILD)/obj/%.o,$(MOE_BENCH_C))
MOE_BENCH_LINK := $(MOE_BENCH_OBJ) $(BUILD)/obj/tests/common/ranks.o \
                  $(BUILD)/obj/bench/experts/bench_kernels.o $(BUILD)/obj/bench/check.o

# epx_moe_prefill_bench (`make moe-prefill-bench-bin`): the MoE layer at prefill against its
# parts (bench/moe_prefill/); it reaches the layer's internals (src/include/moe_prefill.h) for
# the GEMMs-alone and plain-cuBLAS rows; shapes, routing and weights from bench/moe/moe_common.c.
MOE_PREFILL_BENCH_C := $(wildcard bench/moe_prefill/*.c)
MOE_PREFILL_BENCH_OBJ := $(patsubst %.c,$(BUILD)/obj/%.o,$(MOE_PREFILL_BENCH_C))
MOE_PREFILL_BENCH_LINK := $(MOE_PREFILL_BENCH_OBJ) $(BUILD)/obj/tests/common/ranks.o \
                  $(BUILD)/obj/bench/moe/moe_common.o \
                  $(BUILD)/obj/bench/experts/bench_kernels.o $(BUILD)/obj/bench/check.o \
                  $(patsubst %.c,$(BUILD)/obj/%.o,$(KTIME_C))

# epx_moe_gemm_bench (`make moe-gemm-bench-bin`): the prefill layer's grouped FP8 GEMM alone on
# one GPU (bench/moe_gemm/), in time and in SM cycles; the fills of bench/experts/.
MOE_GEMM_BENCH_C := $(wildcard bench/moe_gemm/*.c)
MOE_GEMM_BENCH_OBJ := $(patsubst %.c,$(BUILD)/obj/%.o,$(MOE_GEMM_BENCH_C))
MOE_GEMM_BENCH_LINK := $(MOE_GEMM_BENCH_OBJ) $(BUILD)/obj/bench/experts/bench_kernels.o \
                  $(BUILD)/obj/bench/moe/moe_common.o $(BUILD)/obj/tests/common/ranks.o \
                  $(BUILD)/obj/bench/check.o

SHARED_LIB := $(BUILD)/lib/libepx.so
STATIC_LIB := $(BUILD)/lib/libepx.a
TEST_BIN := $(BUILD)/bin/epx_test
BENCH_BIN := $(BUILD)/bin/epx_bench
SOAK_BIN := $(BUILD)/bin/epx_soak
EXPERTS_BENCH_BIN := $(BUILD)/bin/epx_experts_bench
LAYOUT_BENCH_BIN := $(BUILD)/bin/epx_layout_bench
MOE_BENCH_BIN := $(BUILD)/bin/epx_moe_bench
MOE_PREFILL_BENCH_BIN := $(BUILD)/bin/epx_moe_prefill_bench
MOE_GEMM_BENCH_BIN := $(BUILD)/bin/epx_moe_gemm_bench
.PHONY: all lib test test-python bench soak-bin experts-bench-bin layout-bench-bin moe-bench-bin moe-prefill-bench-bin moe-gemm-bench-bin format format-check install clean header-check
all: lib
lib: $(SHARED_LIB) $(STATIC_LIB)

# Test, benchmark and soak objects may include tests/ headers (common/, ref/, gpu/, soak/) and
# bench/ ones (the tests' ktime.h, cupti_lib.h); nothing else. CUPTI's headers are in the
# toolkit's include/ (CUDA 12.x+) or extras/CUPTI/include (older layouts); libcupti itself is
# never linked: bench/cupti_lib.c dlopens it, looking first where $(CUDA_HOME) has it.
EXTRA_INCLUDES :=
$(TEST_OBJ) $(BENCH_OBJ) $(SOAK_OBJ) $(LAYOUT_BENCH_OBJ) $(MOE_BENCH_OBJ) $(MOE_PREFILL_BENCH_OBJ) \
  $(MOE_GEMM_BENCH_OBJ): EXTRA_INCLUDES := -Itests -Ibench \
  $(addprefix -I,$(wildcard $(CUDA_HOME)/extras/CUPTI/include))
$(EXPERTS_BENCH_OBJ): EXTRA_INCLUDES := -Ibench
$(BUILD)/obj/bench/cupti_lib.o: CFLAGS += -DEPX_BENCH_CUDA_HOME='"$(CUDA_HOME)"'
# cuBLAS is loaded at run time, first from the toolkit the library is built with (blas_lib.h).
$(BUILD)/obj/src/blas_lib.o: CFLAGS += -DEPX_CUDA_LIBDIR='"$(CUDA_LIBDIR)"'

# Each object's target architectures: NVCC_GENCODE, but the wgmma kernels' NVCC_GENCODE_WGMMA (a
# variable of the recipe's own, so that `make NVCC_GENCODE=...` on the command line, which beats
# any target-specific assignment of NVCC_GENCODE, does not reach them).
OBJ_GENCODE = $(NVCC_GENCODE)
WGMMA_OBJ := $(BUILD)/obj/src/kernels/experts_fp8.o $(BUILD)/obj/src/kernels/moe_gemm_fp8.o
$(WGMMA_OBJ): OBJ_GENCODE = $(NVCC_GENCODE_WGMMA)

$(BUILD)/obj/%.o: %.c mk/toolchain.mk $(TOOLCHAIN_STAMP)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(EXTRA_INCLUDES) -MMD -MP -c $< -o $@

NVCC_OBJ = $(NVCC) $(OBJ_GENCODE) $(NVCCFLAGS) $(EXTRA_INCLUDES) -MMD -MP -MF $(@:.o=.d) -c $< -o $@
$(BUILD)/obj/%.o: %.cu mk/toolchain.mk $(TOOLCHAIN_STAMP)
	@mkdir -p $(dir $@)
	$(NVCC_OBJ)

# The wgmma kernels: where ptxas reports that it serialized their wgmma instructions
# (C7510-C7529, "Potential Performance Loss"), a silent slowdown that small, unrelated edits of a
# kernel can cause (docs/moe.md, "EPX's grouped FP8 GEMM"), the build says so, and with
# WGMMA_SERIALIZED=error (CI and scripts/gpu-check.sh, on the toolkit the kernels were tuned
# with) fails. The default only warns: another toolkit's ptxas must not break a user's build.
WGMMA_SERIALIZED ?= warn
$(WGMMA_OBJ): $(BUILD)/obj/%.o: %.cu mk/toolchain.mk $(TOOLCHAIN_STAMP)
	@mkdir -p $(dir $@)
	$(NVCC_OBJ) 2>$@.log; rc=$$?; cat $@.log >&2; \
	  if [ $$rc -eq 0 ] && grep -q 'C75[12][0-9]' $@.log; then \
	    echo "$<: WARNING: ptxas serialized wgmma instructions (above): slower kernels" >&2; \
	    if [ "$(WGMMA_SERIALIZED)" = error ]; then rm -f $@; exit 1; fi; fi; \
	  exit $$rc

-include $(sort $(LIB_OBJ:.o=.d) $(TEST_OBJ:.o=.d) $(BENCH_OBJ:.o=.d) $(SOAK_OBJ:.o=.d) \
                $(EXPERTS_BENCH_OBJ:.o=.d) $(LAYOUT_BENCH_OBJ:.o=.d) $(MOE_BENCH_OBJ:.o=.d) \
                $(MOE_PREFILL_BENCH_OBJ:.o=.d) $(MOE_GEMM_BENCH_OBJ:.o=.d))

# Only epx_* symbols leave the shared library (src/epx.map).
$(SHARED_LIB): $(LIB_OBJ) src/epx.map
	@mkdir -p $(dir $@)
	$(CXX) -shared -o $@ $(LIB_OBJ) -Wl,--version-script=src/epx.map -Wl,-soname,libepx.so.0 $(SAN) $(LDLIBS)

$(STATIC_LIB): $(LIB_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $(LIB_OBJ)

# Tests and the benchmark link the static archive: they may use internal headers.
$(TEST_BIN): $(TEST_OBJ) $(STATIC_LIB)
	@mkdir -p $(dir $@)
	$(CXX) -o $@ $(TEST_OBJ) $(STATIC_LIB) $(SAN) $(LDLIBS)

$(BENCH_BIN): $(BENCH_OBJ) $(STATIC_LIB)
	@mkdir -p $(dir $@)
	$(CXX) -o $@ $(BENCH_OBJ) $(STATIC_LIB) $(SAN) $(LDLIBS)

soak-bin: $(SOAK_BIN)
$(SOAK_BIN): $(SOAK_LINK) $(STATIC_LIB)
	@mkdir -p $(dir $@)
	$(CXX) -o $@ $(SOAK_LINK) $(STATIC_LIB) $(SAN) $(LDLIBS)

experts-bench-bin: $(EXPERTS_BENCH_BIN)
$(EXPERTS_BENCH_BIN): $(EXPERTS_BENCH_OBJ) $(BUILD)/obj/bench/check.o $(STATIC_LIB)
	@mkdir -p $(dir $@)
	$(CXX) -o $@ $(EXPERTS_BENCH_OBJ) $(BUILD)/obj/bench/check.o $(STATIC_LIB) $(SAN) $(LDLIBS)
moe-bench-bin: $(MOE_BENCH_BIN)
$(MOE_BENCH_BIN): $(MOE_BENCH_LINK) $(STATIC_LIB)
	@mkdir -p $(dir $@)
	$(CXX) -o $@ $(MOE_BENCH_LINK) $(STATIC_LIB) $(SAN) $(LDLIBS)
moe-prefill-bench-bin: $(MOE_PREFILL_BENCH_BIN)
$(MOE_PREFILL_BENCH_BIN): $(MOE_PREFILL_BENCH_LINK) $(STATIC_LIB)
	@mkdir -p $(dir $@)
	$(CXX) -o $@ $(MOE_PREFILL_BENCH_LINK) $(STATIC_LIB) $(SAN) $(LDLIBS)
moe-gemm-bench-bin: $(MOE_GEMM_BENCH_BIN)
$(MOE_GEMM_BENCH_BIN): $(MOE_GEMM_BENCH_LINK) $(STATIC_LIB)
	@mkdir -p $(dir $@)
	$(CXX) -o $@ $(MOE_GEMM_BENCH_LINK) $(STATIC_LIB) $(SAN) $(LDLIBS)
layout-bench-bin: $(LAYOUT_BENCH_BIN)
$(LAYOUT_BENCH_BIN): $(LAYOUT_BENCH_LINK) $(STATIC_LIB)
	@mkdir -p $(dir $@)
	$(CXX) -o $@ $(LAYOUT_BENCH_LINK) $(STATIC_LIB) $(SAN) $(LDLIBS)

# The public header must stand alone as strict C11.
header-check:
	@mkdir -p $(BUILD)
	printf '#include <epx.h>\nint main(void){epx_group_config_t c = EPX_GROUP_CONFIG_INIT; (void)c; return 0;}\n' > $(BUILD)/header_check.c
	$(CC) -std=c11 -Wall -Wextra -pedantic -Werror -Iinclude -I$(NCCL_INCDIR) -I$(CUDA_HOME)/include -c $(BUILD)/header_check.c -o $(BUILD)/header_check.o

# `make test`: the C tests (epx_test), then the Python package's CPU tests, both always; then
# each suite's summary line and their sum in the runner's "N passed, N failed, N skipped" form.
# Fails if either suite failed.
test: SHELL := /bin/bash
test: lib header-check $(TEST_BIN)
	@$(TEST_BIN) $(TEST_ARGS) | tee $(BUILD)/test-c.log; c_rc=$${PIPESTATUS[0]}; \
	$(MAKE) --no-print-directory test-python | tee $(BUILD)/test-python.log; \
	py_rc=$${PIPESTATUS[0]}; \
	c_line=$$(tail -n 1 $(BUILD)/test-c.log); py_line=$$(tail -n 1 $(BUILD)/test-python.log); \
	read cp cf cs < <(echo "$$c_line" | $(COUNT_RESULTS)); \
	read pp pf ps < <(echo "$$py_line" | $(COUNT_RESULTS)); \
	echo; echo "C tests (epx_test):          $$c_line"; \
	echo "Python tests (python/tests): $$py_line"; \
	echo "$$((cp + pp)) passed, $$((cf + pf)) failed, $$((cs + ps)) skipped"; \
	test $$c_rc -eq 0 && test $$py_rc -eq 0

# "N passed", "N failed" / "N error(s)", "N skipped" of a summary line (runner's or pytest's)
# -> "P F S".
COUNT_RESULTS = awk '{ for (i = 1; i < NF; i++) { w = $$(i + 1); sub(/,$$/, "", w); \
  if (w == "passed") p += $$i; else if (w == "failed" || w ~ /^errors?$$/) f += $$i; \
  else if (w == "skipped") s += $$i } } END { print p + 0, f + 0, s + 0 }'

# The Python package's CPU tests with $(PYTHON) (they load build/lib/libepx.so); skipped when
# it has no pytest, unless REQUIRE_PYTHON_TESTS=1 (CI).
PYTEST_ARGS ?= -q
test-python: lib
	@if $(PYTHON) -c 'import pytest' 2>/dev/null; then \
	  $(PYTHON) -m pytest python/tests $(PYTEST_ARGS); \
	elif [ "$(REQUIRE_PYTHON_TESTS)" = 1 ]; then \
	  echo "python tests: $(PYTHON) has no pytest ($(PYTHON) -m pip install pytest)"; exit 1; \
	else echo "python tests skipped: pip install pytest"; fi

bench: $(BENCH_BIN)
	$(BENCH_BIN) $(BENCH_ARGS)

FORMAT_FILES := $(sort $(wildcard include/*.h src/*.c src/*/*.c src/*/*.cu src/*/*.cuh src/*/*.h \
                  tests/*/*.c tests/*/*.h tests/*/*.cu bench/*.c bench/*.cu bench/*.h \
                  bench/*/*.c bench/*/*.cu bench/*/*.h))
format:
	clang-format -i $(FORMAT_FILES)
format-check:
	clang-format --dry-run --Werror $(FORMAT_FILES)

install: lib
	install -d $(DESTDIR)$(PREFIX)/include $(DESTDIR)$(PREFIX)/lib/pkgconfig
	install -m 644 include/epx.h $(DESTDIR)$(PREFIX)/include/
	install -m 755 $(SHARED_LIB) $(DESTDIR)$(PREFIX)/lib/libepx.so.0
	ln -sf libepx.so.0 $(DESTDIR)$(PREFIX)/lib/libepx.so
	install -m 644 $(STATIC_LIB) $(DESTDIR)$(PREFIX)/lib/
	sed -e 's|@PREFIX@|$(PREFIX)|g' -e 's|@VERSION@|$(shell sed -n 's/^#define EPX_VERSION_\(MAJOR\|MINOR\|PATCH\) //p' include/epx.h | paste -sd.)|' \
	    -e 's|@CUDA_LIBDIR@|$(CUDA_LIBDIR)|g' -e 's|@NCCL_LIBDIR@|$(NCCL_LIBDIR)|g' -e 's|@NCCL_LINK@|$(NCCL_LINK)|g' \
	    -e 's|@CUDA_INCDIR@|$(CUDA_HOME)/include|g' -e 's|@NCCL_INCDIR@|$(NCCL_INCDIR)|g' \
	    mk/epx.pc.in > $(DESTDIR)$(PREFIX)/lib/pkgconfig/epx.pc

clean:
	rm -rf $(BUILD)
