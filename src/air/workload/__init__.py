"""Workloads: the spec (spec.py; read from YAML by loading.py, navigated by schema.py), `--override`
(overrides.py), `air -h config` (config_help.py), code snapshots, secrets and parameters. Import from the
submodules; this package imports nothing, so reading one part never loads the others."""
