# FlashAttention, step by step: build, run, test, bench.  `make help` lists the targets.

CHAPTERS := $(patsubst %/attention.cu,%,$(sort $(wildcard [0-9][0-9]_*/attention.cu)))
BUILD    ?= build
NVCC     ?= nvcc

# --- Target GPU: ARCH=sm_90 (or sm_90a, sm_80, ...), ARCH=multi, default: the local GPU ----
ARCH ?= auto
ifeq ($(ARCH),auto)
  LOCAL_CC := $(shell nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' .')
  ARCH := $(if $(LOCAL_CC),sm_$(LOCAL_CC),multi)
endif
ifeq ($(ARCH),multi)
  GENCODE := -gencode=arch=compute_80,code=sm_80 -gencode=arch=compute_89,code=sm_89 \
             -gencode=arch=compute_90,code=sm_90 -gencode=arch=compute_90,code=compute_90
else
  GENCODE := -gencode=arch=compute_$(ARCH:sm_%=%),code=$(ARCH)
endif

# --- Python with NumPy: the system's if it has NumPy, else a .venv made from requirements.txt
PYTHON_SYS ?= python3
ifeq ($(shell $(PYTHON_SYS) -c 'import numpy' >/dev/null 2>&1 && echo yes),yes)
  PYTHON  := $(shell command -v $(PYTHON_SYS))
  PY_DEPS :=
else
  PYTHON  := $(CURDIR)/.venv/bin/python
  PY_DEPS := .venv/.ready
endif

# Chapters built on Hopper's arch-specific features (wgmma) target sm_90a alone, whatever ARCH says:
# sm_90a code runs on sm_90 only, and the chapter says so (exit 77) on any other GPU.
SM90A_CHAPTERS := 08_fp8
# 08 is built in steps (08.1 ... 08.5, `#if STEP == k` in its source): BUILD/08_fp8.stepK for each
# step but the last, which is the chapter, BUILD/08_fp8. Each is a bench row of its own.
STEP_BUILDS := $(foreach k,1 2 3 4,08_fp8.step$(k))
# 09's backward with dQ summed in a fixed order (DETERMINISTIC_DQ=1): bitwise repeatable gradients.
VARIANT_BUILDS := 09_backward.deterministic
$(addprefix $(BUILD)/,$(SM90A_CHAPTERS) $(STEP_BUILDS)) $(addprefix $(BUILD)/exercises/,$(SM90A_CHAPTERS)): \
    private GENCODE := -gencode=arch=compute_90a,code=sm_90a

EXTRA_NVFLAGS ?=   # e.g. -DBLOCK_KV_D128=64 to try another tile size in 07
NVFLAGS := -O3 -std=c++17 -lineinfo -Xcompiler -Wall,-Wextra -Xptxas -v $(EXTRA_NVFLAGS) \
           -DFA_ROOT='"$(CURDIR)"' -DFA_PYTHON='"$(PYTHON)"'
HEADERS := common/harness.h common/npy.h common/shape.h
# The harness, compiled once per build folder (it has no kernels: it links with any chapter).
COMMON_OBJ := $(BUILD)/common/harness.o $(BUILD)/common/npy.o
.SECONDARY: $(COMMON_OBJ)

.PHONY: all lib run test bench compare sanitize diff profile sass exercise grade ablation train help clean FORCE
.DEFAULT_GOAL := all

all: $(addprefix $(BUILD)/,$(CHAPTERS) $(STEP_BUILDS) $(VARIANT_BUILDS)) $(PY_DEPS)

# Rebuild when the flags change (ARCH=..., a moved checkout).
$(BUILD)/.flags: FORCE
	@mkdir -p $(BUILD)
	@echo '$(NVCC) $(NVFLAGS) $(GENCODE)' | cmp -s - $@ || echo '$(NVCC) $(NVFLAGS) $(GENCODE)' > $@

# Compile, keep the compiler's output in <target>.log (ptxas' register/spill report for the
# chapters), and fail on any warning.
compile = $(NVCC) $(NVFLAGS) $(GENCODE) $(1) > $@.log 2>&1 || { cat $@.log; exit 1; }; \
          ! grep -i 'warning' $@.log || { echo "$@: compiler warnings above"; exit 1; }

