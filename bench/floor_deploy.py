"""The floor of a no-op re-run (bench/noop_rerun.py's `floor` mode): pyinfra starts, connects
to each host (with our SSH settings, from inventory/gpus.py) and reads one fact there, as our
deploy reads the host profile, then has nothing to do. What our deploy costs above this is the
checking itself."""

from pyinfra import host
from pyinfra.facts.server import Command

host.get_fact(Command, command="true")
