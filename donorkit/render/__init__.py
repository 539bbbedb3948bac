"""Files for a box, made from the inventory model: templates and quoting, the Caddy config, the
tunnel's files. Imports inventory/ only."""
