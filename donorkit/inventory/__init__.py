"""The inventory model: value types, the schema, the typed host data, the loader (fleet.py), the
tunnel plan, `--limit`, the PKI, paths and errors. Imports none of render/, box/, commands/."""