$(BUILD)/common/%.o: common/%.cu $(HEADERS) $(BUILD)/.flags
	@mkdir -p $(dir $@)
	@echo "nvcc  $< -> $@"
	@$(call compile,-c -o $@ $<)

$(BUILD)/common/%.o: common/%.c $(HEADERS) $(BUILD)/.flags
	@mkdir -p $(dir $@)
	@echo "nvcc  $< -> $@"
	@$(call compile,-c -o $@ $<)

# One executable per chapter.
$(BUILD)/%: %/attention.cu $(COMMON_OBJ) $(HEADERS) $(BUILD)/.flags
	@echo "nvcc  $< -> $@ ($(if $(filter $*,$(SM90A_CHAPTERS)),sm_90a,$(ARCH)))"
	@$(call compile,-o $@ $< $(COMMON_OBJ))

$(BUILD)/08_fp8.step%: 08_fp8/attention.cu $(COMMON_OBJ) $(HEADERS) $(BUILD)/.flags
	@echo "nvcc  $< -> $@ (sm_90a, step 08.$*)"
	@$(call compile,-DSTEP=$* -o $@ $< $(COMMON_OBJ))

$(BUILD)/09_backward.deterministic: 09_backward/attention.cu $(COMMON_OBJ) $(HEADERS) $(BUILD)/.flags
	@echo "nvcc  $< -> $@ ($(ARCH), DETERMINISTIC_DQ=1)"
	@$(call compile,-DDETERMINISTIC_DQ=1 -o $@ $< $(COMMON_OBJ))

# The chapters as libraries (common/library.h; docs/design.md): BUILD/lib/X.so beside each executable
# BUILD/X of `all`, its attention.cu compiled again, position-independent, and linked with
# common/library.cu (the C ABI; no harness, no main). Only the fa_* functions are exported
# (common/library.map: the chapter's symbols and the static CUDA runtime's stay inside). Not part
# of `all`, which it would make twice as long: `make lib`.
LIBS := $(addprefix $(BUILD)/lib/,$(addsuffix .so,$(CHAPTERS) $(STEP_BUILDS) $(VARIANT_BUILDS)))
LIB_OBJ := $(BUILD)/common/library.o
PIC := -Xcompiler -fPIC,-fvisibility=hidden
LIB_LINK := -shared -Xlinker --version-script=$(CURDIR)/common/library.map
$(addprefix $(BUILD)/lib/,$(addsuffix .so,$(SM90A_CHAPTERS) $(STEP_BUILDS))): \
    private GENCODE := -gencode=arch=compute_90a,code=sm_90a

lib: $(LIBS)

$(LIB_OBJ): common/library.cu common/library.h $(HEADERS) $(BUILD)/.flags
	@mkdir -p $(dir $@)
	@echo "nvcc  $< -> $@"
	@$(call compile,$(PIC) -c -o $@ $<)

$(BUILD)/lib/%.so: %/attention.cu $(LIB_OBJ) common/library.map $(HEADERS) $(BUILD)/.flags
	@mkdir -p $(dir $@)
	@echo "nvcc  $< -> $@ ($(if $(filter $*,$(SM90A_CHAPTERS)),sm_90a,$(ARCH)))"
	@$(call compile,$(PIC) $(LIB_LINK) -o $@ $< $(LIB_OBJ))

$(BUILD)/lib/08_fp8.step%.so: 08_fp8/attention.cu $(LIB_OBJ) common/library.map $(HEADERS) $(BUILD)/.flags
	@mkdir -p $(dir $@)
	@echo "nvcc  $< -> $@ (sm_90a, step 08.$*)"
	@$(call compile,$(PIC) $(LIB_LINK) -DSTEP=$* -o $@ $< $(LIB_OBJ))

