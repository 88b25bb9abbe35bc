# FlashAttention, step by step: build, run, test, bench.  `make help` lists the targets.

comma := ,
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
  ARCH_WORDS := sm_80, sm_89 and sm_90 (no GPU here: ARCH=multi)
else
  GENCODE := -gencode=arch=compute_$(ARCH:sm_%=%),code=$(ARCH)
  ARCH_WORDS := $(ARCH)
endif

# --- Python: NumPy for every tool (requirements.txt): the system's python3 where it has NumPy, else
# a .venv made from requirements.txt. make test also needs pytest (below 9.1) and pytest-xdist
# (requirements-dev.txt): where that Python lacks them, pip installs them into .cache/python, which
# pytest's run puts first on PYTHONPATH (a Python that is itself a venv, PyTorch's say, keeps its
# packages so), and which make clean keeps, as it keeps the tools fetched into .cache/tools.
PYTHON_SYS ?= python3
has_modules = $(shell $(PYTHON_SYS) -c 'import $(1)' >/dev/null 2>&1 && echo yes)
ifeq ($(call has_modules,numpy),yes)
  # the interpreter itself (sys.executable), not a shim that resolves differently under another PATH
  PYTHON  := $(shell $(PYTHON_SYS) -c 'import sys; print(sys.executable)')
  PY_DEPS :=
else
  PYTHON  := $(CURDIR)/.venv/bin/python
  PY_DEPS := .venv/.ready
endif
TEST_SITE := .cache/python
# pytest with xdist and no plugin else: a Python with other pytest plugins installed (benchmark, timeout, ...)
# runs the suite as one without them would.
TEST_ENV  := PYTHONPATH=$(CURDIR)/$(TEST_SITE)$${PYTHONPATH:+:$$PYTHONPATH} PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 PYTEST_PLUGINS=xdist.plugin
ifeq ($(shell $(TEST_ENV) $(PYTHON) -c 'import xdist, pytest; assert pytest.version_tuple < (9, 1)' >/dev/null 2>&1 && echo yes),yes)
  TEST_DEPS := $(PY_DEPS)
else
  TEST_DEPS := $(PY_DEPS) $(TEST_SITE)/.ready
endif

# Chapters built on Hopper's arch-specific features (wgmma) target sm_90a alone, whatever ARCH says:
# sm_90a code runs on sm_90 only, and the chapter says so (exit 77) on any other GPU.
SM90A_CHAPTERS := 08_fp8 10_backward_hopper
# A chapter of ordered steps (08, 09) holds one file per step, NN_name/stepK_<idea>.cu, a program of its
# own: BUILD/NN_name.stepK (its attention.cu is the last step, BUILD/NN_name). Each is a bench row.
STEP_SOURCES := $(sort $(wildcard [0-9][0-9]_*/step[0-9]_*.cu [0-9][0-9]_*/step[0-9][0-9]_*.cu))
step_build = $(patsubst %/,%,$(dir $(1))).step$(patsubst step%,%,$(firstword $(subst _, ,$(notdir $(1)))))
STEP_BUILDS := $(foreach s,$(STEP_SOURCES),$(call step_build,$(s)))
BUILDS := $(CHAPTERS) $(STEP_BUILDS)
SM90A_BUILDS := $(filter $(addsuffix %,$(SM90A_CHAPTERS)),$(BUILDS))
# A build's source: its step file, or its chapter's attention.cu.
chapter_of_build = $(firstword $(subst ., ,$(1)))
source_of = $(or $(filter $(call chapter_of_build,$(1))/step$(lastword $(subst .step, ,$(1)))_%,$(if \
            $(findstring .step,$(1)),$(STEP_SOURCES))),$(call chapter_of_build,$(1))/attention.cu)
