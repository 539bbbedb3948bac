# The front door: thin aliases for `donors ...` (donorkit/commands/cli.py; `make help`, `donors --help`).
# Every target sets up what it needs: the project venv (.venv), this checkout installed editable
# with the operator's dependencies (pyproject.toml), plus the `test` extra for test and testbed.
# FLEET=dir everywhere: the operator's fleet directory (donors --fleet; or $DONORS_FLEET);
# without it, the example inventory/donors.yml. Exit codes: make turns any failure into 2;
# `donors` itself exits with its table's codes (donors --help).
#   make test                         unit tests + ruff (no hosts needed; the distro's caddy and
#                                     systemd-analyze (and, as root, nft): apt-installed as root where missing, else
#                                     named with the apt line)
#   make testbed                      local test hosts, full deploy over SSH, verification, teardown
#   make init FLEET=dir               a new fleet directory from the example (donors init)
#   make deploy [LIMIT=...] [DRY=1] [DIFF=1] [YES=1]
#                                     the fleet deployed (donors deploy: pyinfra underneath)
#   make status [LIMIT=...] [JSON=1] [WIDE=1]
#                                     the fleet at a glance: one row per box, every box at once
#   make lock [BRANCH=main] [ALL=1]   pin each served model's checkpoint to the branch's commit
#                                     (donors pin; `make pin` the same)
#   make reference [LIMIT=...]        the canaries' reference, recorded on the trusted builders
#                                     (donors reference; README "Canaries")
#   make verify [LIMIT=...]           verification suite against the fleet (honours DONORS_FILE)
#                                     LIMIT everywhere: names, groups (donors, edges, a card
#                                     profile), globs (tb-*), a comma list: pyinfra's --limit
#   make render HOST=name OUT=dir     every file the deploy would write to HOST (donor or edge), under OUT
#   make rollout [BATCH=N] [FROM=host] [INVENTORY=file] [PLAN=1] [UNLOCK=1]
#                                     the fleet a batch at a time, each back in service before
#                                     the next (donors rollout; README "Upgrades and swaps");
#                                     PLAN=1 prints the plan and touches nothing; UNLOCK=1 clears
#                                     a stale rollout lock
#   make accept [LIMIT=host] [VIA=url] acceptance run per donor through its public hostname
#                                     (records under results/accept; non-zero below baseline)
#   make gpu-engine-carry             what the real-engine GPU harness carries (docs/gpu.md)

VENV := .venv
BIN := $(VENV)/bin
DONORS = $(BIN)/donors $(if $(FLEET),--fleet "$(FLEET)")
PYTHON ?= python3

.PHONY: help venv venv-test test testbed init deploy verify render lint rollout accept reference gpu-engine-carry status lock pin join-file join

help:
	@grep -E '^#   ' Makefile | sed 's/^#  //'
	@echo "Every action, with its options: $(BIN)/donors --help (make venv first)"

venv: $(VENV)/.installed
venv-test: $(VENV)/.installed-test

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "the operator's machine needs Python 3.11 or newer ($(PYTHON) is $$($(PYTHON) -V 2>&1)): install python3.11 and python3.11-venv and add PYTHON=python3.11" >&2; exit 2; }
	@$(PYTHON) -m venv $(VENV) >&2
	@$(BIN)/pip install -q --disable-pip-version-check -e . >&2
	@touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test]'
	touch $@

lint: venv-test
	$(BIN)/ruff check .

test: lint
	$(BIN)/python -m tests.support.host_tools --install
	$(BIN)/pytest -q tests/unit pyinfra_declared/tests

testbed: venv-test
	$(BIN)/python -m tests.support.host_tools --install
	$(BIN)/python -m pytest -p no:cacheprovider -x -v -s tests/testbed

init: venv
	@test -n "$(FLEET)" || { echo "usage: make init FLEET=<new fleet directory>" >&2; exit 2; }
	@$(BIN)/donors init "$(FLEET)"

deploy: venv
	@$(DONORS) deploy $(if $(LIMIT),--limit "$(LIMIT)") $(if $(DRY),--dry) $(if $(DIFF),--diff) $(if $(YES),-y)

verify: venv
	@$(DONORS) verify $(if $(LIMIT),--limit "$(LIMIT)")

render: venv
	@test -n "$(HOST)" -a -n "$(OUT)" || { echo "usage: make render HOST=<donor or edge> OUT=<dir>" >&2; exit 2; }
	@$(DONORS) render -- "$(HOST)" "$(OUT)"

rollout: venv
	@$(DONORS) rollout $(if $(BATCH),--batch "$(BATCH)") $(if $(FROM),--from "$(FROM)") $(if $(INVENTORY),--inventory "$(INVENTORY)") $(if $(PLAN),--plan) $(if $(UNLOCK),--unlock)

reference: venv
	@$(DONORS) reference $(if $(LIMIT),--limit "$(LIMIT)")

accept: venv
	@$(DONORS) accept $(if $(LIMIT),--limit "$(LIMIT)") $(if $(VIA),--via "$(VIA)")

gpu-engine-carry: venv
	$(BIN)/python -m gpu.engine_carry

status: venv
	@$(DONORS) status $(if $(LIMIT),--limit "$(LIMIT)") $(if $(JSON),--json) $(if $(WIDE),-v)

lock pin: venv
	@$(DONORS) pin $(if $(BRANCH),--branch "$(BRANCH)") $(if $(ALL),--all)

# A home donor behind NAT (README "A home donor behind NAT"):
#   make join-file HOST=name OUT=file  on the operator's machine: the donor's join file, signed
#                                      with the CA key; prints the CA's fingerprint
#   make join JOIN=file FINGERPRINT=fp on the box, as root: the file checked (signed by the CA of
#                                      that fingerprint) and what it does said, the tunnel up
#                                      (pyinfra @local), then the box's public keys for the operator
join-file: venv
	@test -n "$(HOST)" -a -n "$(OUT)" || { echo "usage: make join-file HOST=<donor> OUT=<file>" >&2; exit 2; }
	@$(DONORS) join-file -- "$(HOST)" "$(OUT)"

join: venv
	@test -n "$(JOIN)" -a -n "$(FINGERPRINT)" || { echo "usage: make join JOIN=<join file> FINGERPRINT=<the operator's CA fingerprint>" >&2; exit 2; }
	@$(BIN)/donors join --fingerprint "$(FINGERPRINT)" -- "$(JOIN)"