$(BUILD)/lib/09_backward.deterministic.so: 09_backward/attention.cu $(LIB_OBJ) common/library.map $(HEADERS) \
    $(BUILD)/.flags
	@mkdir -p $(dir $@)
	@echo "nvcc  $< -> $@ ($(ARCH), DETERMINISTIC_DQ=1)"
	@$(call compile,$(PIC) $(LIB_LINK) -DDETERMINISTIC_DQ=1 -o $@ $< $(LIB_OBJ))

.venv/.ready: requirements.txt
	@echo "setting up .venv with NumPy (the system Python lacks it)"
	$(PYTHON_SYS) -m venv .venv
	.venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements.txt
	@touch $@

run: all
	@$(PYTHON) common/stages.py run --build $(BUILD) $(CHAPTERS)

test: $(PY_DEPS)
	@$(PYTHON) tests/run.py --build $(BUILD) --make '$(MAKE)' $(TEST_ARGS)

# make bench: the forward's sweep, then the backward's (the chapters that have a backward pass, 09's
# deterministic build, PyTorch's backward: docs/results/<gpu>.backward.csv). BENCH_PASS=backward: the
# backward's alone, the forward's rows left as they are (BENCH_PASS=forward: the forward's alone);
# QUICK=1: only N = 1k and 4k. make compare takes both too.
BENCH_PASS ?= both
bench_flags = --pass $(BENCH_PASS)$(if $(filter-out 0,$(QUICK)), --quick)

bench: all
	@$(PYTHON) common/stages.py bench --build $(BUILD) $(bench_flags) $(CHAPTERS)

compare: all
	@$(PYTHON) common/stages.py compare --build $(BUILD) $(bench_flags)

sanitize: all
	@$(PYTHON) tests/run.py --build $(BUILD) --make '$(MAKE)' --suite sanitize

# A chapter's folder from its number: 4, 04 and 04_fused all name 04_fused (empty if none); a step
# such as 08.3 names its chapter's folder.
chapter_dir = $(firstword $(patsubst %/attention.cu,%,$(wildcard $(call chapter_of,$(1))_*/attention.cu 0$(call chapter_of,$(1))_*/attention.cu $(call chapter_of,$(1))/attention.cu)))
chapter_of = $(firstword $(subst ., ,$(1)))
comma := ,
no_chapter = { echo "make $@: no chapter '$(1)' (name one by its number, e.g. $(2)=04; chapters: $(CHAPTERS))" >&2; exit 2; }

A ?= 04
B ?= 05
# The chapters as their defaults compile them (ablation switches' off branches left out; plain
# Python, no NumPy), a step such as 08.3 as that step compiles it; RAW=1: the files as they are.
diff:
	@test -n "$(call chapter_dir,$(A))" || $(call no_chapter,$(A),A)
	@test -n "$(call chapter_dir,$(B))" || $(call no_chapter,$(B),B)
ifeq ($(RAW),1)
	@diff -u $(call chapter_dir,$(A))/attention.cu $(call chapter_dir,$(B))/attention.cu; test $$? -le 1
else
	@$(PYTHON_SYS) common/ablation.py diff $(A) $(B)
endif

# cuobjdump from PATH, next to nvcc, or where `make test` fetched it (.cache/tools); it needs
# nvdisasm from the same place on PATH to print SASS.
CUOBJDUMP ?= $(firstword $(shell command -v cuobjdump 2>/dev/null) \
                         $(wildcard $(dir $(shell command -v $(NVCC) 2>/dev/null))cuobjdump) \
                         $(wildcard $(CURDIR)/.cache/tools/cuobjdump))

CH ?= 04
profile: all
	@test -n "$(call chapter_dir,$(CH))" || $(call no_chapter,$(CH),CH)
	@command -v ncu >/dev/null 2>&1 || { echo "make profile: Nsight Compute (ncu) not found: install it with the CUDA toolkit, or put it on PATH" >&2; exit 2; }
	@nvidia-smi -L >/dev/null 2>&1 || { echo "make profile: no NVIDIA GPU here; Nsight Compute profiles kernels on a GPU" >&2; exit 2; }
	ncu --clock-control none --set full --launch-count 3 \
	    $(BUILD)/$(call chapter_dir,$(CH)) --warmup 0 --iters 1 --no-check --batch 4 --heads 16 --seqlen 4096