CHAPTER_HEADERS := $(wildcard [0-9][0-9]_*/*.h)

EXTRA_NVFLAGS ?=   # e.g. -DBLOCK_KV_D128=64 to try another tile size in 07
NVFLAGS := -O3 -std=c++17 -lineinfo -Xcompiler -Wall,-Wextra -Xptxas -v $(EXTRA_NVFLAGS) \
           -DFA_ROOT='"$(CURDIR)"' -DFA_PYTHON='"$(PYTHON)"'
# Every chapter object is position-independent, so that one compile serves its executable and its
# library (make lib) alike; only the library's fa_* functions are exported (common/library.map).
PIC := -Xcompiler -fPIC,-fvisibility=hidden
HEADERS := common/harness.h common/npy.h common/shape.h common/gpu_files.h common/kv_cache_e4m3.h
# The harness, compiled once per build folder (it has no kernels: it links with any chapter).
COMMON_OBJ := $(BUILD)/common/harness.o $(BUILD)/common/npy.o
LIB_OBJ := $(BUILD)/common/library.o
# 07's forward, which every build of 09, 10 and 11 runs (09_backward/forward.h): compiled once per build
# folder and linked into each, which compiles the header with FORWARD_ELSEWHERE (its declaration only).
FORWARD_CHAPTERS := 09_backward 10_backward_hopper 11_decode
FORWARD_BUILDS := $(filter $(addsuffix %,$(FORWARD_CHAPTERS)),$(BUILDS))
FORWARD_OBJ := $(BUILD)/common/forward.o
$(addprefix $(BUILD)/obj/,$(addsuffix .o,$(FORWARD_BUILDS))): private FORWARD_FLAG := -DFORWARD_ELSEWHERE
$(addprefix $(BUILD)/,$(FORWARD_BUILDS)) $(addprefix $(BUILD)/lib/,$(addsuffix .so,$(FORWARD_BUILDS))): $(FORWARD_OBJ)
.SECONDARY: $(COMMON_OBJ) $(LIB_OBJ) $(FORWARD_OBJ) $(addprefix $(BUILD)/obj/,$(addsuffix .o,$(BUILDS)))
$(addprefix $(BUILD)/obj/,$(addsuffix .o,$(SM90A_BUILDS))) $(addprefix $(BUILD)/exercises/,$(SM90A_CHAPTERS)): \
    private GENCODE := -gencode=arch=compute_90a,code=sm_90a
arch_of = $(if $(filter $(1),$(SM90A_BUILDS)),sm_90a,$(ARCH))

.PHONY: all lib run test bench compare sanitize diff profile sass exercise grade handout ablation train generate peaks \
        help clean FORCE
.DEFAULT_GOAL := all

all: $(addprefix $(BUILD)/,$(BUILDS)) $(PY_DEPS)

# Rebuild when the flags change (ARCH=..., a moved checkout): BUILD/.flags holds the compile line,
# rewritten only when it differs, so that `make -q` and `make -n` tell whether a build is current.
FLAGS_LINE := $(NVCC) $(NVFLAGS) $(GENCODE)
ifneq ($(if $(wildcard $(BUILD)/.flags),$(file < $(BUILD)/.flags)),$(FLAGS_LINE))
$(BUILD)/.flags: FORCE
endif
$(BUILD)/.flags:
	$(shell mkdir -p $(BUILD))$(file > $@,$(FLAGS_LINE))

# Compile, keep the compiler's output in $(2) (ptxas' register/spill report for the chapters), and
# fail on any warning.
compile = $(NVCC) $(NVFLAGS) $(GENCODE) $(1) > $(2) 2>&1 || { cat $(2); exit 1; }; \
          ! grep -i 'warning' $(2) || { echo "$@: compiler warnings above"; exit 1; }

$(BUILD)/common/%.o: common/%.cu $(HEADERS) common/library.h $(BUILD)/.flags
	@mkdir -p $(dir $@)
	@echo "nvcc  $< -> $@"
	@$(call compile,$(PIC) -c -o $@ $<,$@.log)

$(BUILD)/common/%.o: common/%.c $(HEADERS) $(BUILD)/.flags
	@mkdir -p $(dir $@)
	@echo "nvcc  $< -> $@"
	@$(call compile,$(PIC) -c -o $@ $<,$@.log)

$(FORWARD_OBJ): 09_backward/forward.cu 09_backward/forward.h $(HEADERS) $(BUILD)/.flags
	@mkdir -p $(dir $@)
	@echo "nvcc  $< -> $@"
	@$(call compile,$(PIC) -c -o $@ $<,$@.log)

# One object per build (a chapter, a step of 08); its ptxas report in BUILD/<build>.log. Then the
# executable (with the harness) and the library (make lib) link it.
.SECONDEXPANSION:
$(BUILD)/obj/%.o: $$(call source_of,$$*) $(HEADERS) $(CHAPTER_HEADERS) $(BUILD)/.flags
	@mkdir -p $(dir $@)
	@echo "nvcc  $< -> $(BUILD)/$* ($(call arch_of,$*))"
	@$(call compile,$(PIC) $(FORWARD_FLAG) -c -o $@ $<,$(BUILD)/$*.log)

$(addprefix $(BUILD)/,$(BUILDS)): $(BUILD)/%: $(BUILD)/obj/%.o $(COMMON_OBJ)
	@$(NVCC) $(GENCODE) -o $@ $^

# The chapters as libraries (common/library.h; docs/design.md): BUILD/lib/X.so beside each executable
# BUILD/X of `all`, the same object linked with common/library.cu (the C ABI; no harness, no main).
LIBS := $(addprefix $(BUILD)/lib/,$(addsuffix .so,$(BUILDS)))
lib: $(LIBS)

$(BUILD)/lib/%.so: $(BUILD)/obj/%.o $(LIB_OBJ) common/library.map
	@mkdir -p $(dir $@)
	@echo "link  $(BUILD)/obj/$*.o -> $@"
	@$(NVCC) $(GENCODE) -shared -Xlinker --version-script=$(CURDIR)/common/library.map -o $@ \
	    $(filter %.o,$^)

# A student copy (make exercise) builds as the chapter does, from exercises/NN_name/attention.cu.
$(BUILD)/exercises/%: exercises/%/attention.cu $(COMMON_OBJ) $(HEADERS) $(BUILD)/.flags
	@mkdir -p $(dir $@)
	@echo "nvcc  $< -> $@ ($(call arch_of,$*))"
	@$(call compile,-o $@ $< $(COMMON_OBJ),$@.log)

.venv/.ready: requirements.txt
	@echo "setting up .venv with NumPy (the system Python lacks it)"
	$(PYTHON_SYS) -m venv .venv
	.venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements.txt
	@touch $@

$(TEST_SITE)/.ready: requirements-dev.txt $(PY_DEPS)
	@echo "installing the test runner into $(TEST_SITE) (pytest, pytest-xdist: requirements-dev.txt)"
	$(PYTHON) -m pip install --quiet --disable-pip-version-check --upgrade --target $(TEST_SITE) -r requirements-dev.txt
	@touch $@

# A target that needs a GPU says so in one line and exits 77 (the skip code; make reports it as
# "Error 77") where the chapter binary $(2) finds none it can use: $(call need_gpu,target,binary).
need_gpu = $(PYTHON) common/runner.py gpu "make $(1)" $(2)

run: all
	@$(call need_gpu,run,$(BUILD)/$(firstword $(CHAPTERS)))
	@$(PYTHON) common/stages.py run --build $(BUILD) $(CHAPTERS)

# make test: the builds (make all lib, the native build or sm_80/89/90 where there is no GPU), then
# pytest on tests/ (pytest.ini), on every core; TEST_ARGS go to pytest (e.g. TEST_ARGS='-k cli -v').
TEST_JOBS ?= auto
TEST_ARGS ?=
test: $(TEST_DEPS)
	@echo "== make test, 1 of 2: make all lib, every build for $(ARCH_WORDS) (nothing to do where current)"
	@$(MAKE) --no-print-directory -j$(shell nproc 2>/dev/null || echo 2) all lib
	@echo "== make test, 2 of 2: pytest: the CPU tests, and the GPU tests where a GPU is usable"
	@FA_BUILD=$(BUILD) $(TEST_ENV) $(PYTHON) -m pytest -n $(TEST_JOBS) $(TEST_ARGS)

sanitize: all $(TEST_DEPS)
	@$(call need_gpu,sanitize,$(BUILD)/$(firstword $(CHAPTERS)))
	@FA_BUILD=$(BUILD) $(TEST_ENV) $(PYTHON) -m pytest -m sanitize -n $(TEST_JOBS) $(TEST_ARGS)

# make bench: the forward's sweep, then the backward's (the chapters that have a backward pass and
# PyTorch's backward: docs/results/<gpu>.backward.csv). BENCH_PASS=backward: the
# backward's alone, the forward's rows left as they are (BENCH_PASS=forward: the forward's alone);
# QUICK=1: only N = 1k and 4k; SEQLENS=512,2048: only those N; HEADDIM=128 (or 64): only that D. A sweep
# split so into runs still times the anchors beside the chapters at every shape. make compare takes them too.
BENCH_PASS ?= both
bench_flags = --pass $(BENCH_PASS)$(if $(filter-out 0,$(QUICK)), --quick)$(if $(SEQLENS), --seqlens $(SEQLENS))$(if \
              $(HEADDIM), --headdim $(HEADDIM))

bench: all
	@$(call need_gpu,bench,$(BUILD)/$(firstword $(CHAPTERS)))
	@$(PYTHON) common/stages.py bench --build $(BUILD) $(bench_flags) $(CHAPTERS)

compare: $(PY_DEPS)
	@$(PYTHON) common/stages.py compare --build $(BUILD) $(bench_flags)

# A chapter's folder from its number: 4, 04 and 04_fused all name 04_fused (empty if none); a step
# such as 08.3 names its chapter's folder.
chapter_dir = $(firstword $(patsubst %/attention.cu,%,$(wildcard $(call chapter_of,$(1))_*/attention.cu 0$(call chapter_of,$(1))_*/attention.cu $(call chapter_of,$(1))/attention.cu)))
chapter_of = $(firstword $(subst ., ,$(1)))
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

