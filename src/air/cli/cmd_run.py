"""`air run FILE`: validate, plan, submit (or just show the plan with --dry-run), optionally watch."""

from __future__ import annotations

import sys

import click
import yaml

from air.cli.main import common, settings
from air.cli.output import envelope, event, quiet, shape_text, status, stderr
from air.errors import UserInputError


class _LiteralDumper(yaml.SafeDumper):
    """Multi-line strings (the command) as YAML literal blocks, the way the user wrote them."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_LiteralDumper.add_representer(str, _str)


@click.command()
@click.argument("file_arg", required=False, metavar="FILE")
@click.option("-f", "--file", "file_opt", default=None, metavar="FILE", help="Workload YAML (.yaml/.yml).")
@click.option("--override", "overrides", multiple=True, metavar="KEY.PATH=VALUE",
              help="Change a field of the YAML; wins over the file. Repeatable, e.g. --override compute.num_accelerators=2.")
@click.option("--dry-run", is_flag=True, help="Validate and print the plan (nodes, env, snapshot); create nothing.")
@click.option("--watch", is_flag=True, help="Stream status and every node's log ([node N] prefixes) until the run ends; exit code = outcome.")
@click.option("--node", "watch_node", default=None, type=click.IntRange(min=0), metavar="N",
              help="With --watch: stream only node N's log (default: every node's).")
@click.option("--idempotency-key", default=None, metavar="KEY",
              help="Submitting again with the same key returns the existing run (≤64 chars).")
@common
def run(file_arg: str | None, file_opt: str | None, overrides: tuple[str, ...], dry_run: bool, watch: bool,
        watch_node: int | None, idempotency_key: str | None) -> int:
    """Run a workload: its command once per node, with retries, timeouts, logs and MLflow."""
    s = settings()
    if file_arg and file_opt and file_arg != file_opt:
        raise UserInputError("Give the workload file once: either FILE or -f FILE.")
    path = file_opt or file_arg
    if not path:
        raise UserInputError("No workload file given.", hint="Usage: air run -f train.yaml [--dry-run] [--watch]")
    if watch_node is not None and not watch:
        raise UserInputError("--node narrows what --watch streams; it needs --watch.",
                             hint="Use: air run -f train.yaml --watch --node 1   (or later: air logs ID --node 1)")
    if idempotency_key is not None and not (0 < len(idempotency_key.strip()) <= 64):
        raise UserInputError("--idempotency-key must be 1 to 64 characters.")
    from air.client.sdk import Client
    from air.wire import DryRunAnswer
    from air.workload.loading import load_workload

    client = Client(profile=s.profile)  # this machine, or a server: one path for both
    spec = load_workload(path, list(overrides))
    if watch_node is not None and watch_node >= spec.num_nodes:
        raise UserInputError(f"--node {watch_node}: the workload has {spec.num_nodes} node(s).",
                             hint=f"Nodes are numbered 0 to {spec.num_nodes - 1}.")
    answer = client.send(spec, idempotency_key=idempotency_key, dry_run=dry_run)
    if isinstance(answer, DryRunAnswer):
        return _dry_run(answer.plan)
    run_id, existing = answer.run_id, answer.existing
    if s.json and not watch:
        envelope({"run_id": run_id, "status": answer.status.value, "existing": existing})
    elif s.json:
        event("SUBMITTED", run_id=run_id, existing=existing)
    else:
        what = "Existing run (same idempotency key)" if existing else "Submitted run"
        shape = shape_text(answer.num_nodes, answer.accelerator, answer.num_nodes * answer.per_node)
        status(f"{what} {run_id}  ({shape}, experiment {answer.experiment})")
        if not watch:
            status(f"Follow it: air logs {run_id} --follow   Status: air get run {run_id}")
            if quiet():  # the result of a submit is the run's id: `ID=$(air -q run -f train.yaml)`
                sys.stdout.write(run_id + "\n")
    if not watch:
        return 0
    try:
        from air.cli.watch import watch as watch_run

        return watch_run(client, run_id, json_mode=s.json, verbose=s.verbose, node=watch_node)
    except KeyboardInterrupt:
        return detached(run_id, json_mode=s.json)


def detached(run_id: str, *, json_mode: bool) -> int:
    """Ctrl-C on `--watch` stops watching, not the run (it lives in its own session): say how to get back
    to it or stop it, and exit as the shell's interrupted commands do (130)."""
    if json_mode:
        event("DETACHED", run_id=run_id)
    stderr(f"\nStopped watching; the run goes on: air logs {run_id} / air cancel {run_id}")
    return 130


def _dry_run(plan: dict[str, object]) -> int:
    if settings().json:
        envelope({"status": "DRY_RUN_OK", "plan": plan})
    else:
        sys.stdout.write(yaml.dump(plan, Dumper=_LiteralDumper, sort_keys=False, width=100))
        stderr("DRY_RUN_OK: the workload is valid; nothing was created.")
    return 0
