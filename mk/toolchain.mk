# mk/toolchain.mk - find CUDA and NCCL without help; CUDA_HOME / NCCL_HOME override.
#
# NCCL is looked for, in order: $(NCCL_HOME); the CUDA toolkit (include/nccl.h); the
# nvidia-nccl-cu13 Python wheel (site-packages/nvidia/nccl, which ships only libnccl.so.2).

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

# Candidate wheel locations: every python3 we can find, then the known venv.
NCCL_WHEEL_DIRS := $(shell for py in python3 /opt/torch/.venv/bin/python3; do \
    $$py -c 'import nvidia.nccl as m; print(list(m.__path__)[0])' 2>/dev/null; done) \
  $(wildcard /opt/torch/.venv/lib/python3*/site-packages/nvidia/nccl) \
  $(wildcard /usr/local/lib/python3*/dist-packages/nvidia/nccl)

ifeq ($(NCCL_HOME),)
  ifneq ($(wildcard $(CUDA_HOME)/include/nccl.h),)
    NCCL_HOME := $(CUDA_HOME)
  else
    NCCL_HOME := $(firstword $(foreach d,$(NCCL_WHEEL_DIRS),$(if $(wildcard $(d)/include/nccl.h),$(d))))
  endif
endif
ifeq ($(NCCL_HOME),)
  $(error NCCL not found: set NCCL_HOME to a directory with include/nccl.h and lib/libnccl.so*)
endif
NCCL_INCDIR := $(NCCL_HOME)/include
NCCL_LIBDIR := $(firstword $(foreach d,lib64 lib targets/x86_64-linux/lib,$(if $(wildcard $(NCCL_HOME)/$(d)/libnccl.so*),$(NCCL_HOME)/$(d))))
# The wheel has no unversioned libnccl.so: name the soname itself.
ifneq ($(wildcard $(NCCL_LIBDIR)/libnccl.so),)
  NCCL_LINK := -lnccl
else
  NCCL_LINK := -l:libnccl.so.2
endif