CH ?= 04
CH_DIR = $(call chapter_dir,$(CH))
profile:
	@test -n "$(CH_DIR)" || $(call no_chapter,$(CH),CH)
	@$(MAKE) --no-print-directory -s $(BUILD)/$(CH_DIR)
	@command -v ncu >/dev/null 2>&1 || { echo "make profile: skipped: Nsight Compute (ncu) not found: install it with the CUDA toolkit, or put it on PATH"; exit 77; }
	@$(call need_gpu,profile,$(BUILD)/$(CH_DIR))
	ncu --clock-control none --set full --launch-count 3 \
	    $(BUILD)/$(CH_DIR) --warmup 0 --iters 1 --no-check --batch 4 --heads 16 --seqlen 4096

# The SASS of one architecture (the build's, sm_90 for a multi-architecture build; 08: sm_90a), all
# kernels or those whose name contains KERNEL (make sass CH=07 KERNEL=attention); a step: CH=08.3.
# cuobjdump and nvdisasm from the CUDA toolkit, or fetched into .cache/tools (common/cuda_tools.py).
SASS_ARCH ?= $(if $(filter multi,$(ARCH)),sm_90,$(ARCH))
sass:
	@build=$$($(PYTHON_SYS) common/runner.py build '$(CH)') || exit 2; \
	$(MAKE) --no-print-directory -s $(BUILD)/$$build && \
	tools=$$($(PYTHON) common/cuda_tools.py path) && PATH="$$tools:$$PATH" cuobjdump --dump-sass \
	    -arch $(if $(filter $(CH_DIR),$(SM90A_CHAPTERS)),sm_90a,$(SASS_ARCH)) $(BUILD)/$$build | \
	    awk -v k='$(KERNEL)' '/Function :/ { show = (k == "" || index($$0, k) > 0) } k == "" || show'

