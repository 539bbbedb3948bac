"""The fleet's scenarios (`make testbed`): the real entry point, `pyinfra inventory/testbed.py
deploy.py`, over SSH against five local test hosts (tests/support/hosts.py), converged ONCE by
conftest.py's package fixture, which records what that took (the refused edge, the interrupted
first run, the full run, the second box from the cache). Each scenario module proves one thing
about the converged fleet and leaves it converged and serving, so they run in any order:

- test_converge.py: what the first deploy did (from the record); the boxes that must not
  converge stop with one clear line; a batch of boxes of one stack; the weights fetched again
  after a cut
- test_idempotence.py: a second run changes and restarts nothing; previews touch nothing; drift
  is repaired
- test_verify.py: the verification suite against the fleet; a unit's quoting through systemd;
  a donor's Caddy
- test_edge.py: the edge spreads the hostname, trusts only its fleet, routes around a stopped
  or slow donor
- test_rollout.py: the readiness gate; a rollout stopped by a failing box; a rolling rollout
  with 0 failed requests
- test_operator.py: `make lock`, `make status`, a stopped box said in one line everywhere

The fleet's hosts are torn down when the last scenario ends, before the home donor
(test_tunnel.py) and the real engine (test_real_engine.py) start theirs: this machine holds one
set of test hosts at a time.
"""
