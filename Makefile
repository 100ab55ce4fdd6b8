# The two commands of the README:  make lab  (set up, start the course)  ·  make test  (set up, test)
# A GPU box that already has a CUDA torch keeps it: the venv sees the system's packages, and
# torch==2.13.0 (a CPU build) is installed only where no torch is importable.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PORT   ?= 8888

.PHONY: setup lab test html clean

setup: $(VENV)/.dplab-installed

$(VENV)/.dplab-installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "torch==2.13.0"
	$(PY) -m pip install -e ".[lab,test]"
	touch $@

# JupyterLab refuses to run as root without --allow-root (a cloud box or container often is root).
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root,)

lab: setup
	@echo "Starting JupyterLab on 127.0.0.1; open the URL with the token that it prints below."
	cd notebooks && ../$(VENV)/bin/jupyter lab --no-browser --ip=127.0.0.1 --port=$(PORT) $(ALLOW_ROOT)

test: setup
	$(PY) -m pytest tests/ --nbval-lax notebooks/

html: setup
	$(PY) -m dplab html --out build/

clean:
	rm -rf build/ runs/