# Graded exercises (common/exercises.py): a student copy of a chapter in exercises/ (EX= one
# exercise, or a comma-separated list; FORCE=1 overwrites a copy you have edited), then its grade:
# PASS, FAIL, or UNGRADED (the grader's exit 77) when a check that decides it could not run here
# (no GPU, say). The copy builds with the rule above, as BUILD/exercises/NN_name, with this
# Makefile's flags.
# CH=torch: the PyTorch op's exercise (common/torch_exercise.py, graded by common/torch_grade.py).
ifeq ($(CH),torch)
exercise: $(PY_DEPS)
	@$(PYTHON) common/torch_grade.py make$(if $(filter-out 0,$(FORCE)), --force)

grade: $(PY_DEPS)
	@$(MAKE) --no-print-directory -s $(BUILD)/lib/07_async_pipeline.so $(BUILD)/lib/09_backward.so
	@$(PYTHON) common/torch_grade.py grade --build $(BUILD)
else
exercise: $(PY_DEPS)
	@test -n "$(CH_DIR)" || $(call no_chapter,$(CH),CH)
	@$(PYTHON) common/exercises.py make $(CH_DIR)$(if $(EX), --only $(EX))$(if $(filter-out 0,$(FORCE)), --force)

grade: $(PY_DEPS)
	@test -n "$(CH_DIR)" || $(call no_chapter,$(CH),CH)
	@$(MAKE) --no-print-directory -s $(BUILD)/$(CH_DIR)
	@$(PYTHON) common/exercises.py grade $(CH_DIR) --build $(BUILD) --make '$(MAKE)'