# The SASS of one architecture (the build's, sm_90 for a multi-architecture build; 08: sm_90a), all
# kernels or those whose name contains KERNEL (make sass CH=07 KERNEL=attention); a step: CH=08.3.
SASS_ARCH ?= $(if $(filter multi,$(ARCH)),sm_90,$(ARCH))
sass_binary = $(BUILD)/$(call chapter_dir,$(CH))$(if $(findstring .,$(CH)),$(if $(filter 5,$(lastword $(subst ., ,$(CH)))),,.step$(lastword $(subst ., ,$(CH)))))
sass: all
	@test -n "$(call chapter_dir,$(CH))" || $(call no_chapter,$(CH),CH)
	@test -n "$(CUOBJDUMP)" || { echo "make sass: cuobjdump not found (CUDA toolkit); 'make test' fetches one into .cache/tools" >&2; exit 2; }
	@test -f $(sass_binary) || { echo "make sass: $(sass_binary) not built: no such step (08's are 08.1 ... 08.5)" >&2; exit 2; }
	@PATH="$(dir $(CUOBJDUMP)):$$PATH" $(CUOBJDUMP) --dump-sass \
	    -arch $(if $(filter $(call chapter_dir,$(CH)),$(SM90A_CHAPTERS)),sm_90a,$(SASS_ARCH)) $(sass_binary) | \
	    awk -v k='$(KERNEL)' '/Function :/ { show = (k == "" || index($$0, k) > 0) } k == "" || show'

# Graded exercises (common/exercises.py): a student copy of a chapter in exercises/ (EX= one
# exercise, or a comma-separated list; FORCE=1 overwrites a copy you have edited), then its grade:
# PASS, FAIL, or UNGRADED (the grader's exit 77) when a check that decides it could not run here
# (no GPU, say). The copy builds with the rule above, as BUILD/exercises/NN_name, with this
# Makefile's flags.
exercise: $(PY_DEPS)
	@test -n "$(call chapter_dir,$(CH))" || $(call no_chapter,$(CH),CH)
	@$(PYTHON) common/exercises.py make $(call chapter_dir,$(CH))$(if $(EX), --only $(EX))$(if $(filter-out 0,$(FORCE)), --force)

grade: $(PY_DEPS)
	@test -n "$(call chapter_dir,$(CH))" || $(call no_chapter,$(CH),CH)
	@$(MAKE) --no-print-directory -s $(BUILD)/$(call chapter_dir,$(CH))
	@$(PYTHON) common/exercises.py grade $(call chapter_dir,$(CH)) --build $(BUILD) --make '$(MAKE)'

# A hand-out for a class: BUILD/handout/NN_name.tar.gz, one folder with the student copy of the
# chapter (every exercise cut), the harness, the grader and this Makefile, and no solution: there,
# `make grade CH=NN` grades the copy (a speed gate, which times the solution, says UNGRADED).
.PHONY: handout
handout: $(PY_DEPS)
	@test -n "$(call chapter_dir,$(CH))" || $(call no_chapter,$(CH),CH)
	@$(PYTHON) common/exercises.py handout $(call chapter_dir,$(CH)) --out $(BUILD)/handout

# Each idea of a chapter on its own (common/ablation.py): its -D switches built, checked and timed
# in one run -> docs/results/logs/NN/ablation_NN.csv and the table in the chapter's README.
ablation: $(PY_DEPS)
	@test -n "$(call chapter_dir,$(CH))" || $(call no_chapter,$(CH),CH)
	@$(PYTHON) common/ablation.py run $(call chapter_dir,$(CH)) --build $(BUILD) --make '$(MAKE)'

