# mk/toolchain.mk - find CUDA and NCCL without help; CUDA_HOME / NCCL_HOME override.
#
# CUDA: $(CUDA_HOME), else the toolkit of the nvcc on PATH, else /usr/local/cuda.
# NCCL is looked for, in order: $(NCCL_HOME); the CUDA toolkit (include/nccl.h); the
# nvidia-nccl-cu13 Python wheel, found by asking $(PYTHON) (default python3, then python) where
# nvidia.nccl lives (site-packages/nvidia/nccl, which ships only lib/libnccl.so.2). No paths of
# any one machine here: a venv is found through the python that runs it (PYTHON=.../python3).

NVCC_PATH := $(shell command -v nvcc 2>/dev/null)
ifeq ($(CUDA_HOME),)
  ifneq ($(NVCC_PATH),)
    CUDA_HOME := $(patsubst %/bin/nvcc,%,$(realpath $(NVCC_PATH)))
  else
    CUDA_HOME := /usr/local/cuda
  endif
endif
NVCC ?= $(CUDA_HOME)/bin/nvcc
CUDA_LIBDIR := $(firstword $(wildcard $(CUDA_HOME)/lib64 $(CUDA_HOME)/targets/x86_64-linux/lib $(CUDA_HOME)/lib))

PYTHON ?= python3
# The wheel's directory, if $(PYTHON) or else python imports one with include/nccl.h.
NCCL_FROM_PYTHON = $(shell for py in $(PYTHON) python; do \
    $$py -c 'import os, nvidia.nccl as m; d = list(m.__path__)[0]; \
             print(d) if os.path.isfile(os.path.join(d, "include", "nccl.h")) else exit(1)' \
      2>/dev/null && break; done)

ifeq ($(NCCL_HOME),)
  ifneq ($(wildcard $(CUDA_HOME)/include/nccl.h),)
    NCCL_HOME := $(CUDA_HOME)
  else
    NCCL_HOME := $(firstword $(NCCL_FROM_PYTHON))
  endif
endif
ifeq ($(NCCL_HOME),)
  $(error NCCL not found: no include/nccl.h in CUDA_HOME=$(CUDA_HOME), and neither $(PYTHON) \
    nor python imports nvidia.nccl. Either install the wheel into the python that make runs \
    ($(PYTHON) -m pip install nvidia-nccl-cu13), or name the python that has it \
    (make PYTHON=/path/to/venv/bin/python3), or set NCCL_HOME to a directory with \
    include/nccl.h and lib/libnccl.so*)
endif
NCCL_INCDIR := $(NCCL_HOME)/include
NCCL_LIBDIR := $(firstword $(foreach d,lib64 lib targets/x86_64-linux/lib,$(if $(wildcard $(NCCL_HOME)/$(d)/libnccl.so*),$(NCCL_HOME)/$(d))))
ifeq ($(NCCL_LIBDIR),)
  $(error NCCL_HOME=$(NCCL_HOME) has include/nccl.h but no lib64/ or lib/ with libnccl.so*: \
    point NCCL_HOME at an NCCL build or install that has both)
endif
# The wheel has no unversioned libnccl.so: name the soname itself.
ifneq ($(wildcard $(NCCL_LIBDIR)/libnccl.so),)
  NCCL_LINK := -lnccl
else
  NCCL_LINK := -l:libnccl.so.2
endif