endif

# A hand-out for a class: BUILD/handout/NN_name.tar.gz, one folder with the student copy of the
# chapter (every exercise cut), the harness, the grader and this Makefile, and no solution: there,
# `make grade CH=NN` grades the copy (a speed gate, which times the solution, says UNGRADED).
handout: $(PY_DEPS)
	@test -n "$(CH_DIR)" || $(call no_chapter,$(CH),CH)
	@$(PYTHON) common/exercises.py handout $(CH_DIR) --out $(BUILD)/handout

# Each idea of a chapter on its own (common/ablation.py): its -D switches built, checked and timed
# in one run -> docs/results/logs/NN/ablation_NN.csv and the table in the chapter's README. The
# chapter is built first, and its binary says whether there is a GPU it runs on.
ablation: $(PY_DEPS)
	@test -n "$(CH_DIR)" || $(call no_chapter,$(CH),CH)
	@$(MAKE) --no-print-directory -s $(BUILD)/$(CH_DIR)
	@$(call need_gpu,ablation CH=$(CH),$(BUILD)/$(CH_DIR))
	@$(PYTHON) common/ablation.py run $(CH_DIR) --build $(BUILD) --make '$(MAKE)'

# A chapter as a PyTorch op (common/torch_op.py) in a small GPT (common/train.py): trained with PyTorch's
# SDPA and with CH's forward (default here: 07; a step such as CH=08.3 too) and 09's backward, on the
# Python standard library's source; the loss curves, each run's tokens/s and a CSV ->
# docs/results/train/. It builds the libraries it loads. TRAIN_ARGS: train.py's options, e.g. --quick
# (200 steps, output under BUILD/train/) or --steps 2000 --batch 16.
# CH=07,08: one SDPA run, then one run per chapter; CH=07@deterministic: 09's backward in its
# deterministic mode. SEEDS=0,1,2: every run once per initialisation seed, all on the same batches.
# Without PyTorch or a GPU: one line, exit 77.
TRAIN_CH = $(if $(filter file,$(origin CH)),07,$(CH))
TRAIN_ARGS ?=
SEEDS ?=
train: $(PY_DEPS)
	@$(foreach c,$(subst $(comma), ,$(TRAIN_CH)),test -n "$(call chapter_dir,$(firstword $(subst @, ,$(c))))" || $(call no_chapter,$(c),CH);) true
	@$(PYTHON) common/train.py --chapter $(TRAIN_CH) --build $(BUILD)$(if $(SEEDS), --seeds $(SEEDS)) $(TRAIN_ARGS)

# A model make train saved writes text (common/generate.py): the prompt by CH's forward (default 07),
# every next token by 11's decoding from a paged KV cache, beside the same model on SDPA; the text,
# whether both chose the same tokens, tokens/s. PROMPT="...": the text to continue; GEN_ARGS:
# generate.py's options (--model, --tokens, --page-size). Without PyTorch or a GPU: one line, exit 77.
GEN_CH = $(if $(filter file,$(origin CH)),07,$(CH))
GEN_ARGS ?=
generate: $(PY_DEPS)
	@$(PYTHON) common/generate.py --chapter $(GEN_CH) --build $(BUILD)$(if $(PROMPT), --prompt "$(PROMPT)") $(GEN_ARGS)

# The ceilings docs/design.md quotes, measured on this GPU by tools/peaks.cu: fp32 FFMA, fp16
# mma.sync, wgmma fp16 and e4m3 (sm_90a: built so when ARCH is sm_90; skipped in one line on other
# GPUs) and the device copy; the table also goes to docs/results/logs/common/peaks_<gpu>.log.
# Without a GPU it says so in one line (exit 77) and writes nothing.
ifneq ($(filter sm_90 sm_90a,$(ARCH)),)
$(BUILD)/peaks: private GENCODE := -gencode=arch=compute_90a,code=sm_90a
endif
$(BUILD)/peaks: tools/peaks.cu common/gpu_files.h $(BUILD)/.flags
	@echo "nvcc  $< -> $@ ($(if $(filter sm_90 sm_90a,$(ARCH)),sm_90a,$(ARCH)))"
	@$(call compile,-o $@ $<,$@.log)

peaks: $(BUILD)/peaks
	@mkdir -p docs/results/logs/common
	@$(BUILD)/peaks docs/results/logs/common

help:
	@echo "make            build every chapter into $(BUILD)/ (ARCH=$(ARCH); ARCH=sm_90, sm_80, multi...)"
	@echo "make lib        every build above as a library too: $(BUILD)/lib/NN_name.so (C ABI: common/library.h)"
	@echo "make run        run every chapter on the default shape and print the stage table (GPU)"
	@echo "make test       the builds, then pytest: CPU tests, and the GPU's where a GPU is usable (TEST_ARGS='-k NAME -v')"
	@echo "make bench      the benchmark sweep -> docs/results/ (CSV, Markdown, plot) and README table, then the backward's (GPU)"
	@echo "                BENCH_PASS=backward (or forward): that sweep alone; QUICK=1: N = 1k, 4k; SEQLENS=512,2048; HEADDIM=64"
	@echo "make compare    PyTorch SDPA anchors on the bench shapes, forward and backward (GPU, PyTorch; BENCH_PASS, QUICK, SEQLENS, HEADDIM too)"
	@echo "make sanitize   compute-sanitizer memcheck/racecheck/synccheck/initcheck, every chapter (GPU)"
	@echo "make diff A=04 B=05   the one idea chapter B adds over chapter A (A=08.1 B=08.2, A=09.1 B=09.2 ...: steps)"
	@echo "make profile CH=04    Nsight Compute on one chapter (GPU);  make sass CH=04 [KERNEL=name]   its SASS (one arch)"
	@echo "make exercise CH=04 [EX=name] [FORCE=1]   a student copy of the chapter's exercises -> exercises/"
	@echo "make grade CH=04      build and grade exercises/NN_name/attention.cu: PASS, FAIL, or UNGRADED (exit 77) where no GPU runs it"
	@echo "make handout CH=04    the copy, the grader and no solution -> $(BUILD)/handout/NN_name.tar.gz (for a class)"
	@echo "make exercise CH=torch, make grade CH=torch   07 and 09 as a PyTorch op of your own -> exercises/torch/ (GPU, PyTorch)"
	@echo "make ablation CH=07   each idea of 04 or 07 switched off, or the steps of 08 or 09 (its backward), checked and timed in one run (GPU)"
	@echo "make train CH=07 [SEEDS=0,1,2] [TRAIN_ARGS=--quick]   a small GPT trained with SDPA, then with chapter CH's forward and 09's backward (GPU, PyTorch)"
	@echo "make generate [PROMPT=...]   the model make train saved writes text: 07 for the prompt, 11 for each next token, beside SDPA (GPU, PyTorch)"
	@echo "make peaks      this GPU's ceilings (FFMA, mma.sync, wgmma, copy) -> docs/results/logs/common/ (GPU)"
	@echo "make clean      remove $(BUILD)/ and the input/reference cache (.cache/; the tools fetched into .cache/tools and .cache/python stay)"
	@echo "(GPU): without a usable GPU (or PyTorch, where named) the target says why in one line and exits 77, the skip code"
	@echo "chapters: $(CHAPTERS)"

clean:
	rm -rf $(BUILD)
	@if [ -d .cache ]; then find .cache -mindepth 1 -maxdepth 1 ! -name tools ! -name python -exec rm -rf {} +; fi
