# Two newcomer commands: `make demo` and `make test`. Each creates .venv on first use.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo demo-user test lint bench bench-smoke schedules venv clean gpu-check gpu-wheels

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

# The whole loop on the default example, configs/resnet50.yaml (batch 32, 3x128x128):
# measure a real step, plan for 60% of its peak, then run the plan and check it.
demo: $(STAMP)
	$(BIN)/monet profile resnet50
	$(BIN)/monet solve configs/resnet50.profile.yaml --budget 60%
	$(BIN)/monet apply schedules/resnet50-60pct.yaml --check

# The same loop on a user model given as package.module:function.
demo-user: $(STAMP)
	$(BIN)/monet profile monet_cli.examples.models:skip_concat_net --input-shape 3,64,64 --batch-size 16 \
		-o configs/skip_concat_net.profile.yaml
	$(BIN)/monet solve configs/skip_concat_net.profile.yaml --budget 75%
	$(BIN)/monet apply schedules/skip_concat_net-75pct.yaml --check

# The full benchmark (tens of minutes on 2 CPU cores): results in bench/results, docs/benchmarks.md.
bench: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[test,bench]'
	$(BIN)/python bench/solver_quality.py
	$(BIN)/python bench/run.py
	$(BIN)/python bench/scale.py
	$(BIN)/python bench/reach.py
	$(BIN)/python bench/time_gap.py
	$(BIN)/python bench/profile_spread.py
	$(BIN)/python bench/variants.py
	$(BIN)/python bench/report.py
	$(BIN)/python bench/real_models.py

bench-smoke: $(STAMP)
	$(BIN)/python bench/run.py --smoke --out /tmp/monet-bench-smoke

# Re-make the shipped CPU profiles and schedules (one solver worker: deterministic).
SHIPPED := resnet50:60% vgg16:98% mobilenet_v2:40% vit_b_16:80% gpt:50% unet:70%
schedules: $(STAMP)
	for item in $(SHIPPED); do \
		name=$${item%%:*}; budget=$${item#*:}; \
		$(BIN)/monet profile $$name --device cpu || exit 1; \
		CI=1 $(BIN)/monet solve configs/$$name.profile.yaml --budget $$budget || exit 1; \
	done

# On a CUDA machine: pytest -m gpu, then profile -> solve (60% and the smallest peak) -> apply
# --check on resnet50, the tiny GPT and a LLaMA-style decoder; writes bench/results/gpu-check.json
# and docs/gpu.md. Exits 9 without a GPU. It runs on whatever Python holds torch there (GPU_PYTHON),
# with monet from this checkout; OR-Tools comes from `make gpu-wheels` when that machine has none.
# GPU_CHECK_ARGS passes options on, e.g. GPU_CHECK_ARGS='--workloads gpt --save /tmp/plans'.
GPU_PYTHON ?= $(if $(wildcard $(BIN)/python),$(BIN)/python,python3)
GPU_WHEELS := dist/gpu-wheels
gpu-check:
	@if [ -d $(GPU_WHEELS) ] && ! $(GPU_PYTHON) -c "import ortools" 2>/dev/null; then \
		$(GPU_PYTHON) -m pip install --quiet --no-deps --no-index $(GPU_WHEELS)/*.whl; fi
	$(GPU_PYTHON) bench/gpu_check.py $(GPU_CHECK_ARGS)

# Wheels for a GPU machine without network access (Python 3.12, x86_64): OR-Tools and the two
# packages it needs that such images lack, plus monet itself.
gpu-wheels: $(STAMP)
	rm -rf $(GPU_WHEELS)
	$(BIN)/python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
		--platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64 -d $(GPU_WHEELS) \
		"ortools==$$($(BIN)/python -c 'import ortools; print(ortools.__version__)')" immutabledict "protobuf>=6.33.1,<6.34"
	$(BIN)/python -m pip wheel --quiet --no-deps -w $(GPU_WHEELS) .

test: $(STAMP)
	$(BIN)/python -m pytest -q

lint: $(STAMP)
	$(BIN)/python -m ruff check .
	$(BIN)/python -m ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache
