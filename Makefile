# make demo: install what is missing, then standard vs anchored training on the embedded dataset.
# make test: the whole test suite (what CI runs), one worker per core; make test-fast: without the tests marked slow.
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.fastanchor-installed
APT_PACKAGES := libopencv-dev libturbojpeg0-dev pkg-config chromium chromium-driver
# one pytest worker per core, each test file on one worker (its module fixtures built once), the files in the order
# tests/conftest.py gives them (longest first; xdist would otherwise order them by their number of tests); PARALLEL= runs serially
PARALLEL ?= -n auto --dist loadfile --no-loadscope-reorder
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: demo test test-fast setup clean

demo: $(STAMP)
	$(VENV)/bin/fastanchor demo $(ARGS)

test: $(STAMP)
	$(VENV)/bin/python -m pytest $(PARALLEL) $(ARGS)

test-fast: $(STAMP)
	$(VENV)/bin/python -m pytest $(PARALLEL) -m "not slow" $(ARGS)

setup: $(STAMP)

# Re-run only when the dependency files change: a second `make demo` skips this in seconds.
$(STAMP): pyproject.toml constraints.txt
	@if ! dpkg -s $(APT_PACKAGES) >/dev/null 2>&1; then \
		echo "== installing the system libraries FFCV builds against and the headless browser the report test opens: $(APT_PACKAGES)"; \
		$(SUDO) apt-get update -qq && $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(APT_PACKAGES); \
	fi
	@[ -x $(VENV)/bin/python ] || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	@# setuptools says, for every editable install of a package whose root is the repository (it needs a meta
	@# path finder), "Editable installation ... may take precedence": informational only; that one notice is filtered.
	PYTHONWARNINGS="ignore:Editable installation" $(VENV)/bin/python -m pip install -q -c constraints.txt -e ".[eval,ffcv,dali,wds,test]"
	@touch $(STAMP)

clean:
	rm -rf $(VENV) data runs
