# The front door. Every target sets up what it needs: the project venv (.venv), this checkout
# installed editable with the operator's dependencies (pyproject.toml), plus the `test` extra for
# test and testbed.
#   make test                         unit tests + ruff (no hosts needed; the distro's caddy and
#                                     systemd-analyze (and, as root, nft): apt-installed as root where missing, else
#                                     named with the apt line)
#   make testbed                      local test hosts, full deploy over SSH, verification, teardown
#   make status [LIMIT=...] [JSON=1]  the fleet at a glance: one row per box, every box at once
#   make lock [BRANCH=main] [ALL=1]   pin each served model's checkpoint to the branch's commit
#   make verify [LIMIT=...]           verification suite against the fleet (honours DONORS_FILE)
#                                     LIMIT everywhere: names, groups (donors, edges, a card
#                                     profile), globs (tb-*), a comma list: pyinfra's --limit
#   make render HOST=name OUT=dir     every file the deploy would write to HOST (donor or edge), under OUT
#   make rollout [BATCH=N] [FROM=host] [INVENTORY=file] [PLAN=1] [UNLOCK=1]
#                                     the fleet a batch at a time, each back in service before
#                                     the next (python -m donorkit.rollout; README "Upgrades and swaps");
#                                     PLAN=1 prints the plan and touches nothing; UNLOCK=1 clears
#                                     a stale rollout lock
#   make accept [LIMIT=host] [VIA=url] acceptance run per donor through its public hostname
#                                     (records under results/accept; non-zero below baseline)
#   make gpu-engine-carry             what the real-engine GPU harness carries (docs/gpu.md)

VENV := .venv
BIN := $(VENV)/bin
PYTHON ?= python3

.PHONY: venv venv-test test testbed verify render lint rollout accept gpu-engine-carry status lock join-file join

venv: $(VENV)/.installed
venv-test: $(VENV)/.installed-test

$(VENV)/.installed: pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 11))' || { echo "the operator's machine needs Python 3.11 or newer ($(PYTHON) is $$($(PYTHON) -V 2>&1)): install python3.11 and python3.11-venv and add PYTHON=python3.11" >&2; exit 2; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test]'
	touch $@

lint: venv-test
	$(BIN)/ruff check .

test: lint
	$(BIN)/python -m tests.unit.host_tools --install
	$(BIN)/pytest -q tests/unit pyinfra_declared/tests

testbed: venv-test
	$(BIN)/python -m tests.unit.host_tools --install
	$(BIN)/python -m pytest -p no:cacheprovider -x -v -s tests/testbed

verify: venv
	$(BIN)/pytest -q -n auto tests/verify $(if $(LIMIT),--limit $(LIMIT))

render: venv
	@test -n "$(HOST)" -a -n "$(OUT)" || { echo "usage: make render HOST=<donor or edge> OUT=<dir>" >&2; exit 2; }
	$(BIN)/python -m donorkit.render_cli -- "$(HOST)" "$(OUT)"

rollout: venv
	$(BIN)/python -m donorkit.rollout $(if $(BATCH),--batch "$(BATCH)") $(if $(FROM),--from "$(FROM)") $(if $(INVENTORY),--inventory "$(INVENTORY)") $(if $(PLAN),--plan) $(if $(UNLOCK),--unlock)

accept: venv
	$(BIN)/python -m donorkit.accept $(if $(LIMIT),--limit "$(LIMIT)") $(if $(VIA),--via "$(VIA)")

gpu-engine-carry: venv
	$(BIN)/python -m gpu.engine_carry

status: venv
	$(BIN)/python -m donorkit.status $(if $(LIMIT),--limit "$(LIMIT)") $(if $(JSON),--json)

lock: venv
	$(BIN)/python -m donorkit.lock $(if $(BRANCH),--branch "$(BRANCH)") $(if $(ALL),--all)

# A home donor behind NAT (README "A home donor behind NAT"):
#   make join-file HOST=name OUT=file  on the operator's machine: the donor's join file, signed
#                                      with the CA key; prints the CA's fingerprint
#   make join JOIN=file FINGERPRINT=fp on the box, as root: the file checked (signed by the CA of
#                                      that fingerprint) and what it does said, the tunnel up
#                                      (pyinfra @local), then the box's public keys for the operator
join-file: venv
	@test -n "$(HOST)" -a -n "$(OUT)" || { echo "usage: make join-file HOST=<donor> OUT=<file>" >&2; exit 2; }
	$(BIN)/python -m donorkit.tunnel_join join-file "$(HOST)" "$(OUT)"

join: venv
	@test -n "$(JOIN)" -a -n "$(FINGERPRINT)" || { echo "usage: make join JOIN=<join file> FINGERPRINT=<the operator's CA fingerprint>" >&2; exit 2; }
	$(BIN)/python -m donorkit.tunnel_join check "$(JOIN)" --fingerprint "$(FINGERPRINT)"
	JOIN_FILE="$(JOIN)" JOIN_FINGERPRINT="$(FINGERPRINT)" $(BIN)/pyinfra -y inventory/join.py deploy.py
	$(BIN)/python -m donorkit.tunnel_join box-keys "$(JOIN)" --fingerprint "$(FINGERPRINT)"