# A chapter as a PyTorch op (common/torch_op.py) in a small GPT (common/train.py): trained twice from
# one seed, with PyTorch's SDPA and with CH's forward (default here: 07; a step such as CH=08.3 too)
# and 09's backward, on the Python standard library's source; both loss curves, each run's tokens/s
# and a CSV -> docs/results/train/. It builds the two libraries it loads. TRAIN_ARGS: train.py's
# options, e.g. --quick (200 steps, output under BUILD/train/) or --steps 2000 --batch 16.
# CH=07,08: one SDPA run, then one run per chapter. Without PyTorch or a GPU: one line, exit 0.
TRAIN_CH = $(if $(filter file,$(origin CH)),07,$(CH))
TRAIN_ARGS ?=
train: $(PY_DEPS)
	@$(foreach c,$(subst $(comma), ,$(TRAIN_CH)),test -n "$(call chapter_dir,$(c))" || $(call no_chapter,$(c),CH);) true
	@$(PYTHON) common/train.py --chapter $(TRAIN_CH) --build $(BUILD) $(TRAIN_ARGS)

# The ceilings docs/design.md quotes, measured on this GPU by tools/peaks.cu: fp32 FFMA, fp16
# mma.sync, wgmma fp16 and e4m3 (sm_90a: built so when ARCH is sm_90; skipped in one line on other
# GPUs) and the device copy; the table also goes to docs/results/logs/common/peaks_<gpu>.log.
# Without a GPU it says so in one line (exit 77 of the program) and writes nothing.
.PHONY: peaks
ifneq ($(filter sm_90 sm_90a,$(ARCH)),)
$(BUILD)/peaks: private GENCODE := -gencode=arch=compute_90a,code=sm_90a
endif
$(BUILD)/peaks: tools/peaks.cu $(BUILD)/.flags
	@echo "nvcc  $< -> $@ ($(if $(filter sm_90 sm_90a,$(ARCH)),sm_90a,$(ARCH)))"
	@$(call compile,-o $@ $<)

peaks: $(BUILD)/peaks
	@mkdir -p docs/results/logs/common
	@$(BUILD)/peaks docs/results/logs/common; rc=$$?; test $$rc -eq 0 -o $$rc -eq 77

help:
	@echo "make            build every chapter into $(BUILD)/ (ARCH=$(ARCH); ARCH=sm_90, sm_80, multi...)"
	@echo "make lib        every build above as a library too: $(BUILD)/lib/NN_name.so (C ABI: common/library.h)"
	@echo "make run        run every chapter on the default shape and print the stage table"
	@echo "make test       CPU tests, and the GPU matrix when a GPU is present (TEST_ARGS='-v -k NAME': each test with its time, only those named)"
	@echo "make bench      the benchmark sweep -> docs/results/ (CSV, Markdown, plot) and README table, then the backward's (.backward.csv)"
	@echo "                BENCH_PASS=backward (or forward): that sweep alone; QUICK=1: only N = 1k and 4k"
	@echo "make compare    PyTorch SDPA anchors on the bench shapes, forward and backward (needs PyTorch; BENCH_PASS, QUICK too)"
	@echo "make sanitize   compute-sanitizer memcheck/racecheck/synccheck/initcheck, every chapter"
	@echo "make diff A=04 B=05   the one idea chapter B adds over chapter A (A=07 B=08.1, A=08.1 B=08.2 ...: 08's steps)"
	@echo "make profile CH=04    Nsight Compute on one chapter;  make sass CH=04 [KERNEL=name]   its SASS (one arch)"
	@echo "make exercise CH=04 [EX=name] [FORCE=1]   a student copy of the chapter's exercises -> exercises/"
	@echo "make grade CH=04      build and grade exercises/NN_name/attention.cu: PASS, FAIL, or UNGRADED (exit 77) where no GPU runs it"
	@echo "make handout CH=04    the copy, the grader and no solution -> $(BUILD)/handout/NN_name.tar.gz (for a class)"
	@echo "make ablation CH=07   each idea of 04, 07, 08 or 09 (its backward) switched off, checked and timed in one run (GPU)"
	@echo "make train CH=07 [TRAIN_ARGS=--quick]   a small GPT trained with SDPA, then with chapter CH's forward and 09's backward (PyTorch)"
	@echo "make peaks      this GPU's ceilings (FFMA, mma.sync, wgmma, copy) -> docs/results/logs/common/ (GPU)"
	@echo "make clean      remove build/ and the input/reference cache"
	@echo "chapters: $(CHAPTERS)"

clean:
	rm -rf $(BUILD) .cache
